"""Tensor parallel as PyTorch's own TP plans apply it, measured on CPU beside memplan's estimate:
``validation/records/tp_plan_cpu.jsonl`` and ``.md`` (the first table, before the model knew the
plans: ``tp_plan_cpu.first.md``).

The plans, applied with ``torch.distributed.tensor.parallel.parallelize_module`` to the
harness's llama (``calibrate.workloads``: ``attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_norm``, ``post_attention_norm``, ``norm``, ``embed_tokens``, ``lm_head``):

- ``blocks``: the blocks only, as the TP tutorial's first plan (pytorch/tutorials
  intermediate/TP_tutorial, ``layer_tp_plan``) and Hugging Face's ``base_model_tp_plan`` shard
  them: q/k/v and gate/up ColwiseParallel, o and down RowwiseParallel; the embedding, the final
  norm and the head replicated, the loss on the full-vocabulary logits on every rank.
- ``tutorial``: pytorch/examples distributed/tensor_parallelism/fsdp_tp_example.py (the TP
  tutorial's plan before its loss-parallel section): the blocks as above with SequenceParallel
  norms and PrepareModuleInput on attention and MLP, the embedding RowwiseParallel(Replicate →
  Shard(1)), the final norm SequenceParallel, the head ColwiseParallel(Shard(1) → Replicate()):
  the logits all-gathered to the full vocabulary on every rank, no loss parallel.

Each case runs one rank with real tensors on the fake process group (``--mode emulate``'s way:
``calibrate.launch.emulate``), in its own process, wrapped as ``calibrate.tensor_parallel`` wraps
every TP job (``wrappers.apply_tp`` applies the plan): the plan, then activation checkpointing on
each block and FSDP2 over the data-parallel mesh dimension (``calibrate.wrappers.fsdp_on``), the
order the tutorial's FSDP + TP example uses. The loop is memplan's ``plain`` recipe (the loss in the
model's forward, the output kept through backward), as the examples' loops keep ``output``.

    python -m validation.tp_plan            # measure the cases not yet recorded, then the table
    python -m validation.tp_plan --report   # the table from the records
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "records" / "tp_plan_cpu.jsonl"
GIB = 2**30
PLANS = ("blocks", "tutorial")
_COMMON = {"recipe": "plain", "device": "cpu", "arch": "llama"}
_A = {"hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1408, "vocab": 32000, "layers": 2}
_B = {"hidden": 768, "heads": 12, "kv_heads": 12, "ffn": 2048, "vocab": 16384, "layers": 3}
_C = {"hidden": 384, "heads": 8, "kv_heads": 2, "ffn": 1024, "vocab": 50176, "layers": 2}

CASES: tuple[tuple[str, str, dict], ...] = (
    # (name, plan, memplan flags of the job; gpus = dp × tp)
    (
        "A blocks tp2 alone fp32 2x512",
        "blocks",
        _A | {"gpus": 2, "tp": 2, "strategy": "single", "precision": "fp32", "seq_len": 512, "micro_batch": 2},
    ),
    (
        "A blocks tp4 alone fp32 ac full 1x1024",
        "blocks",
        _A
        | {
            "gpus": 4,
            "tp": 4,
            "strategy": "single",
            "precision": "fp32",
            "ac": "full",
            "seq_len": 1024,
            "micro_batch": 1,
        },
    ),
    (
        "B blocks fsdp2 x tp2 bf16 2x512",
        "blocks",
        _B
        | {
            "gpus": 4,
            "tp": 2,
            "strategy": "fsdp-full-shard",
            "precision": "mixed-bf16",
            "seq_len": 512,
            "micro_batch": 2,
        },
    ),
    (
        "C blocks fsdp4 x tp2 bf16 ac full 4x256",
        "blocks",
        _C
        | {
            "gpus": 8,
            "tp": 2,
            "strategy": "fsdp-full-shard",
            "precision": "mixed-bf16",
            "ac": "full",
            "seq_len": 256,
            "micro_batch": 4,
        },
    ),
    (
        "A tutorial tp2 alone fp32 2x512",
        "tutorial",
        _A | {"gpus": 2, "tp": 2, "strategy": "single", "precision": "fp32", "seq_len": 512, "micro_batch": 2},
    ),
    (
        "B tutorial tp4 alone fp32 1x1024",
        "tutorial",
        _B | {"gpus": 4, "tp": 4, "strategy": "single", "precision": "fp32", "seq_len": 1024, "micro_batch": 1},
    ),
    (
        "C tutorial fsdp2 x tp2 bf16 ac full 2x512",
        "tutorial",
        _C
        | {
            "gpus": 4,
            "tp": 2,
            "strategy": "fsdp-full-shard",
            "precision": "mixed-bf16",
            "ac": "full",
            "seq_len": 512,
            "micro_batch": 2,
        },
    ),
    (
        "A tutorial fsdp2 x tp4 bf16 1x1024",
        "tutorial",
        _A
        | {
            "gpus": 8,
            "tp": 4,
            "strategy": "fsdp-full-shard",
            "precision": "mixed-bf16",
            "seq_len": 1024,
            "micro_batch": 1,
        },
    ),
    # added after the change (not held out): torchtitan's loop (the loss outside the model) under the
    # tutorial's plan, which is torchtitan's apply_tp with parallelism.disable_loss_parallel
    (
        "A tutorial fsdp2 x tp2 bf16 torchtitan loop 2x512",
        "tutorial",
        _A
        | {
            "gpus": 4,
            "tp": 2,
            "strategy": "fsdp-full-shard",
            "precision": "mixed-bf16",
            "recipe": "torchtitan",
            "seq_len": 512,
            "micro_batch": 2,
        },
    ),
)


def job_flags(plan: str, flags: dict) -> dict:
    """The memplan flags of a case's job: SequenceParallel norms in the tutorial's plan only."""
    return _COMMON | flags | {"sp": plan == "tutorial"}


def _job(plan: str, flags: dict):
    from calibrate.runs import plan as plan_runs

    (run,) = plan_runs([job_flags(plan, flags) | {"tp_plan": plan}], mode="emulate")[0]
    return run.job


def measure_case(name: str, plan: str, flags: dict) -> dict:
    """One rank of a case (``CASES``' form) on the fake process group: its record."""
    from dataclasses import asdict

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from calibrate import measure
    from calibrate.tensor_parallel import tensor_parallel

    job = _job(plan, flags)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.cluster.gpus)
    try:
        with tensor_parallel(job, "native", "cpu"):
            m = measure.run(job, steps=3, warmup=2, emulated=True)
    finally:
        dist.destroy_process_group()
    kept = ("peak_allocated_bytes", "phase", "categories", "phase_peaks", "world_size")
    return {"case": name, "plan": plan, "flags": job_flags(plan, flags), "measurement": {k: asdict(m)[k] for k in kept}}


