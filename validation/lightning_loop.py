"""Lightning's own ``Trainer`` measured as its users run it (issue 27): a ``LightningModule`` around a
tiny Hugging Face Llama from a config (random weights, CPU), ``Trainer(accelerator="cpu",
strategy=..., precision=...)``, ``fit`` for a few steps; the peak of live tensors over the last step
(torch's MemTracker, calibrate.measure's meter, from the batch's start to its end: forward, Lightning's
``zero_grad``, backward, optimizer step) against ``memplan estimate --recipe lightning`` of the same
job. Multi-rank cases run under torchrun (Lightning's DDP takes torchelastic's environment), rank 0
records.

Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``) is refused on CPU twice, once by
Lightning and once by torch; the FSDP cases pass both without changing what runs: a subclass of the
strategy (the connector refuses ``type(strategy) is FSDPStrategy`` and the registered names only:
lightning 2.6 trainer/connectors/accelerator_connector.py ``_check_strategy_and_fallback``), and, while
its ``_setup_model`` wraps the model, ``device_id=torch.device("cpu")`` where Lightning passes the CPU
root device's index, None (torch 2.13 fsdp/_init_utils.py ``_init_device_handle`` refuses a CPU device
only when it has to guess it). The wrapping (Lightning's ``auto_wrap_policy``, its sharding strategy,
its ``MixedPrecision`` and its ``activation_checkpointing_policy``), the closure and the optimizer step
are Lightning's own. Its ``bf16-mixed`` under FSDP is ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16,
buffer_dtype=bf16)`` plus a CUDA autocast (lightning pytorch/plugins/precision/fsdp.py), which does
nothing on CPU: memplan's mixed-bf16 (FSDP's mixed precision).

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
    # FSDPStrategy: wrap "blocks" is auto_wrap_policy={LlamaDecoderLayer} (its users' usual policy),
    # "none" Lightning's default (no policy: the whole model one unit); ac its
    # activation_checkpointing_policy={LlamaDecoderLayer}. Shapes not used by any other matrix.
    "fsdp-blocks-fp32": dict(
        strategy="fsdp", wrap="blocks", devices=2, precision="32-true", micro_batch=2, seq_len=256, ac=False
    ),
    "fsdp-blocks-bf16-mixed": dict(
        strategy="fsdp", wrap="blocks", devices=2, precision="bf16-mixed", micro_batch=2, seq_len=384, ac=False
    ),
    "fsdp-blocks-ac-bf16-mixed": dict(
        strategy="fsdp", wrap="blocks", devices=2, precision="bf16-mixed", micro_batch=4, seq_len=256, ac=True
    ),
    "fsdp-blocks-fp32-long": dict(
        strategy="fsdp", wrap="blocks", devices=2, precision="32-true", micro_batch=1, seq_len=1024, ac=False
    ),
    "fsdp-sgo-blocks-fp32": dict(
        strategy="fsdp",
        wrap="blocks",
        sharding="SHARD_GRAD_OP",
        devices=2,
        precision="32-true",
        micro_batch=2,
        seq_len=256,
        ac=False,
    ),
    "fsdp-none-fp32": dict(
        strategy="fsdp", wrap="none", devices=2, precision="32-true", micro_batch=2, seq_len=256, ac=False
    ),
    # the cases the one-unit model was built on (its end of backward the peak), after the first table
    "fsdp-none-fp32-short": dict(
        strategy="fsdp", wrap="none", devices=2, precision="32-true", micro_batch=1, seq_len=64, ac=False
    ),
    "fsdp-none-bf16-mixed-short": dict(
        strategy="fsdp", wrap="none", devices=2, precision="bf16-mixed", micro_batch=1, seq_len=64, ac=False
    ),
    # held out from the one-unit model (measured after it was written, never tuned on)
    "fsdp-none-bf16-mixed": dict(
        strategy="fsdp", wrap="none", devices=2, precision="bf16-mixed", micro_batch=2, seq_len=192, ac=False
    ),
    "fsdp-none-sgo-fp32": dict(
        strategy="fsdp",
        wrap="none",
        sharding="SHARD_GRAD_OP",
        devices=2,
        precision="32-true",
        micro_batch=1,
        seq_len=160,
        ac=False,
    ),
    "fsdp-none-ac-fp32": dict(
        strategy="fsdp", wrap="none", devices=2, precision="32-true", micro_batch=4, seq_len=256, ac=True
    ),
}
PRECISIONS = {"32-true": "fp32", "bf16-mixed": "amp-bf16"}
"""Lightning's precision plugins as memplan's precisions: ``bf16-mixed`` is autocast over fp32
parameters (lightning/pytorch/plugins/precision/amp.py MixedPrecision), under FSDP FSDP's own mixed
precision (``FSDP_PRECISIONS``)."""
FSDP_PRECISIONS = {"32-true": "fp32", "bf16-mixed": "mixed-bf16"}
FSDP_SHARDING = {"FULL_SHARD": "fsdp-full-shard", "SHARD_GRAD_OP": "fsdp-shard-grad-op"}


def _model_spec(case: dict | None = None):
    """The DDP and single-device cases' llama-h256; the FSDP cases' own held-out shape."""
    from memplan.specs import ModelSpec
    from validation.finetune_matrix import LLAMA

    if case is None or case["strategy"] != "fsdp":
        return LLAMA
    return ModelSpec(
        name="llama-h384",
        arch="llama",
        num_layers=5,
        hidden=384,
        num_heads=6,
        num_kv_heads=2,
        ffn_hidden=1024,
        vocab_size=6144,
    )


def _strategy(case: dict):
    """The Trainer's strategy: its name, or Lightning's FSDPStrategy passed through on CPU."""
    if case["strategy"] != "fsdp":
        return case["strategy"]
    import torch
    import torch.distributed.fsdp as fsdp
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class CpuFSDPStrategy(FSDPStrategy):
        """Lightning's FSDPStrategy, its model wrapped with the CPU as FSDP's device (module docstring)."""

        def _setup_model(self, model):
            real = fsdp.FullyShardedDataParallel

            class OnCpu(real):
                def __init__(self, *args, device_id=None, **kwargs):
                    super().__init__(*args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

            fsdp.FullyShardedDataParallel = OnCpu
            try:
                return super()._setup_model(model)
            finally:
                fsdp.FullyShardedDataParallel = real

    blocks: set[type[torch.nn.Module]] = {LlamaDecoderLayer}
    return CpuFSDPStrategy(
        auto_wrap_policy=blocks if case["wrap"] == "blocks" else None,
        activation_checkpointing_policy=blocks if case["ac"] else None,
        sharding_strategy=case.get("sharding", "FULL_SHARD"),
    )


def measure(name: str) -> dict | None:
    """One case's ``Trainer.fit``; the last step's peak of live tensors (rank 0's record)."""
    import lightning as L
    import torch
    from transformers import AutoModelForCausalLM

    from calibrate.measure import _CpuMeter, _StorageMeter
    from calibrate.workloads import hf_config

    case = CASES[name]
    spec = _model_spec(case)
    # FSDP1's use_orig_params views are no leaves, which MemTracker's gradient hooks refuse: the storage meter
    meter, peaks = (_StorageMeter() if case["strategy"] == "fsdp" else _CpuMeter()), {}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(hf_config(spec, attention="sdpa"))
            if case["ac"] and case["strategy"] != "fsdp":  # FSDP: the strategy's activation_checkpointing_policy
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
        strategy=_strategy(case),
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

    fsdp = record["strategy"] == "fsdp"
    if fsdp:
        strategy, precision = FSDP_SHARDING[record.get("sharding", "FULL_SHARD")], FSDP_PRECISIONS[record["precision"]]
    else:
        strategy = "ddp" if record["strategy"] == "ddp" else "single"
        precision = PRECISIONS[record["precision"]]
    result = api.estimate(
        model=_model_spec(record),
        recipe="lightning",
        strategy=strategy,
        gpus=record["devices"],
        device="cpu",
        precision=precision,
        micro_batch=record["micro_batch"],
        seq_len=record["seq_len"],
        ac="full" if record["ac"] else "none",
        fsdp_wrap="none" if record.get("wrap") == "none" else "blocks",
        optimizer="adamw",
        calibration=None,
    )
    return result.estimates[0].allocated_bytes


def report(records: list[dict]) -> str:
    return measured.table(records, estimate, decimals=2)


def load() -> list[dict]:
    return measured.load(OUT)


def _run(name: str, path: Path = OUT) -> None:
    """One case in this process (a torchrun rank for DDP): rank 0 appends its record to ``path``."""
    record = measure(name)
    if record is not None:
        with path.open("a") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:  # --case NAME [--out FILE]
        _run(argv[1], Path(argv[3]) if argv[2:3] == ["--out"] else OUT)
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
