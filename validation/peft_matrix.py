"""peft's LoraConfig as users write it, measured on CPU before memplan modelled it (held out):
LoRA on fused projections (Phi-3's qkv_proj and gate_up_proj; GPT-2's c_attn, c_proj and c_fc
Conv1D modules), and DoRA (``use_dora=True``). Each case is the memplan job as a user states it, and
the ``LoraConfig`` keywords the user wrote beyond it (the Phi-3 cases were first measured as
unfused llama blocks, the records before ``fused_projections`` existed: the first table,
validation/records/peft_matrix_cpu.first.md); the runs are the
fine-tune matrix's (validation.finetune_matrix: transformers' model built from a config, peft's
get_peft_model, MemTracker's peak of live tensors on one rank; the DoRA cases by the storage meter,
``PeftCase.meter``, validation/records/peft_dora_cpu.md). A record's ``use_dora`` is stated to
memplan as ``--dora`` (``stated_job``).

    python -m validation.peft_matrix            # measure every case not yet recorded
    python -m validation.peft_matrix --report   # measured, estimated today, error %, peak phase
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from memplan.specs import ModelSpec

from . import heldout
from .finetune_matrix import LLAMA, QWEN, FinetuneCase, _case

OUT = "validation/records/peft_matrix_cpu.jsonl"

PHI3 = ModelSpec(
    name="phi3-mini-l2",
    arch="llama",
    fused_projections=True,
    num_layers=2,
    hidden=3072,
    num_heads=32,
    num_kv_heads=32,
    ffn_hidden=8192,
    vocab_size=32064,
)
"""Phi-3-mini's widths (microsoft/Phi-3-mini-4k-instruct config.json) in two layers, built as
transformers' Phi3ForCausalLM: fused qkv_proj and gate_up_proj."""
PHI3_GQA = ModelSpec(
    name="phi3-gqa-h1024",
    arch="llama",
    fused_projections=True,
    num_layers=2,
    hidden=1024,
    num_heads=16,
    num_kv_heads=4,
    ffn_hidden=2816,
    vocab_size=32064,
)
"""A narrower Phi3ForCausalLM with grouped k/v heads (as phi-4's 40 over 10) and Phi-3's
vocabulary (its pad_token_id 32000 must be a row)."""
GPT2 = ModelSpec(
    name="gpt2-small-l2",
    arch="gpt2",
    num_layers=2,
    hidden=768,
    num_heads=12,
    ffn_hidden=3072,
    vocab_size=50257,
    max_positions=1024,
    tied_embeddings=True,
    linear_bias=True,
    dropout=0.1,
    activation="gelu_new",
)
"""GPT-2 small (openai-community/gpt2 config.json) in two layers: c_attn, c_proj, c_fc Conv1D."""
HF_TYPE = {PHI3.name: "phi3", PHI3_GQA.name: "phi3", GPT2.name: "gpt2", LLAMA.name: "llama", QWEN.name: "qwen2"}


@dataclass(frozen=True)
class PeftCase(FinetuneCase):
    meter: str = "memtracker"
    """The CPU meter (calibrate.measure.METERS): MemTracker's peak of live tensors, or
    ``storages``, the same count by a dispatch mode alone, without MemTracker's module hooks."""

    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]

    def run_options(self) -> dict:
        return {"cpu_meter": self.meter}

    def record_fields(self) -> dict:
        return super().record_fields() | {"meter": self.meter}


def _peft_case(*args, meter: str = "memtracker", **kwargs) -> PeftCase:
    case = _case(*args, **kwargs)
    name = case.id + (f"-{meter}" if meter != "memtracker" else "")
    return PeftCase(name, case.job, case.loop, case.ac, case.mode, case.lora, meter)


C_ATTN = (("target_modules", ("c_attn",)),)
"""GPT-2's fused attention input projection, as peft users name it."""
DORA = (("use_dora", True),)