def measure_all(out: Path = OUT) -> None:
    done = {r["case"] for r in read(out)}
    for index, (name, _, _) in enumerate(CASES):
        if name in done:
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "validation.tp_plan", "--case", str(index)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        with out.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        print(f"{name}: {record['measurement']['peak_allocated_bytes'] / GIB:.3f} GiB", flush=True)


def read(out: Path = OUT) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def estimate_flags(record: dict) -> dict:
    """The memplan inputs that state a record's job: its flags with the plan where memplan takes
    one (``tp_plan``; before it did, the flags alone: torchtitan's plan)."""
    from memplan.request import FIELDS

    return record["flags"] | ({"tp_plan": record["plan"]} if "tp_plan" in FIELDS else {})


def estimated_bytes(record: dict) -> tuple[int, str]:
    """memplan's allocated peak and phase for a record's job."""
    from memplan.api import estimate

    (est,) = estimate(**estimate_flags(record)).estimates
    return est.allocated_bytes, est.phase


def report(out: Path = OUT) -> str:
    """Per case: the measured rank's peak against memplan's estimate of the job."""
    held = {r["case"]: r for r in read(out)}
    lines = ["| case | plan | measured alloc GiB | estimate alloc GiB | error | phase (measured / est) |"]
    lines.append("|---|---|---|---|---|---|")
    for name, plan, _ in CASES:
        record = held.get(name)
        if record is None:
            lines.append(f"| {name} | {plan} | not run | | | |")
            continue
        m = record["measurement"]
        est, phase = estimated_bytes(record)
        got = m["peak_allocated_bytes"]
        lines.append(
            f"| {name} | {plan} | {got / GIB:.4f} | {est / GIB:.4f} | {100 * (est - got) / got:+.1f} % "
            f"| {m['phase']} / {phase} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="Only the table from the records.")
    parser.add_argument("--case", type=int, help="Measure this case (its index) and print its record.")
    args = parser.parse_args(argv)
    if args.case is not None:
        print(json.dumps(measure_case(*CASES[args.case]), sort_keys=True))
        return
    if not args.report:
        measure_all()
    print(report(), end="")


if __name__ == "__main__":
    main()
