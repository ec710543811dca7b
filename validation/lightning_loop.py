"""Lightning's own ``Trainer`` measured as its users run it (issue 27): a ``LightningModule`` around a
tiny Hugging Face Llama from a config (random weights, CPU), ``Trainer(accelerator="cpu",
strategy=..., precision=...)``, ``fit`` for a few steps; the peak of live tensors over the last step
(torch's MemTracker, calibrate.measure's meter, from the batch's start to its end: forward, Lightning's
``zero_grad``, backward, optimizer step) against ``memplan estimate --recipe lightning`` of the same
job. Multi-rank cases run under torchrun (Lightning's DDP takes torchelastic's environment), rank 0
records.

    python -m validation.lightning_loop            # measure every case not yet recorded, then the table
    python -m validation.lightning_loop --report   # measured, estimated today, error %
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from validation import measured

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "validation" / "records" / "lightning_loop_cpu.jsonl"
STEPS = 3
"""Optimizer steps per case: the last one measured (the optimizer states exist from the first)."""

CASES: dict[str, dict[str, Any]] = {
    # name: the Trainer's strategy and devices, its precision, the job's shapes and checkpointing
    "ddp-fp32": dict(strategy="ddp", devices=2, precision="32-true", micro_batch=2, seq_len=256, ac=False),
    "ddp-bf16-mixed": dict(strategy="ddp", devices=2, precision="bf16-mixed", micro_batch=2, seq_len=256, ac=False),
    "single-fp32-ac": dict(strategy="auto", devices=1, precision="32-true", micro_batch=4, seq_len=128, ac=True),
}
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "amp-bf16"}
"""Lightning's precision plugins as memplan's precisions: ``bf16-mixed`` is autocast over fp32
parameters (lightning/pytorch/plugins/precision/amp.py MixedPrecision)."""


def _model_spec():
    from validation.finetune_matrix import LLAMA

    return LLAMA


def measure(name: str) -> dict | None:
    """One case's ``Trainer.fit``; the last step's peak of live tensors (rank 0's record)."""
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    from calibrate.measure import _CpuMeter
    from calibrate.workloads import hf_config

    case, spec = CASES[name], _model_spec()
    meter, peaks = _CpuMeter(), {}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(hf_config(spec, attention="sdpa"))
            if case["ac"]:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class LastStep(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            meter.new_step()  # MemTracker counts one forward per module between resets
            if batch_idx == STEPS - 1:
                meter.reset_peak()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == STEPS - 1:
                peaks["step"] = meter.peak()

    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (case["micro_batch"] * case["devices"] * STEPS, case["seq_len"]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=case["micro_batch"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=case["devices"],
        strategy=case["strategy"],
        precision=case["precision"],
        max_steps=STEPS,
        callbacks=[LastStep()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    with meter:
        trainer.fit(Module(), loader)
    if trainer.global_rank != 0:
        return None
    return {
        "case": name,
        "model": spec.name,
        **case,
        "measured_peak_bytes": peaks["step"],
        "categories": meter.categories(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "transformers": __import__("transformers").__version__,
    }


def estimate(record: dict) -> int:
    """memplan's estimate of the case's job under the lightning recipe."""
    from memplan import api

    ddp = record["strategy"] == "ddp"
    result = api.estimate(
        model=_model_spec(),
        recipe="lightning",
        strategy="ddp" if ddp else "single",
        gpus=record["devices"],
        device="cpu",
        precision=PRECISIONS[record["precision"]],
        micro_batch=record["micro_batch"],
        seq_len=record["seq_len"],
        ac="full" if record["ac"] else "none",
        optimizer="adamw",
        calibration=None,
    )
    return result.estimates[0].allocated_bytes


def report(records: list[dict]) -> str:
    return measured.table(records, estimate, decimals=2)


def load() -> list[dict]:
    return measured.load(OUT)


def _run(name: str) -> None:
    """One case in this process (a torchrun rank for DDP): rank 0 appends its record."""
    record = measure(name)
    if record is not None:
        with OUT.open("a") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:
        _run(argv[1])
        return
    if "--report" not in argv:
        done = {r["case"] for r in load()}
        for name in (n for n in CASES if n not in done):  # each case in its own processes
            devices = CASES[name]["devices"]
            command = [sys.executable, "-m", "validation.lightning_loop", "--case", name]
            if devices > 1:
                command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={devices}"] + command[1:]
            result = subprocess.run(command, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
            print(f"{name}: exit {result.returncode}")
    print(report(load()))


if __name__ == "__main__":
    main()
