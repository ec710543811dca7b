"""The head-dim matrix: transformers' Qwen3, Mistral and Qwen3-MoE built with an attention
head_dim apart from hidden / heads (Qwen3-0.6B and -4B: 16 × 128 = 2048 and 32 × 128 = 4096
over hidden 1024 and 2560; Mistral-Nemo: 32 × 128 = 4096 under hidden 5120) and Qwen3-MoE
(eager experts, q/k norms, no shared expert), trained by the held-out loops on CPU: one
process, DDP and FSDP2 on 2 gloo ranks, and expert parallel (EP 2, calibrate.moe_ep) under FSDP2.

    python -m validation.headdim_matrix            # measure every case not yet recorded
    python -m validation.headdim_matrix --report   # measured, estimated today, error %

Records go to validation/records/headdim_matrix_cpu.jsonl in validation.heldout's format (its report reads
them). The model's ``head_dim`` is the config.json key transformers builds the attention from;
the first records were made before ModelSpec held it: their spec carries it as this one does,
their estimate is memplan's refusal of the config.json then (``estimate_error``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

from . import heldout

OUT = "validation/records/headdim_matrix_cpu.jsonl"
TIMEOUT_S = 300
# the held-out matrix's record, report and command line serve this one (heldout.main's matrix)
record_id, make_record, render_report = heldout.record_id, heldout.make_record, heldout.render_report

QWEN3_WIDE = ModelSpec(
    name="qwen3-h256-d64x8",
    num_layers=2,
    hidden=256,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden=768,
    vocab_size=4096,
    tied_embeddings=True,
    qk_norm=True,
)
"""Qwen3-0.6B's proportions: 8 heads of 64 (q width 512) over hidden 256, tied."""
QWEN3_NARROW = ModelSpec(
    name="qwen3-h384-d64x4",
    num_layers=2,
    hidden=384,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden=1024,
    vocab_size=4096,
    qk_norm=True,
)
"""Mistral-Nemo's proportions on Qwen3: 4 heads of 64 (q width 256) under hidden 384."""
MISTRAL_NARROW = ModelSpec(
    name="mistral-h256-d32x4",
    num_layers=2,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    ffn_hidden=768,
    vocab_size=4096,
)
"""Mistral-Nemo's proportions: 4 heads of 32 (q width 128) under hidden 256."""
QWEN3_MOE = ModelSpec(
    name="qwen3moe-h192-e8",
    num_layers=2,
    hidden=192,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=512,
    vocab_size=4096,
    qk_norm=True,
    num_experts=8,
    experts_per_token=2,
    moe_ffn_hidden=128,
    normalize_top_k=False,
    top_k_weights_fp32=False,
)
"""Qwen3-MoE with head_dim = hidden / heads (48): what ModelSpec could already say by hand."""
QWEN3_MOE_WIDE = ModelSpec(
    name="qwen3moe-h128-d64x4-e8",
    num_layers=2,
    hidden=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden=384,
    vocab_size=4096,
    qk_norm=True,
    num_experts=8,
    experts_per_token=2,
    moe_ffn_hidden=96,
    normalize_top_k=True,
    top_k_weights_fp32=False,
)
"""Qwen3-30B-A3B's proportions: 4 heads of 64 (q width 256) over hidden 128, norm_topk_prob true."""
QWEN3_PLAIN = ModelSpec(
    name="qwen3-h256-d64x4",
    num_layers=2,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=768,
    vocab_size=4096,
    tied_embeddings=True,
    qk_norm=True,
)
"""QWEN3_WIDE's twin with head_dim = hidden / heads (4 heads of 64): the misses without wide heads."""
MISTRAL_WIDE = ModelSpec(
    name="mistral-h256-d64x8",
    num_layers=2,
    hidden=256,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    ffn_hidden=768,
    vocab_size=4096,
    tied_embeddings=True,
)
"""QWEN3_WIDE's twin without q/k norms (Mistral): the misses without Qwen3's norms."""
HF_TYPE = {
    QWEN3_PLAIN.name: "qwen3",
    MISTRAL_WIDE.name: "mistral",
    QWEN3_WIDE.name: "qwen3",
    QWEN3_NARROW.name: "qwen3",
    MISTRAL_NARROW.name: "mistral",
    QWEN3_MOE.name: "qwen3_moe",
    QWEN3_MOE_WIDE.name: "qwen3_moe",
}
STRATEGY = {"single": "single", "ddp": "ddp", "fsdp": "fsdp-full-shard"}


