"""Presets and config.json input of the models people fine-tune: counts equal to the modules
transformers builds; the families memplan cannot describe refused with the feature named."""

import pytest

from memplan.errors import MemplanError
from memplan.finetune import full_tensors
from memplan.hfconfig import UNDESCRIBED, model_from_hf_config

PHI3 = {
    "model_type": "phi3",
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1408,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
}


def test_phi3_config_counts_what_transformers_builds():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    spec = model_from_hf_config(PHI3)
    with torch.device("meta"):
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**{k: v for k, v in PHI3.items() if k != "model_type"}))
    assert spec.arch == "llama" and spec.num_params == sum(p.numel() for p in model.parameters())
    # tensor by tensor too: the fused qkv_proj and gate_up_proj (peft adapts each once)
    assert [tuple(p.shape) for p in model.parameters()] == list(full_tensors(spec))


@pytest.mark.parametrize("head_dim", [64, 128, None])  # hidden/heads; Qwen3-0.6B's wider heads; Qwen3Config's 128
def test_qwen3_config_counts_what_transformers_builds(head_dim):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    cfg = PHI3 | {"model_type": "qwen3"} | ({"head_dim": head_dim} if head_dim else {})
    spec = model_from_hf_config(cfg)
    keys = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**keys))
    assert spec.qk_norm and spec.head_size == model.model.layers[0].self_attn.head_dim
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    # per-tensor optimizers step the tensors in module order, q_norm and k_norm after o_proj
    assert [tuple(p.shape) for p in model.parameters()] == list(full_tensors(spec))


@pytest.mark.parametrize(
    ("model_type", "feature"),
    [
        ("gemma2", "soft-caps"),
        ("gemma3_text", "sliding-window"),
        ("gemma3", "sliding-window"),
        ("ministral", "sliding-window"),
    ],
)
def test_undescribed_families_are_refused_in_one_line_naming_the_feature(model_type, feature):
    with pytest.raises(MemplanError) as err:
        model_from_hf_config(PHI3 | {"model_type": model_type})
    message = str(err.value)
    assert "\n" not in message and model_type in message and feature in message
    assert UNDESCRIBED[model_type] in message


def test_unknown_model_type_lists_what_is_accepted():
    with pytest.raises(MemplanError, match=r"not supported \(supported: .*phi3"):
        model_from_hf_config(PHI3 | {"model_type": "falcon"})
