"""The shipped tables: presets match their published totals and the real modules; GPU rows are sane."""

import pytest

from memplan import catalog
from memplan.errors import MemplanError

PRESETS = list(catalog.models())


@pytest.mark.parametrize("name", PRESETS)
def test_preset_matches_its_published_total(name):
    published, source = catalog.published_params()[name]
    assert source
    assert catalog.model_preset(name).num_params == pytest.approx(published, rel=0.005)


# transformers config for each family, built from a preset's shapes
def _hf_config(spec):
    import transformers as tf

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        intermediate_size=spec.ffn_hidden,
    )
    if spec.arch == "llama":
        if spec.qk_norm:
            return tf.Qwen3Config(
                **common,
                num_key_value_heads=spec.num_kv_heads,
                head_dim=spec.head_size,
                tie_word_embeddings=spec.tied_embeddings,
            )
        cls = tf.Qwen2Config if spec.qkv_bias else tf.LlamaConfig
        return cls(**common, num_key_value_heads=spec.num_kv_heads, tie_word_embeddings=spec.tied_embeddings)
    if spec.arch == "gpt2":
        return tf.GPT2Config(
            vocab_size=spec.vocab_size,
            n_embd=spec.hidden,
            n_layer=spec.num_layers,
            n_head=spec.num_heads,
            n_inner=spec.ffn_hidden,
            n_positions=spec.max_positions,
        )
    if spec.arch == "neox":
        return tf.GPTNeoXConfig(**common, tie_word_embeddings=False)
    if spec.arch == "bert":
        cls = tf.RobertaConfig if spec.type_vocab_size == 1 else tf.BertConfig
        return cls(**common, max_position_embeddings=spec.max_positions, type_vocab_size=spec.type_vocab_size)
    return tf.ViTConfig(
        hidden_size=spec.hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        intermediate_size=spec.ffn_hidden,
        patch_size=spec.patch_size,
        image_size=224,
        num_labels=spec.vocab_size,
    )


# the MoE presets are built by tests/test_moe.py (as Mixtral / GLM-4-MoE modules)
DENSE = [n for n in PRESETS if not catalog.model_preset(n).num_experts]


@pytest.mark.parametrize("name", [n for n in DENSE if "405b" not in n and "72b" not in n and "70b" not in n])
def test_preset_counts_what_transformers_builds(name):
    """The formula against the real module, instantiated without memory on the meta device."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset(name)
    config = _hf_config(spec)
    with torch.device("meta"):
        if spec.arch == "vit":
            model = tf.ViTForImageClassification(config)
        elif spec.arch == "bert":  # the presets' heads: BertForMaskedLM, RobertaForMaskedLM
            model = tf.AutoModelForMaskedLM.from_config(config)
        else:
            model = tf.AutoModelForCausalLM.from_config(config)
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_gpu_rows_cite_a_datasheet_and_resolve_by_alias():
    names = set()
    for gpu in catalog.gpus().values():
        assert "datasheet" in gpu.source or "whitepaper" in gpu.source
        assert gpu.memory_bytes > 8 * 2**30 and gpu.peak_fp16_flops > gpu.peak_fp32_flops
        for alias in (gpu.name, *gpu.aliases):
            assert alias not in names, f"{alias} names two GPUs"
            names.add(alias)
            assert catalog.gpu(alias.upper()) is gpu
    assert catalog.gpu("v100-32gb").peak_bf16_flops is None
    assert catalog.gpu("h100").memory_bytes == 81559 * 2**20


def test_unknown_names_list_what_is_known():
    with pytest.raises(MemplanError, match=r"tpu-v9.*h100-sxm"):
        catalog.gpu("tpu-v9")
    with pytest.raises(MemplanError, match=r"llama-5.*llama-2-7b"):
        catalog.model_preset("llama-5")
    with pytest.raises(MemplanError, match="no bf16"):
        catalog.gpu("v100").peak_flops("mixed-bf16")


def test_deepspeed_defaults_are_the_documented_ones():
    assert catalog.deepspeed_defaults()["reduce_bucket_size"] == 500_000_000
