"""DeepSpeed configs as their users write them, measured on CPU (issue 27): validation.dsmatrix's
harness (``deepspeed.initialize``, DeepSpeed's CPU accelerator, rank 0 of a world on torch's
fake process group) given a config file instead of the one memplan emits:

- Hugging Face's documented ZeRO-2 and ZeRO-3 configs (tests/data/deepspeed/hf_zero*.json, the
  docs' text without the offload sections), their ``"auto"`` values filled by the Trainer's own
  code (``HfTrainerDeepSpeedConfig`` with the case's ``TrainingArguments`` and model);
- user bucket sizes and thresholds (``zero*_user_buckets.json``);
- DeepSpeed's own defaults: ``zero_optimization`` with the stage alone (``zero*_stage_only*.json``).

    python -m validation.dsconfig            # measure every case not yet recorded
    python -m validation.dsconfig --report   # measured, estimated today, error %

Estimated: memplan on the record's spec and loop (validation.heldout.loop_job) with the config file
read by memplan's DeepSpeed reader (``loop_job`` here).
"""

from __future__ import annotations

import sys
from pathlib import Path

from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

from . import dsmatrix, heldout
from .dsmatrix import LLAMA, QWEN, Case, make_record, measure_case, record_id  # noqa: F401  (the matrix's child)

OUT = "validation/records/deepspeed_config_matrix_cpu.jsonl"
TIMEOUT_S = dsmatrix.TIMEOUT_S
FILES = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepspeed"


def _case(model: ModelSpec, file: str, strategy: str, precision: str, *, gpus=4, trainer=False, b=1, s=128) -> Case:
    job = Job(
        model=model,
        train=TrainSpec(seq_len=s, micro_batch=b, precision=precision, device="cpu"),
        cluster=ClusterSpec(gpus=gpus),
        plan=Plan(strategy=strategy),
    )
    return Case(
        id=f"{model.name}-{Path(file).stem}-{precision}-w{gpus}-b{b}s{s}",
        job=job,
        mode="emulate",
        config_file=str(FILES / file),
        trainer=trainer,
    )


CASES = (
    _case(LLAMA, "hf_zero2.json", "zero2", "mixed-bf16", trainer=True),
    _case(LLAMA, "hf_zero3.json", "zero3", "mixed-bf16", trainer=True),
    _case(LLAMA, "zero2_user_buckets.json", "zero2", "mixed-bf16"),
    _case(LLAMA, "zero3_user_buckets.json", "zero3", "mixed-bf16"),
    _case(LLAMA, "zero2_stage_only.json", "zero2", "mixed-bf16"),
    _case(LLAMA, "zero3_stage_only.json", "zero3", "mixed-bf16"),
    _case(QWEN, "zero1_stage_only_fp32.json", "zero1", "fp32", gpus=8),
    _case(QWEN, "zero1_user_buckets.json", "zero1", "mixed-bf16", gpus=8),
)
BY_ID = {case.id: case for case in CASES}


def loop_job(record: dict):
    """heldout.loop_job with the config DeepSpeed ran (the record's ``ds_config``, the Trainer's
    ``"auto"`` values filled) read by memplan's reader: its ``zero_optimization`` settings."""
    from dataclasses import replace

    from memplan.readers.deepspeed import parse

    job = heldout.loop_job(record)
    zero = parse(record["ds_config"], record["case"]).inputs["zero"]
    return replace(job, plan=replace(job.plan, zero=zero))


def render_report(recs: list[dict]) -> str:
    from calibrate.report import render_table, rows

    table = rows(recs, loop_job)
    return render_table([row | {"run": record["case"]} for row, record in zip(table, recs)])


def main(argv=None) -> None:
    heldout.main(argv, matrix=sys.modules[__name__])


if __name__ == "__main__":
    main()
