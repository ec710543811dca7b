"""A plain loop that keeps ``outputs`` through ``optimizer.step()`` (issue 27), measured as the
accelerate README loop and most tutorials write it::

    for batch in data:
        outputs = model(**batch)   # the step before's outputs are released when this returns
        outputs.loss.backward()
        optimizer.step(); optimizer.zero_grad()

Hugging Face models built from their configs (random weights), torch.optim.AdamW, the loops
``plain-held`` (``use_cache=False``) and ``plain-held-cache`` (``use_cache=True``, the configs'
default: the outputs also hold the DynamicCache) of calibrate.loops, two steps, the second
measured (MemTracker's peak of live tensors over its forward, backward and optimizer step, the
first step's outputs alive through its forward); one process, 2 gloo ranks under DDP, or one
rank of a larger DDP job on the fake process group (``validation.heldout``'s machinery).

The shapes are new; the first table, estimated before memplan had the convention (``--logits
kept``, the closest job it could state), is validation/records/outputs_kept_cpu.first.md; with it
(``--logits held``, ``--use-cache`` where the case passed ``use_cache=True``):
validation/records/outputs_kept_cpu.md.

    python -m validation.outputs_kept            # measure every case not yet recorded
    python -m validation.outputs_kept --report   # measured, estimated before and today, error %
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.specs import Job, ModelSpec

from . import heldout
from .heldout import Case, _case

OUT = "validation/records/outputs_kept_cpu.jsonl"
TIMEOUT_S = heldout.TIMEOUT_S

LLAMA = ModelSpec(
    name="llama-h320-l3-v20k",
    arch="llama",
    num_layers=3,
    hidden=320,
    num_heads=5,
    num_kv_heads=1,
    ffn_hidden=864,
    vocab_size=20000,
)
QWEN = ModelSpec(
    name="qwen2-h384-v12k",
    arch="llama",
    num_layers=2,
    hidden=384,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden=1024,
    vocab_size=12000,
    tied_embeddings=True,
    qkv_bias=True,
)
MISTRAL = ModelSpec(
    name="mistral-h256-v10k",
    arch="llama",
    num_layers=2,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=704,
    vocab_size=10240,
)
HF_TYPE = {LLAMA.name: "llama", QWEN.name: "qwen2", MISTRAL.name: "mistral"}


@dataclass(frozen=True)
class HeldCase(Case):
    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]


def _held(cache: bool, model: ModelSpec, strategy: str, precision: str, **kwargs) -> HeldCase:
    case = _case(f"plain-held{'-cache' * cache}", model, strategy, precision, **kwargs)
    return HeldCase(case.id, case.job, case.loop, case.ac, case.mode)


CASES = (
    # the optimizer step peaks: the held logits (and cache) sit beside AdamW's states and temporaries
    _held(False, LLAMA, "single", "fp32", gpus=1, b=2, s=64, mode="local"),
    _held(True, LLAMA, "single", "fp32", gpus=1, b=2, s=64, mode="local"),
    _held(True, LLAMA, "ddp", "fp32", gpus=2, b=2, s=64, mode="local"),
    _held(True, QWEN, "single", "amp-bf16", gpus=1, b=2, s=64, mode="local"),
    _held(False, QWEN, "ddp", "bf16", gpus=4, b=1, s=128),
    # many tokens: the forward's logits and the loss's copies peak, beside the step before's outputs
    _held(True, MISTRAL, "single", "fp32", gpus=1, b=8, s=512, mode="local"),
    _held(False, LLAMA, "fsdp", "mixed-bf16", gpus=4, b=4, s=256),
    # full AC: transformers turns use_cache off under gradient checkpointing, the logits stay held
    _held(True, MISTRAL, "ddp", "fp32", gpus=8, b=4, s=512, ac="full"),
)
BY_ID = {case.id: case for case in CASES}

# the held-out matrix's child and record serve this one (heldout.main's matrix)
measure_case, make_record, record_id = heldout.measure_case, heldout.make_record, heldout.record_id


def before_job(record: dict) -> Job:
    """The closest job memplan could state before it had the convention: the caller's outputs
    kept through backward only (``--logits kept``)."""
    return heldout.loop_job(record | {"loop": record["loop"] | {"logits": "kept", "use_cache": False}})


def forward_peak(job: Job) -> int:
    """memplan's largest forward moment of ``job`` (the next step's forward under logits held)."""
    from memplan.memory import estimate

    return max(m.allocated_bytes for m in estimate(job).moments if m.phase == "forward")


def _pct(estimated: int, measured: int) -> str:
    return f"{100 * (estimated - measured) / measured:+.2f}"


def render_report(recs: list[dict], *, after: bool = True) -> str:
    """Each case's peak measured and estimated before (``before_job``) and, with ``after``, today
    (``heldout.loop_job``: logits held, the record's use_cache), error in %; then the same for the
    forward phase alone (the second step's forward, the first step's outputs alive through it)."""
    from memplan.memory import estimate

    head = "| case | measured MiB | phase | before MiB | before % |" + (" after MiB | after % | after phase |" * after)
    head += " forward measured MiB | forward before % |" + (" forward after % |" * after)
    lines = [head, "|---|---:|---|---:|---:|" + ("---:|---:|---|" * after) + "---:|---:|" + ("---:|" * after)]
    for record in recs:
        m = record["measurement"]
        peak, forward = m["peak_allocated_bytes"], m["phase_peaks"]["forward"]
        was = estimate(before_job(record)).allocated_bytes
        line = f"| {record['case']} | {peak / 2**20:.2f} | {m['phase']} | {was / 2**20:.2f} | {_pct(was, peak)} |"
        if after:
            now = estimate(heldout.loop_job(record))
            line += f" {now.allocated_bytes / 2**20:.2f} | {_pct(now.allocated_bytes, peak)} | {now.phase} |"
        line += f" {forward / 2**20:.2f} | {_pct(forward_peak(before_job(record)), forward)} |"
        if after:
            line += f" {_pct(forward_peak(heldout.loop_job(record)), forward)} |"
        lines.append(line)
    return "\n".join(lines)


def load() -> list[dict]:
    return heldout.latest_ok(OUT)


if __name__ == "__main__":  # the cases as validation.outputs_kept's, which the child processes import
    from validation import outputs_kept

    heldout.main(matrix=outputs_kept)
