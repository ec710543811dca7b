"""The parallel matrix's cases (issue 14), torch-free: the Jobs ``validation.parallel_matrix`` measures
and the records' Jobs, which the fast tests estimate without torch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memplan.layout import Layout
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

OUT = Path("validation/records/parallel_matrix_cpu.jsonl")

MODEL_KV2 = ModelSpec(
    name="llama-h256-kv2",
    arch="llama",
    num_layers=4,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=704,
    vocab_size=2048,
)
MODEL_KV4 = dataclasses.replace(MODEL_KV2, name="llama-h256-kv4", num_kv_heads=4, vocab_size=4096)
MODEL_V512 = dataclasses.replace(MODEL_KV4, name="llama-h256-kv4-v512", vocab_size=512)
MODEL_D64X8 = dataclasses.replace(MODEL_KV2, name="llama-h256-d64x8-kv2", num_heads=8, head_dim=64)
"""8 heads of 64 over hidden 256 (q width 512: Qwen3-0.6B's proportions; validation/records/headdim_matrix_cpu.md)."""


def case_job(
    *, model: ModelSpec, gpus: int, strategy: str, seq: int, micro_batch: int, ep: int = 1, recipe="plain", **layout
) -> Job:
    """``recipe`` sets FSDP2's unit layout (``loop.fsdp_units``: torchtitan's own embedding and
    [norm, head] units); the loop itself is the harness's (logits kept, gradients set to None)."""
    return Job(
        model=model,
        train=TrainSpec(seq_len=seq, micro_batch=micro_batch, precision="fp32", device="cpu", recipe=recipe),
        cluster=ClusterSpec(gpus=gpus),
        plan=Plan(strategy=strategy, ep=ep),  # records written before ep moved to Plan carry it in layout
        layout=Layout(**layout),
    )


def _case(name, model=MODEL_KV2, *, gpus, strategy="single", seq=256, micro_batch=2, recipe="plain", **layout):
    job = case_job(model=model, gpus=gpus, strategy=strategy, seq=seq, micro_batch=micro_batch, recipe=recipe, **layout)
    return name, job


CASES = dict(
    (
        _case("tp2-nosp", gpus=2, tp=2, sp=False),
        _case("tp2-sp", gpus=2, tp=2),
        _case("tp2-sp-b4", gpus=2, tp=2, micro_batch=4),
        _case("tp2-sp-s512", gpus=2, tp=2, seq=512, micro_batch=1),
        _case("tp4-sp", MODEL_KV4, gpus=4, tp=4),
        _case("tp4-nosp", MODEL_KV4, gpus=4, tp=4, sp=False),
        _case("pp2-1f1b-m4", gpus=2, pp=2, pp_microbatches=4),
        _case("pp2-1f1b-m8", gpus=2, pp=2, pp_microbatches=8, micro_batch=1),
        _case("pp2-gpipe-m4", gpus=2, pp=2, pp_schedule="gpipe", pp_microbatches=4),
        _case("pp4-1f1b-m4", gpus=4, pp=4, pp_microbatches=4),
        _case("pp4-1f1b-m8", gpus=4, pp=4, pp_microbatches=8, micro_batch=1),
        _case("pp2-int-v2-m4", gpus=2, pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2, pp_microbatches=4),
        _case(
            "pp2-int-v2-m8",
            gpus=2,
            pp=2,
            pp_schedule="interleaved-1f1b",
            pp_virtual=2,
            pp_microbatches=8,
            micro_batch=1,
        ),
        _case("pp4-int-v1-m8", gpus=4, pp=4, pp_schedule="interleaved-1f1b", pp_microbatches=8, micro_batch=1),
        _case("tp2-pp2-1f1b-m4", gpus=4, tp=2, pp=2, pp_microbatches=4),
        _case("tp2-nosp-pp2-1f1b-m4", gpus=4, tp=2, sp=False, pp=2, pp_microbatches=4),
        _case("dp2-tp2-fsdp", gpus=4, strategy="fsdp-full-shard", tp=2),
        _case("tp2-sp-s128-b8", gpus=2, tp=2, seq=128, micro_batch=8),
        _case("dp2-pp2-fsdp-m4", gpus=4, strategy="fsdp-full-shard", pp=2, pp_microbatches=4),
        _case("dp2-pp2-ddp-m4", gpus=4, strategy="ddp", pp=2, pp_microbatches=4),
        _case(
            "tp2-sp-pp2-int-v2-m4", gpus=4, tp=2, pp=2, pp_schedule="interleaved-1f1b", pp_virtual=2, pp_microbatches=4
        ),
        # context parallel (torch's ring attention; the CP ranks shard the parameters as dp_shard_cp)
        _case("cp2-fsdp", MODEL_KV4, gpus=2, strategy="fsdp-full-shard", cp=2, seq=512),
        _case("cp2-fsdp-s1024-b1", MODEL_KV4, gpus=2, strategy="fsdp-full-shard", cp=2, seq=1024, micro_batch=1),
        _case("cp2-ddp", MODEL_KV4, gpus=2, strategy="ddp", cp=2, seq=512),
        _case("cp4-fsdp", MODEL_KV4, gpus=4, strategy="fsdp-full-shard", cp=4, seq=512),
        _case("dp2-cp2-fsdp", MODEL_KV4, gpus=4, strategy="fsdp-full-shard", cp=2, seq=512),
        _case("tp2-sp-cp2-fsdp", MODEL_KV4, gpus=4, strategy="fsdp-full-shard", tp=2, cp=2, seq=512),
        # measured after the CP fix, held out from it: the ring's backward as the peak at other sizes
        _case("cp4-fsdp-s1024-b1", MODEL_KV4, gpus=4, strategy="fsdp-full-shard", cp=4, seq=1024, micro_batch=1),
        _case("cp2-fsdp-v512", MODEL_V512, gpus=2, strategy="fsdp-full-shard", cp=2, seq=1024),
        # measured after ModelSpec.head_dim, held out from it: TP's head shards, CP's ring over a·d
        _case("tp2-sp-d64x8", MODEL_D64X8, gpus=2, tp=2),
        _case("cp2-fsdp-d64x8", MODEL_D64X8, gpus=2, strategy="fsdp-full-shard", cp=2, seq=512),
        _case("cp2-fsdp-kv2", gpus=2, strategy="fsdp-full-shard", cp=2, seq=512),  # its twin, heads of h/a
        # held out from the model of FSDP2 under pipelining (every backward but the reduce keeps the
        # stage's parameters unsharded and its gradients unsharded, stage.py backward_maybe_with_nosync)
        _case("dp2-pp2-fsdp-m8", gpus=4, strategy="fsdp-full-shard", pp=2, pp_microbatches=8, micro_batch=1),
        _case(
            "dp2-pp2-int-v2-fsdp-m4",
            gpus=4,
            strategy="fsdp-full-shard",
            pp=2,
            pp_schedule="interleaved-1f1b",
            pp_virtual=2,
            pp_microbatches=4,
        ),
        # torchtitan's FSDP2 units (the input embedding its own unit, [norm, lm head] one kept after
        # forward) over TP's vocabulary-parallel DTensors and over pipeline stages (issue 28: the root
        # unit's remainder went negative where the whole model's V·h was taken from a rank's share)
        _case("dp2-tp2-fsdp-units", gpus=4, strategy="fsdp-full-shard", tp=2, recipe="torchtitan"),
        _case("dp2-tp2-nosp-fsdp-units", gpus=4, strategy="fsdp-full-shard", tp=2, sp=False, recipe="torchtitan"),
        _case(
            "dp2-pp2-fsdp-units-m4", gpus=4, strategy="fsdp-full-shard", pp=2, pp_microbatches=4, recipe="torchtitan"
        ),
    )
)


def job_of(rec: dict) -> Job:
    """The Job a record was measured for (fast tests rebuild it without torch)."""
    return case_job(
        model=ModelSpec(**rec["model"]),
        gpus=rec["gpus"],
        strategy=rec["strategy"],
        seq=rec["seq_len"],
        micro_batch=rec["micro_batch"],
        recipe=rec.get("recipe", "plain"),
        **rec["layout"],
    )
