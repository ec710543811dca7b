"""Hugging Face ``TrainingArguments`` JSON files measured as the Trainer runs them (issue 27): each
file (tests/data/hf_trainer/*.json, written by ``TrainingArguments.to_json_string()``) is read by
transformers' own ``HfArgumentParser.parse_json_file``, a ``Trainer`` is built from it on a tiny
Llama from a config (random weights, CPU, one process) and ``Trainer.train()`` runs its steps;
the peak of live tensors in the last step (torch's MemTracker, calibrate.measure's meter, from the
step's start to its end: forward, backward, optimizer step, zero_grad) against
``memplan estimate --from FILE`` on the same model and sequence length (one process: strategy single).

    python -m validation.hf_trainer_args --write-files   # the argument files, from TrainingArguments
    python -m validation.hf_trainer_args                 # measure every case not yet recorded
    python -m validation.hf_trainer_args --report        # measured, estimated today, error %
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from validation import measured

ROOT = Path(__file__).resolve().parent.parent
FILES = ROOT / "tests" / "data" / "hf_trainer"
OUT = ROOT / "validation" / "records" / "hf_trainer_args_matrix_cpu.jsonl"
STEPS = 3
"""Trainer steps per case: the last one measured (the optimizer states exist from the first)."""

CASES: dict[str, tuple[dict[str, Any], int]] = {
    # file stem: (TrainingArguments keywords, sequence length)
    "fp32_adamw": (dict(per_device_train_batch_size=2, optim="adamw_torch"), 256),
    "bf16_ac_fused_accum2": (
        dict(
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            bf16=True,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            optim="adamw_torch_fused",
        ),
        256,
    ),
    "bf16_adamw": (dict(per_device_train_batch_size=2, bf16=True, optim="adamw_torch"), 256),
    "fp32_ac_adafactor": (
        dict(per_device_train_batch_size=4, activation_checkpointing=True, optim="adafactor"),
        128,
    ),
}


def _model_spec():
    from validation.finetune_matrix import LLAMA

    return LLAMA


def write_files() -> None:
    """Each case's arguments as the user's code saves them: ``TrainingArguments(...).to_json_string()``
    (the step count and the output switches set so a run is a few steps with no files)."""
    from transformers import TrainingArguments

    FILES.mkdir(parents=True, exist_ok=True)
    for stem, (kwargs, _) in CASES.items():
        args = TrainingArguments(
            output_dir="trainer-out",
            use_cpu=True,
            max_steps=STEPS,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            **kwargs,
        )
        (FILES / f"{stem}.json").write_text(args.to_json_string())


def measure(stem: str) -> dict:
    """``Trainer.train()`` from the file; the last step's peak of live tensors."""
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

    from calibrate.measure import _CpuMeter
    from calibrate.workloads import hf_config

    _, seq_len = CASES[stem]
    spec = _model_spec()
    parser = HfArgumentParser(TrainingArguments)  # type: ignore[arg-type]
    (args,) = parser.parse_json_file(str(FILES / f"{stem}.json"))
    assert isinstance(args, TrainingArguments)
    args.output_dir = tempfile.mkdtemp(prefix="memplan-trainer-")
    torch.manual_seed(0)
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * (STEPS + 1)
    ids = torch.randint(0, spec.vocab_size, (rows, seq_len))
    data = [{"input_ids": row, "labels": row} for row in ids]
    meter, peaks = _CpuMeter(), {}

    class LastStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == STEPS - 1:
                meter.reset_peak()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STEPS:
                peaks["step"] = meter.peak()

    with meter:
        model = AutoModelForCausalLM.from_config(hf_config(spec, attention="sdpa"))
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[LastStep()])
        micro_step = trainer.training_step

        def each_micro_batch(*a, **k):  # MemTracker counts one forward per module between resets
            meter.new_step()
            return micro_step(*a, **k)

        trainer.training_step = each_micro_batch  # type: ignore[method-assign]
        trainer.train()
    return {
        "case": stem,
        "file": str((FILES / f"{stem}.json").relative_to(ROOT)),
        "model": spec.name,
        "seq_len": seq_len,
        "measured_peak_bytes": peaks["step"],
        "categories": meter.categories(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def estimate(record: dict) -> int:
    """memplan's estimate of the file's job: ``--from FILE`` on the record's model and sequence
    length, one process (strategy single)."""
    from memplan import api
    from memplan.readers import read

    inputs = read(ROOT / record["file"]).inputs
    result = api.estimate(
        model=_model_spec(), seq_len=record["seq_len"], gpus=1, strategy="single", calibration=None, **inputs
    )
    return result.estimates[0].allocated_bytes


def report(records: list[dict]) -> str:
    return measured.table(records, estimate, decimals=1)


def load() -> list[dict]:
    return measured.load(OUT)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--write-files" in argv:
        write_files()
        return
    if "--report" in argv:
        print(report(load()))
        return
    done = {r["case"] for r in load()} if OUT.exists() else set()
    records = [measure(stem) for stem in CASES if stem not in done]  # every case not yet recorded
    with OUT.open("a") as out:
        out.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    print(report(load()))


if __name__ == "__main__":
    main()