FUSED = (
    _peft_case(PHI3, "lora", "single", "fp32", b=1, s=128, targets="qkv_proj,o_proj"),
    _peft_case(PHI3, "lora", "single", "fp32", b=1, s=128, targets="all-linear"),
    _peft_case(PHI3, "lora", "single", "fp32", b=1, s=1024, rank=16, targets="all-linear"),
    _peft_case(PHI3_GQA, "lora", "single", "fp32", b=2, s=512, targets="qkv_proj,o_proj"),
    _peft_case(PHI3_GQA, "lora", "single", "fp32", b=2, s=512, rank=16, targets="all-linear", dropout=0.05),
    _peft_case(GPT2, "lora", "single", "fp32", b=2, s=128, targets="qkv", lora=C_ATTN),
    _peft_case(GPT2, "lora", "single", "fp32", b=2, s=128, rank=16, targets="all-linear"),
    _peft_case(GPT2, "lora", "single", "fp32", b=2, s=1024, targets="qkv", lora=C_ATTN),
    _peft_case(GPT2, "lora", "single", "fp32", b=1, s=1024, rank=16, targets="all-linear", dropout=0.1),
)
DORA_AS_FIRST_MEASURED = (
    _peft_case(LLAMA, "lora", "single", "fp32", lora=DORA),
    _peft_case(LLAMA, "lora", "single", "fp32", rank=16, targets="all-linear", lora=DORA),
    _peft_case(LLAMA, "lora", "single", "bf16", b=1, s=128, targets="all-linear", dropout=0.1, lora=DORA),
    _peft_case(PHI3, "lora", "single", "fp32", b=1, s=128, targets="all-linear", lora=DORA),
    # held out: measured before DoRA was modelled, after the four above had been looked at
    _peft_case(QWEN, "lora", "single", "fp32", b=4, s=128, rank=16, lora=DORA),
    _peft_case(LLAMA, "lora", "single", "fp32", targets="all-linear", dropout=0.05, lora=DORA),
    _peft_case(PHI3_GQA, "lora", "single", "fp32", b=2, s=256, targets="qkv_proj,o_proj", lora=DORA),
    _peft_case(LLAMA, "lora", "single", "fp32", b=4, s=128, rank=32, targets="q,v,down", lora=DORA),
)
"""DoRA as written, under MemTracker (the first table, validation/records/peft_dora_cpu.first.md):
its ModTracker's multi-grad hooks on each module's inputs keep DoRA's per-forward weight graphs
alive, so those peaks hold some of the meter's own keeping."""
DORA_CASES = tuple(replace(case, id=f"{case.id}-storages", meter="storages") for case in DORA_AS_FIRST_MEASURED)
"""The same runs measured by the live storages a dispatch mode sees alone (``meter``)."""
DORA_LOOPS = (
    _peft_case(LLAMA, "lora", "single", "fp32", targets="all-linear", ac="full", lora=DORA, meter="storages"),
    _peft_case(
        PHI3_GQA, "lora", "single", "fp32", b=2, s=256, targets="all-linear", ac="full", lora=DORA, meter="storages"
    ),
    _peft_case(QWEN, "lora", "ddp", "fp32", gpus=2, lora=DORA, meter="storages"),
    _peft_case(LLAMA, "lora", "fsdp", "fp32", gpus=2, targets="all-linear", lora=DORA, meter="storages"),
)
"""Held out, measured after the model of the eight above and before memplan modelled DoRA under
transformers' gradient checkpointing (each block's forward, DoRA's temporaries too, run again
in the backward), DDP and FSDP2 (two gloo ranks)."""
METER_CHECK = tuple(
    _peft_case(LLAMA, "lora", "single", "fp32", meter=meter, **shape)
    for shape in ({}, {"b": 4, "s": 128, "rank": 32, "targets": "q,v,down"})
    for meter in ("memtracker", "storages")
)
"""Plain LoRA (no DoRA) under both meters: where MemTracker keeps nothing of its own, the
storage meter's peak is MemTracker's."""
CASES = FUSED + DORA_CASES + METER_CHECK + DORA_LOOPS
BY_ID = {case.id: case for case in CASES}


def record_id(case: PeftCase) -> str:
    """The held-out matrix's id, and the peft keywords where the case gives some (a DoRA run
    states the same job as its LoRA twin)."""
    base = heldout.record_id(case)
    if not case.lora and case.meter == "memtracker":
        return base
    key: list = [base, [[k, v] for k, v in case.lora]] + ([case.meter] if case.meter != "memtracker" else [])
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()[:10]


def make_record(case: PeftCase, outcome: dict, wall_s: float) -> dict:
    return heldout.make_record(case, outcome, wall_s) | {"id": record_id(case)}


PEFT_INPUTS = {"use_dora": "dora"}
"""``LoraConfig`` keywords a record carries (``peft_config``) that are memplan inputs now: a
DoRA run is stated with ``--dora`` (the records were made before it existed)."""


def stated_job(record: dict):
    """The record's job with its loop (``heldout.loop_job``) and the peft keywords memplan takes."""
    given = record.get("peft_config") or {}
    return heldout.loop_job(record).with_(**{PEFT_INPUTS[k]: v for k, v in given.items() if k in PEFT_INPUTS})


def render_report(recs: list[dict]) -> str:
    """The table of the cases as stated today (the first table's records of the Phi-3 cases,
    stated as unfused llama blocks, left out: validation/records/peft_matrix_cpu.first.md), then
    the storage meter's cases beside MemTracker's measurement of the same run."""
    from calibrate.report import render_table

    current = {record_id(case) for case in CASES}
    table = render_table(heldout.table_rows([r for r in recs if r["id"] in current], job_of=stated_job))
    return table + "\n\n" + render_meters(recs)


def _mib(num_bytes: int | None) -> str:
    return "" if num_bytes is None else f"{num_bytes / 2**20:.2f}"


def _pct(estimated: int, measured: int | None) -> str:
    return "" if not measured else f"{100 * (estimated - measured) / measured:+.2f}"


def render_meters(recs: list[dict]) -> str:
    """Each case measured by the storage meter beside MemTracker's measurement of the same run
    (its twin), and today's estimate against each."""
    from memplan.memory import estimate

    by_id = {r["id"]: r for r in recs if r["status"] == "ok"}
    lines = [
        "| run | storages MiB | MemTracker MiB | MemTracker − storages MiB | estimated MiB | error % vs storages "
        "| error % vs MemTracker | phase (storages, MemTracker) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in (c for c in CASES if c.meter == "storages"):
        probe = by_id.get(record_id(case))
        tracked = by_id.get(record_id(replace(case, meter="memtracker")))
        if probe is None:
            continue
        measured = probe["measurement"]["peak_allocated_bytes"]
        other = tracked["measurement"]["peak_allocated_bytes"] if tracked else None
        estimated = estimate(stated_job(probe)).allocated_bytes
        phases = f"{probe['measurement']['phase']}, {tracked['measurement']['phase'] if tracked else ''}"
        difference = _mib(other - measured) if other is not None else ""
        lines.append(
            f"| {case.id.removesuffix('-storages')} | {_mib(measured)} | {_mib(other)} | {difference} "
            f"| {_mib(estimated)} | {_pct(estimated, measured)} | {_pct(estimated, other)} | {phases} |"
        )
    return "\n".join(lines)


TIMEOUT_S = 600
"""Phi-3-mini's widths at sequence 1024 take minutes on two CPU cores."""
measure_case = heldout.measure_case

if __name__ == "__main__":  # the cases as validation.peft_matrix's, which the child processes import
    from validation import peft_matrix

    heldout.main(matrix=peft_matrix)