@dataclass(frozen=True)
class Case(heldout.TypedCase):
    """A held-out case, a LoRA one with peft's adapters."""

    def run_options(self) -> dict:
        return {"adapt": self.adapt}

    def adapt(self, model) -> None:
        """peft's adapters on a LoRA case's model (calibrate.finetune.adapt); a full one trains as built."""
        if self.job.train.finetune != "full":
            from calibrate.finetune import adapt

            adapt(self.job, model)


def _case(
    loop, model, strategy, *, gpus=1, b=1, s=128, ep=1, precision="fp32", attention="sdpa", ac="none", lora=""
) -> Case:
    """``ac``: the loop's own policy (heldout.TODAY_AC: what a user types for it); ``lora``: peft
    LoRA rank-8 adapters on these targets (none: a full fine-tune)."""
    train = TrainSpec(
        seq_len=s,
        micro_batch=b,
        precision=precision,
        attention=attention,
        device="cpu",
        activation_checkpointing=heldout.TODAY_AC[ac],
        **({"finetune": "lora", "lora_targets": lora} if lora else {}),
    )
    job = Job(model=model, train=train, cluster=ClusterSpec(gpus=gpus), plan=Plan(strategy=STRATEGY[strategy], ep=ep))
    where = "g"  # every case runs on real ranks here
    extra = (f"-ac{ac}" if ac != "none" else "") + (f"-lora-{lora}" if lora else "")
    name = f"{model.name}-{loop}-{strategy}-ep{ep}-{precision}-{attention}{extra}-{where}{gpus}-b{b}s{s}"
    return Case(name, job, loop, ac, "local", HF_TYPE[model.name])


CASES = (
    _case("plain-kept", QWEN3_WIDE, "single", b=2, s=256),
    _case("plain-kept", QWEN3_WIDE, "fsdp", gpus=2, b=2, s=256),
    _case("plain-freed", QWEN3_WIDE, "single", b=1, s=128, precision="bf16"),
    _case("plain-freed", QWEN3_NARROW, "single", b=1, s=256, attention="eager"),
    _case("hf-trainer", MISTRAL_NARROW, "ddp", gpus=2, b=2, s=128),
    _case("plain-kept", QWEN3_MOE, "single", b=2, s=256),
    _case("plain-kept", QWEN3_MOE_WIDE, "single", b=2, s=256),
    _case("plain-kept", QWEN3_MOE_WIDE, "fsdp", gpus=2, b=2, s=128),
    _case("plain-kept", QWEN3_MOE_WIDE, "fsdp", gpus=2, b=2, s=128, ep=2),
    # measured after the model: the loops' AC, mixed precision under FSDP2 and LoRA's o_proj input
    _case("hf-trainer", QWEN3_WIDE, "single", b=2, s=256, ac="full"),
    _case("torchtitan", QWEN3_WIDE, "fsdp", gpus=2, b=2, s=256, ac="op"),
    _case("plain-kept", QWEN3_WIDE, "fsdp", gpus=2, b=1, s=128, precision="mixed-bf16"),
    _case("plain-kept", QWEN3_NARROW, "single", b=2, s=256, lora="all-linear"),
    _case("torchtune", MISTRAL_NARROW, "fsdp", gpus=2, b=1, s=256),
    _case("hf-trainer", QWEN3_MOE_WIDE, "single", b=2, s=128, ac="full"),
    _case("plain-freed", QWEN3_MOE_WIDE, "ddp", gpus=2, b=2, s=128),
    # the three Qwen3 cases over 2 % above, again on twins: heads of hidden / heads, no q/k norms
    *(
        _case(loop, twin, strategy, gpus=gpus, b=b, s=s, ac=ac, precision=precision)
        for twin in (QWEN3_PLAIN, MISTRAL_WIDE)
        for loop, strategy, gpus, b, s, ac, precision in (
            ("hf-trainer", "single", 1, 2, 256, "full", "fp32"),
            ("torchtitan", "fsdp", 2, 2, 256, "op", "fp32"),
            ("plain-kept", "fsdp", 2, 1, 128, "none", "mixed-bf16"),
        )
    ),
)
BY_ID = {case.id: case for case in CASES}


config_json = heldout.config_json


measure_case = heldout.measure_on_ranks


def main(argv=None) -> None:
    heldout.main(argv, matrix=sys.modules[__name__])


if __name__ == "__main__":
    main()
