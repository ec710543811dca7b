"""Mixture of experts: parameter counts against the transformers modules, the MoE block's
saved tensors against autograd, expert parallelism's rules, and the measured MoE matrix."""

import pytest

from memplan import catalog, moe
from memplan.errors import MemplanError
from memplan.hfconfig import model_from_hf_config
from memplan.specs import ModelSpec

TINY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        decoder_sparse_step=2,
    ),
}


def tiny_config(model_type: str, **overrides) -> dict:
    return {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **TINY[model_type],
        **overrides,
    }


def hf_num_params(config, cls_name: str | None = None) -> int:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    with torch.device("meta"):
        if cls_name:
            model = getattr(tf, cls_name)(config)
        else:
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(TINY))
@pytest.mark.parametrize("tied", [False, True])
def test_hf_config_counts_what_transformers_builds(model_type, tied):
    cfg = tiny_config(model_type, tie_word_embeddings=tied)
    spec = model_from_hf_config(cfg)
    assert spec.num_experts == cfg.get("num_local_experts", cfg.get("num_experts"))
    assert spec.num_params == hf_num_params(cfg)


def test_mixtral_preset_counts_what_transformers_builds():
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset("mixtral-8x7b")
    config = tf.MixtralConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
    )
    assert spec.num_params == hf_num_params(config, "MixtralForCausalLM")


def test_deepseek_v3_gqa_preset_counts_glm4_moe():
    """transformers' GLM-4-MoE is DeepSeek-V3's MoE (first dense layers, shared experts,
    256 routed) with GQA attention: the preset's shapes built as one."""
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset("deepseek-v3-gqa")
    config = tf.Glm4MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        moe_intermediate_size=spec.moe_ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        n_routed_experts=spec.num_experts,
        n_shared_experts=spec.shared_ffn_hidden // spec.moe_ffn_hidden,
        num_experts_per_tok=spec.experts_per_token,
        first_k_dense_replace=spec.first_dense_layers,
        attention_bias=False,
        use_qk_norm=False,
        tie_word_embeddings=False,
    )
    assert spec.num_params == hf_num_params(config, "Glm4MoeForCausalLM")


def test_active_params_count_top_k_experts():
    spec = catalog.model_preset("mixtral-8x7b")
    idle = spec.num_layers * (spec.num_experts - spec.experts_per_token) * 3 * spec.hidden * spec.ffn_hidden
    assert moe.active_params(spec) == spec.num_params - idle


@pytest.mark.parametrize("model_type,fragment", [("deepseek_v3", "latent attention"), ("qwen3_moe", "q/k RMSNorms")])
def test_undescribed_attention_is_refused(model_type, fragment):
    with pytest.raises(MemplanError, match=fragment):
        model_from_hf_config({"model_type": model_type, "hidden_size": 64})


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (dict(experts_per_token=5), "between 1 and num_experts 4"),
        (dict(arch="gpt2", activation="gelu"), "arch llama"),
        (dict(shared_expert_gate=True), "needs a shared expert"),
        (dict(first_dense_layers=2), "no MoE layer"),
    ],
)
def test_bad_moe_fields(changes, fragment):
    with pytest.raises(MemplanError, match=fragment):
        ModelSpec(
            **{
                "num_layers": 2,
                "hidden": 64,
                "num_heads": 4,
                "ffn_hidden": 96,
                "vocab_size": 128,
                "num_experts": 4,
                "experts_per_token": 2,
                **changes,
            }
        )
