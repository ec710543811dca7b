"""The held-out mixture-of-experts matrix: transformers' Mixtral and Qwen2-MoE (eager
experts) trained by the held-out loops on CPU, single, DDP and FSDP2 on 2 gloo ranks, and
expert parallel (EP 2, calibrate.moe_ep) under FSDP2.

    python -m validation.moe_matrix            # measure every case not yet recorded
    python -m validation.moe_matrix --report   # measured, estimated today, error %

Records go to validation/records/moe_matrix_cpu.jsonl in validation.heldout's format (its report reads them).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

from . import heldout

OUT = "validation/records/moe_matrix_cpu.jsonl"
TIMEOUT_S = 300
# the held-out matrix's record, report and command line serve this one (heldout.main's matrix)
record_id, make_record, render_report = heldout.record_id, heldout.make_record, heldout.render_report

MIXTRAL_A = ModelSpec(
    name="mixtral-h256-e4",
    num_layers=2,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=512,
    vocab_size=4096,
    num_experts=4,
    experts_per_token=2,
)
MIXTRAL_B = ModelSpec(
    name="mixtral-h128-e8",
    num_layers=4,
    hidden=128,
    num_heads=4,
    num_kv_heads=1,
    ffn_hidden=384,
    vocab_size=8192,
    num_experts=8,
    experts_per_token=1,
)
MIXTRAL_C = ModelSpec(
    name="mixtral-h192-e8",
    num_layers=3,
    hidden=192,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden=256,
    vocab_size=2048,
    num_experts=8,
    experts_per_token=2,
)
QWEN_MOE = ModelSpec(
    name="qwen2moe-h192-e8",
    num_layers=2,
    hidden=192,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=512,
    vocab_size=4096,
    qkv_bias=True,
    num_experts=8,
    experts_per_token=2,
    moe_ffn_hidden=128,
    shared_ffn_hidden=256,
    shared_expert_gate=True,
    normalize_top_k=False,
    top_k_weights_fp32=False,
)
QWEN_MOE_MIXED = replace(QWEN_MOE, name="qwen2moe-h192-e8-step2", num_layers=3, moe_every=2)
"""decoder_sparse_step 2: layers 0 and 2 dense (SwiGLU of ffn_hidden), layer 1 sparse."""
HF_TYPE = {m.name: t for m, t in ((MIXTRAL_A, "mixtral"), (MIXTRAL_B, "mixtral"), (MIXTRAL_C, "mixtral"))} | {
    QWEN_MOE.name: "qwen2_moe",
    QWEN_MOE_MIXED.name: "qwen2_moe",
}
STRATEGY = {"single": "single", "ddp": "ddp", "fsdp": "fsdp-full-shard"}


Case = heldout.TypedCase


def _case(loop, model, strategy, *, gpus=1, b=1, s=128, ep=1, ac="none", precision="fp32", mode="local") -> Case:
    job = Job(
        model=model,
        train=TrainSpec(
            seq_len=s,
            micro_batch=b,
            precision=precision,
            activation_checkpointing=heldout.TODAY_AC[ac],
            device="cpu",
        ),
        cluster=ClusterSpec(gpus=gpus),
        plan=Plan(strategy=STRATEGY[strategy], ep=ep),
    )
    where = "g" if mode == "local" else "w"
    name = f"{model.name}-{loop}-{strategy}-ep{ep}-{precision}-ac{ac}-{where}{gpus}-b{b}s{s}"
    return Case(name, job, loop, ac, mode, HF_TYPE[model.name])


CASES = (
    _case("plain-kept", MIXTRAL_A, "single", b=2, s=256),
    _case("plain-freed", MIXTRAL_B, "single", b=2, s=256),
    _case("plain-kept", QWEN_MOE, "single", b=2, s=256),
    _case("plain-kept", MIXTRAL_A, "ddp", gpus=2, b=2, s=128),
    _case("hf-trainer", MIXTRAL_C, "ddp", gpus=2, b=1, s=256),
    _case("plain-freed", QWEN_MOE, "ddp", gpus=2, b=2, s=128),
    _case("plain-kept", MIXTRAL_A, "fsdp", gpus=2, b=2, s=128),
    _case("plain-freed", MIXTRAL_B, "fsdp", gpus=2, b=2, s=256),
    _case("plain-kept", MIXTRAL_A, "fsdp", gpus=2, b=2, s=128, ep=2),
    _case("plain-freed", MIXTRAL_B, "fsdp", gpus=2, b=2, s=256, ep=2),
    _case("plain-kept", MIXTRAL_C, "fsdp", gpus=2, b=1, s=256, ep=2),
    _case("plain-kept", QWEN_MOE, "fsdp", gpus=2, b=2, s=128, ep=2),
    _case("hf-trainer", MIXTRAL_C, "single", b=2, s=128, ac="full"),
    _case("plain-kept", QWEN_MOE_MIXED, "single", b=2, s=256),
    _case("plain-freed", QWEN_MOE_MIXED, "ddp", gpus=2, b=2, s=128),
    _case("plain-kept", MIXTRAL_A, "single", b=1, s=128, precision="bf16"),
)
BY_ID = {case.id: case for case in CASES}


measure_case = heldout.measure_on_ranks


def main(argv=None) -> None:
    heldout.main(argv, matrix=sys.modules[__name__])


if __name__ == "__main__":
    main()
