"""The multi-head latent attention matrix: transformers' DeepseekV3ForCausalLM (MLA: q_a_proj +
q_a_layernorm + q_b_proj, or q_proj without a q LoRA rank; kv_a_proj_with_mqa + kv_a_layernorm +
kv_b_proj; rotary on the qk_rope part; eager experts) built from tiny configs with random
weights and trained by the held-out loops on CPU: one process, DDP and FSDP2 on 2 gloo ranks
(and EP 2 under FSDP2, calibrate.moe_ep), fp32, bf16, mixed-bf16 and autocast, dense-first and
MoE layers, full AC.

    python -m validation.mla_matrix            # measure every case not yet recorded
    python -m validation.mla_matrix --report   # measured, estimated today, error %

Records go to validation/records/mla_matrix_cpu.jsonl in validation.heldout's format (its report reads them).
A model's MLA fields are the config.json keys transformers builds the attention from; the first
records were made before ModelSpec held them: their spec carries them under the same names, their
estimate is memplan's refusal of that config.json then (``estimate_error``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from memplan.mla import MLA_FIELDS
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

from . import heldout

OUT = "validation/records/mla_matrix_cpu.jsonl"
TIMEOUT_S = 300
# the held-out matrix's record, report and command line serve this one (heldout.main's matrix)
record_id, make_record, render_report = heldout.record_id, heldout.make_record, heldout.render_report

DSV3_Q = ModelSpec(
    name="dsv3-h256-q128-kv64-e8",
    num_layers=2,
    hidden=256,
    num_heads=4,
    ffn_hidden=512,
    vocab_size=4096,
    num_experts=8,
    experts_per_token=2,
    moe_ffn_hidden=128,
    shared_ffn_hidden=128,
    first_dense_layers=1,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)
"""DeepSeek-V3's layout: a q LoRA rank, one dense layer then an MoE one (8 routed experts top-2,
one shared expert)."""
DSV3_NOQ = ModelSpec(
    name="dsv3-h192-kv48-e8",
    num_layers=3,
    hidden=192,
    num_heads=6,
    ffn_hidden=384,
    vocab_size=4096,
    num_experts=8,
    experts_per_token=2,
    moe_ffn_hidden=96,
    shared_ffn_hidden=192,
    first_dense_layers=1,
    kv_lora_rank=48,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=24,
)
"""DeepSeek-V2-Lite's layout: no q LoRA rank (q_proj), v narrower than the q/k nope part,
two shared experts, one dense layer then two MoE ones."""
DSV3_DENSE = ModelSpec(
    name="dsv3-h256-q96-kv64-dense",
    num_layers=2,
    hidden=256,
    num_heads=4,
    ffn_hidden=512,
    vocab_size=4096,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=48,
    qk_rope_head_dim=16,
    v_head_dim=48,
)
"""MLA alone: every layer dense (first_k_dense_replace = num_layers)."""
STRATEGY = {"single": "single", "ddp": "ddp", "fsdp": "fsdp-full-shard"}


@dataclass(frozen=True)
class Case(heldout.TypedCase):
    """A case of a DeepSeek-V3 model: its config overrides given to calibrate.loops.run."""

    def run_options(self) -> dict:
        return {"hf_overrides": hf_overrides(self)}


def _case(loop, model, strategy, *, gpus=1, b=1, s=128, precision="fp32", ac="none", ep=1) -> Case:
    train = TrainSpec(
        seq_len=s,
        micro_batch=b,
        precision=precision,
        device="cpu",
        activation_checkpointing=heldout.TODAY_AC[ac],
    )
    job = Job(model=model, train=train, cluster=ClusterSpec(gpus=gpus), plan=Plan(strategy=STRATEGY[strategy], ep=ep))
    extra = (f"-ac{ac}" if ac != "none" else "") + (f"-ep{ep}" if ep > 1 else "")
    name = f"{model.name}-{loop}-{strategy}-{precision}{extra}-g{gpus}-b{b}s{s}"
    return Case(name, job, loop, ac, "local", "deepseek_v3")


CASES = (
    _case("plain-kept", DSV3_Q, "single", b=2, s=128),
    _case("plain-kept", DSV3_NOQ, "single", b=2, s=128),
    _case("plain-kept", DSV3_DENSE, "single", b=2, s=256),
    _case("plain-freed", DSV3_Q, "single", b=1, s=128, precision="bf16"),
    _case("plain-freed", DSV3_DENSE, "single", b=2, s=128, precision="bf16"),
    _case("plain-kept", DSV3_Q, "fsdp", gpus=2, b=2, s=128),
    _case("plain-kept", DSV3_NOQ, "fsdp", gpus=2, b=1, s=256),
    _case("hf-trainer", DSV3_Q, "single", b=2, s=128, ac="full"),
    # measured after the model: FSDP2's mixed precision (bf16 compute over fp32 parameters)
    _case("plain-kept", DSV3_Q, "fsdp", gpus=2, b=2, s=128, precision="mixed-bf16"),
    _case("plain-freed", DSV3_DENSE, "fsdp", gpus=2, b=1, s=256, precision="mixed-bf16"),
    # measured after the model: autocast over fp32 parameters (memplan's default precision)
    _case("plain-kept", DSV3_NOQ, "single", b=2, s=128, precision="amp-bf16"),
    _case("hf-trainer", DSV3_Q, "single", b=2, s=128, precision="amp-bf16", ac="full"),
    # measured after the model: DDP, and expert parallel (EP 2, calibrate.moe_ep) under FSDP2
    _case("plain-freed", DSV3_NOQ, "ddp", gpus=2, b=2, s=128),
    _case("plain-kept", DSV3_Q, "fsdp", gpus=2, b=2, s=128, ep=2),
)
BY_ID = {case.id: case for case in CASES}


def hf_overrides(case: Case) -> dict:
    """The transformers DeepseekV3Config keys beyond the spec's shapes: the MLA shapes (q_lora_rank
    0 is None: q_proj) and, for a dense model, every layer dense."""
    m = case.job.model
    keys: dict = {f: getattr(m, f) for f in MLA_FIELDS} | {"q_lora_rank": m.q_lora_rank or None}
    if not case.job.model.num_experts:
        keys["first_k_dense_replace"] = case.job.model.num_layers
    return keys


def config_json(case: Case) -> dict:
    """The config.json of the case's model, as a user would hand it to memplan."""
    return heldout.config_json(case, **hf_overrides(case))


measure_case = heldout.measure_on_ranks


def main(argv=None) -> None:
    heldout.main(argv, matrix=sys.modules[__name__])


if __name__ == "__main__":
    main()
