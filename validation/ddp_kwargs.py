"""DistributedDataParallel's memory keywords measured as users pass them (issue 27): a tiny
Hugging Face Llama built from its config (``AutoModelForCausalLM.from_config``, random weights,
fp32), wrapped in ``DistributedDataParallel(model, gradient_as_bucket_view=…, bucket_cap_mb=…,
static_graph=…)`` on 2 gloo ranks, trained by the plain loop
``ddp(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad(set_to_none=…)`` (the
micro-batches before the last under ``ddp.no_sync()``, as accelerate and the Trainer accumulate).
The peak of live tensors in the last of three steps (torch's MemTracker, calibrate.measure's meter;
the larger rank's) against memplan's estimate of the same job.

    python -m validation.ddp_kwargs            # measure every case not yet recorded
    python -m validation.ddp_kwargs --report   # measured, estimated today, error %
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "validation" / "records" / "ddp_kwargs_cpu.jsonl"
STEPS = 3
"""Optimizer steps per case: the last measured (the optimizer states and DDP's rebuilt buckets exist)."""
WORLD = 2

# shapes no other matrix measured under DDP: a wide vocabulary (the head's gradient the largest
# tensor) and a deeper narrow one (the blocks' gradients most of the total)
LLAMA_WIDE = ModelSpec(
    name="llama-h448-v12k",
    arch="llama",
    num_layers=2,
    hidden=448,
    num_heads=8,
    num_kv_heads=2,
    ffn_hidden=1216,
    vocab_size=12288,
)
LLAMA_DEEP = ModelSpec(
    name="llama-h320-l4-v4k",
    arch="llama",
    num_layers=4,
    hidden=320,
    num_heads=5,
    num_kv_heads=1,
    ffn_hidden=896,
    vocab_size=4096,
)
# and few tokens: the optimizer step peaks, where the gradients and the buckets are both live
LLAMA_SHORT = ModelSpec(
    name="llama-h384-l6-v2k",
    arch="llama",
    num_layers=6,
    hidden=384,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden=1024,
    vocab_size=2048,
)
SHAPES = {
    LLAMA_WIDE.name: (LLAMA_WIDE, 2, 256),
    LLAMA_DEEP.name: (LLAMA_DEEP, 1, 512),
    LLAMA_SHORT.name: (LLAMA_SHORT, 1, 64),
}
"""Model name -> (spec, micro-batch, sequence length)."""


@dataclass(frozen=True)
class Case:
    model: str
    ddp: dict = field(default_factory=dict)
    """DistributedDataParallel's keywords beyond the module (none: its defaults)."""
    grad_accum: int = 1
    zero_grad: str = "none"
    """none: ``zero_grad(set_to_none=True)`` (torch's default); zeros: ``set_to_none=False``."""

    @property
    def id(self) -> str:
        kwargs = "-".join(f"{k}={v}" for k, v in sorted(self.ddp.items())) or "defaults"
        return f"{self.model}-{kwargs}-accum{self.grad_accum}-zg{self.zero_grad}"

    def job(self) -> Job:
        spec, b, s = SHAPES[self.model]
        return job_of(spec, b, s, self.grad_accum, self.zero_grad, self.ddp)


def job_of(spec: ModelSpec, micro_batch: int, seq_len: int, grad_accum: int, zero_grad: str, ddp: dict) -> Job:
    """A case as memplan's job, DDP's keywords as given (``Plan``'s fields of their names)."""
    train = TrainSpec(
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        precision="fp32",
        device="cpu",
        zero_grad=zero_grad,
    )
    job = Job(model=spec, train=train, cluster=ClusterSpec(gpus=WORLD), plan=Plan(strategy="ddp", **ddp))
    # the plain loop on a Hugging Face block: the loss's logits freed, sdpa's own grouped-query path
    return job.with_(recipe="plain", logits="freed", kv_copies=False)


def record_job(record: dict) -> Job:
    """The job a record ran, from the record alone."""
    spec = ModelSpec(**record["model"])
    return job_of(
        spec, record["micro_batch"], record["seq_len"], record["grad_accum"], record["zero_grad"], record["ddp"]
    )


def _cases() -> tuple[Case, ...]:
    def grid(models):
        return [
            Case(model, {"gradient_as_bucket_view": view, "bucket_cap_mb": cap})
            for model in models
            for view in (False, True)
            for cap in (1, 25)
        ]

    def extra(models):
        # static_graph; the previous step's gradients kept (zero-filled); gradient accumulation
        cases = [Case(model, {"static_graph": True}) for model in models]
        for model in models:
            cases += [Case(model, {"gradient_as_bucket_view": view}, zero_grad="zeros") for view in (False, True)]
            cases += [Case(model, {"gradient_as_bucket_view": view}, grad_accum=2) for view in (False, True)]
        return cases

    first = (LLAMA_WIDE.name, LLAMA_DEEP.name)
    cases = grid(first) + [Case(model, {"static_graph": True}) for model in first] + extra([LLAMA_WIDE.name])[1:]
    # the optimizer-step shape, added when the first two showed their peaks before any gradient is bucketed
    return (*cases, *grid([LLAMA_SHORT.name]), *extra([LLAMA_SHORT.name]))


CASES = _cases()
BY_ID = {case.id: case for case in CASES}


# --- one rank ------------------------------------------------------------------------------


def _rank_measurement(case: Case) -> dict:
    """This rank's peak of live tensors over the last step (a rank of ``heldout.run_ranks``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from calibrate.loops import _forward_ends_at_backward
    from calibrate.measure import _CpuMeter, _optimizer
    from calibrate.workloads import hf_config

    job = case.job()
    spec, b, s = SHAPES[case.model]
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (b, s))
    meter, phases = _CpuMeter(), dict[str, int]()
    with meter:
        model = AutoModelForCausalLM.from_config(hf_config(spec, attention="sdpa"))
        ddp = DistributedDataParallel(model, **case.ddp)
        optimizer = _optimizer(ddp, job)
        for index in range(STEPS):
            measured = index == STEPS - 1
            if measured:
                meter.reset_peak()
            marks = _forward_ends_at_backward(meter, phases) if measured else contextlib.nullcontext()
            with marks:
                for micro in range(case.grad_accum):
                    meter.new_step()  # MemTracker counts one forward per module between resets
                    sync = micro == case.grad_accum - 1
                    with contextlib.nullcontext() if sync else ddp.no_sync():
                        ddp(input_ids=ids, labels=ids).loss.backward()
            if measured:
                phases["backward"] = meter.peak()
            optimizer.step()
            optimizer.zero_grad(set_to_none=case.zero_grad == "none")
            if measured:
                phases["optimizer"] = meter.peak()
        peak = meter.peak()
        categories = meter.categories()
    return {
        "peak_allocated_bytes": peak,
        "phase": next(p for p in ("forward", "backward", "optimizer") if phases.get(p) == peak),
        "phase_peaks": phases,
        "categories": categories,
    }


def measure(case: Case) -> dict:
    """The case on ``WORLD`` spawned gloo ranks: the larger rank's peak."""
    import torch
    import transformers

    from validation.heldout import run_ranks

    spec, b, s = SHAPES[case.model]
    worst = run_ranks(WORLD, _rank_measurement, case, worst=lambda m: m["peak_allocated_bytes"])
    return {
        "case": case.id,
        "model": asdict(spec),
        "micro_batch": b,
        "seq_len": s,
        "grad_accum": case.grad_accum,
        "zero_grad": case.zero_grad,
        "ddp": case.ddp,
        "world": WORLD,
        "loop": "plain: ddp(input_ids=x, labels=x).loss.backward(); AdamW step; zero_grad",
        "measurement": worst,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


# --- the report ----------------------------------------------------------------------------


def load() -> list[dict]:
    return [json.loads(line) for line in OUT.read_text().splitlines() if line.strip()] if OUT.exists() else []


def estimate(record: dict) -> tuple[int, str]:
    """memplan's estimate of the record's job (allocated bytes at the peak, and its phase)."""
    from memplan.memory import estimate as estimate_job

    est = estimate_job(record_job(record))
    return est.allocated_bytes, est.phase


def report(records: list[dict]) -> str:
    lines = [
        "| case | measured MiB | phase | estimated MiB | phase | error |",
        "|---|---:|---|---:|---|---:|",
    ]
    for record in records:
        m = record["measurement"]
        measured, (est, phase) = m["peak_allocated_bytes"], estimate(record)
        cells = (record["case"], f"{measured / 2**20:.2f}", m["phase"], f"{est / 2**20:.2f}", phase)
        lines.append(f"| {' | '.join(cells)} | {100 * (est - measured) / measured:+.2f} % |")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--report" in argv:
        print(report(load()))
        return
    done = {r["case"] for r in load()}
    for case in CASES:
        if case.id in done:
            continue
        record = measure(case)
        with OUT.open("a") as out:
            out.write(json.dumps(record, sort_keys=True) + "\n")
        print(f"{record['measurement']['peak_allocated_bytes'] / 2**20:10.2f} MiB  {case.id}", flush=True)
    print(report(load()))


if __name__ == "__main__":
    main()
