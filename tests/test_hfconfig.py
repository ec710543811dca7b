import json
from dataclasses import replace

import pytest

from memplan.errors import MemplanError
from memplan.hfconfig import model_from_hf_config

_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=160, vocab_size=1000)
SMALL = {
    # mistral and qwen2 default to 8 and 32 kv heads: set them to match the 4 heads
    "llama": {**_SMALL, "num_key_value_heads": 4},
    "mistral": {**_SMALL, "num_key_value_heads": 4},
    "qwen2": {**_SMALL, "num_key_value_heads": 4},
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0),
    "gpt_neox": _SMALL,
    "vit": dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=160,
        image_size=32,
        patch_size=8,
        num_labels=5,
    ),
}


def hf_config(model_type, **overrides):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model(model_type, **{**SMALL[model_type], **overrides})


def hf_num_params(cfg):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        if cfg.model_type == "vit":
            model = transformers.ViTForImageClassification(cfg)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def write(tmp_path, content, folder="my-model"):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize("model_type", sorted(SMALL))
def test_parameter_count_matches_transformers_from_dict_and_file(model_type, tmp_path):
    cfg = hf_config(model_type)
    expected = hf_num_params(cfg)
    from_dict = model_from_hf_config(cfg.to_dict())
    from_file = model_from_hf_config(write(tmp_path, cfg.to_dict()))
    assert from_dict.num_params == expected
    assert from_file == replace(from_dict, name="my-model")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_gqa(model_type):
    cfg = hf_config(model_type, num_key_value_heads=2)
    spec = model_from_hf_config(cfg.to_dict())
    assert spec.num_kv_heads == 2
    assert spec.num_params == hf_num_params(cfg)


@pytest.mark.parametrize("model_type,tied", [("gpt2", False), ("llama", True), ("qwen2", True), ("gpt_neox", True)])
def test_tied_and_untied(model_type, tied):
    cfg = hf_config(model_type, tie_word_embeddings=tied)
    spec = model_from_hf_config(cfg.to_dict())
    assert spec.tied_embeddings is tied
    assert spec.num_params == hf_num_params(cfg)


def test_tie_defaults_when_absent():
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100, "n_positions": 8}
    llama = {"model_type": "llama", **_SMALL}
    assert model_from_hf_config(gpt2).tied_embeddings  # GPT2Config ties by default
    assert not model_from_hf_config(llama).tied_embeddings
    assert model_from_hf_config(gpt2).ffn_hidden == 4 * 64  # n_inner absent


def test_llama_biases():
    both = hf_config("llama", attention_bias=True, mlp_bias=True)
    spec = model_from_hf_config(both.to_dict())
    assert spec.linear_bias and spec.num_params == hf_num_params(both)
    attention_only = hf_config("llama", attention_bias=True)
    spec = model_from_hf_config(attention_only.to_dict())
    assert spec.qkv_bias and not spec.linear_bias
    # ModelSpec has no o_proj-only bias: documented undercount of hidden per layer.
    assert hf_num_params(attention_only) - spec.num_params == 2 * 64


@pytest.mark.parametrize(
    "model_type,overrides,dropout",
    [
        ("gpt2", dict(attn_pdrop=0.05, resid_pdrop=0.2, embd_pdrop=0.0), 0.2),
        ("llama", dict(attention_dropout=0.1), 0.1),
        ("gpt_neox", dict(attention_dropout=0.0, hidden_dropout=0.15), 0.15),
        ("vit", dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0), 0.1),
    ],
)
def test_dropout_read_back(model_type, overrides, dropout):
    assert model_from_hf_config(hf_config(model_type, **overrides).to_dict()).dropout == dropout


def test_vit_shapes():
    spec = model_from_hf_config(hf_config("vit").to_dict())
    assert (spec.arch, spec.vocab_size, spec.max_positions, spec.patch_size) == ("vit", 5, 17, 8)


def test_names(tmp_path):
    cfg = {"model_type": "llama", **_SMALL}
    assert model_from_hf_config(write(tmp_path, cfg)).name == "my-model"
    assert model_from_hf_config(tmp_path / "my-model").name == "my-model"  # a folder works too
    assert model_from_hf_config({**cfg, "_name_or_path": "meta-llama/Llama-2-7b-hf"}).name == "meta-llama/Llama-2-7b-hf"
    assert model_from_hf_config(cfg, name="mine").name == "mine"


def test_real_llama2_7b_config():
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    assert model_from_hf_config(cfg).num_params == 6_738_415_616


def one_line_error(source, *fragments):
    with pytest.raises(MemplanError) as err:
        model_from_hf_config(source)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_missing_file(tmp_path):
    one_line_error(tmp_path / "nope" / "config.json", "does not exist", "nope")


def test_malformed_json(tmp_path):
    one_line_error(write(tmp_path, '{"model_type": "llama",\n  "hidden_size": }'), "not valid JSON", "line 2 column")


def test_non_object_json(tmp_path):
    one_line_error(write(tmp_path, "[1, 2]"), "JSON list, not an object")


def test_unsupported_model_type():
    one_line_error(
        {"model_type": "t5"},
        "model_type 't5' is not supported (supported: bert, deepseek_v3, gpt2, gpt_neox, llama, mistral, mixtral, "
        "phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, roberta, vit); measure it with "
        "`memplan calibrate run --config config.json --mode trace --gpus N`",
    )


def test_missing_model_type():
    one_line_error(dict(_SMALL), "config.json has no model_type")


def test_missing_key():
    cfg = {"model_type": "llama", **_SMALL}
    del cfg["num_hidden_layers"]
    one_line_error(cfg, "config.json has no num_hidden_layers (or n_layer)")


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("hidden_size", "64", "hidden_size must be a positive integer, got '64'"),
        ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false"),
        ("attention_dropout", "0.1", "attention_dropout must be a number"),
        ("hidden_act", "relu", "activation 'relu' is not supported"),
        ("head_dim", 0, "head_dim must be a positive integer, got 0"),
    ],
)
def test_bad_values(key, value, expected):
    one_line_error({"model_type": "llama", **_SMALL, key: value}, expected)


def test_a_head_dim_apart_is_read_for_llama_and_refused_for_gpt2():
    spec = model_from_hf_config({"model_type": "llama", **_SMALL, "head_dim": 32})
    assert (spec.head_dim, spec.q_hidden) == (32, 128)
    assert model_from_hf_config({"model_type": "llama", **_SMALL, "head_dim": 16}).head_dim == 0  # 64/4 spelled out
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 32}
    one_line_error(gpt2 | {"head_dim": 32}, "only llama-family configs")


def test_bad_source_type():
    one_line_error(42, "must be a path or a dict")
