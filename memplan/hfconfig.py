"""A ModelSpec from a Hugging Face ``config.json`` (a path or an already-loaded dict).

Each supported ``model_type`` maps onto one ModelSpec family; the shapes are read
through a table of key aliases (GPT-2 spells them ``n_layer``/``n_embd``/...), and
every flag that is absent takes the default of the transformers config class.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MemplanError
from .specs import ModelSpec

# ModelSpec field -> config.json keys, the Hugging Face standard name first, GPT-2's second.
SHAPE_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "num_heads": ("num_attention_heads", "n_head"),
    "ffn_hidden": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
}
ACTIVATION_KEYS = ("hidden_act", "activation_function")
# transformers' ACT2FN name -> ModelSpec activation ("gelu_pytorch_tanh" is one fused kernel).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu_new"}
_MISSING = object()


@dataclass(frozen=True)
class Family:
    arch: str
    tied: bool
    """transformers' default for tie_word_embeddings."""
    dropouts: dict[str, float]
    """Dropout keys and their defaults; ModelSpec.dropout is their maximum."""
    biases: Callable[[dict], tuple[bool, bool]] = lambda cfg: (False, False)
    """(qkv_bias, linear_bias) from the config."""
    extra: Callable[[dict], dict[str, Any]] = lambda cfg: {}
    """Family-specific ModelSpec fields; they take precedence over SHAPE_KEYS."""


def _flag(cfg: dict, key: str, default: bool) -> bool:
    return read(cfg, (key,), bool, default)


def _llama_biases(cfg: dict) -> tuple[bool, bool]:
    # LlamaAttention puts attention_bias on q/k/v *and* o_proj, LlamaMLP mlp_bias on all three
    # projections; ModelSpec only has "q/k/v" and "every linear", so attention_bias alone
    # undercounts o_proj's bias (hidden per layer) and mlp_bias alone is ignored.
    attention = _flag(cfg, "attention_bias", False)
    return attention, attention and _flag(cfg, "mlp_bias", False)


def _gpt2_extra(cfg: dict) -> dict[str, Any]:
    hidden = read(cfg, SHAPE_KEYS["hidden"], int)
    return {
        "max_positions": read(cfg, ("n_positions",), int),
        # GPT2MLP: n_inner None means 4 * n_embd (modeling_gpt2.py, GPT2Block).
        "ffn_hidden": read(cfg, SHAPE_KEYS["ffn_hidden"], int, 4 * hidden),
    }


def _vit_extra(cfg: dict) -> dict[str, Any]:
    patch = read(cfg, ("patch_size",), int)
    side = read(cfg, ("image_size",), int)
    labels = cfg.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else read(cfg, ("num_labels",), int, 2)
    return {
        "patch_size": patch,
        "image_channels": read(cfg, ("num_channels",), int, 3),
        "max_positions": (side // patch) ** 2 + 1,  # ViTEmbeddings: one per patch + the class token
        "vocab_size": num_labels,  # ViTForImageClassification's head has num_labels outputs
    }


_ENCODER_HEADS = ("ForMaskedLM", "ForSequenceClassification")


def _bert_extra(cfg: dict) -> dict[str, Any]:
    """BERT / RoBERTa: learned positions, token types, and the head its ``architectures`` names
    (none named: the MLM head, as bert-base-uncased's config.json has it)."""
    archs = cfg.get("architectures") or ["ForMaskedLM"]
    heads = [h for a in archs for h in _ENCODER_HEADS if isinstance(a, str) and a.endswith(h)]
    if not heads:
        raise MemplanError(
            f"config.json architectures {archs!r} name no head memplan describes for an encoder; "
            "supported: *ForMaskedLM, *ForSequenceClassification"
        )
    labels = cfg.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else read(cfg, ("num_labels",), int, 2)
    return {
        "max_positions": read(cfg, ("max_position_embeddings",), int, 512),
        "type_vocab_size": read(cfg, ("type_vocab_size",), int, 2),
        "num_labels": num_labels if heads[0] == "ForSequenceClassification" else 0,
    }


def _moe_extra(cfg: dict, *, experts: str, shared: str = "") -> dict[str, Any]:
    """The routed experts (``experts`` names the count key), top-k, expert width, the sparse-layer
    step and the shared expert (``shared`` its width key; Qwen2-MoE gates it)."""
    fields = {
        "num_experts": read(cfg, (experts,), int),
        "experts_per_token": read(cfg, ("num_experts_per_tok",), int),
        "moe_ffn_hidden": read(cfg, ("moe_intermediate_size", "intermediate_size"), int),
        "moe_every": read(cfg, ("decoder_sparse_step",), int, 1),
    }
    if cfg.get("mlp_only_layers"):
        raise MemplanError(
            f"config.json mlp_only_layers {cfg['mlp_only_layers']!r} is not supported; only an empty list "
            "(dense layers by decoder_sparse_step)"
        )
    if shared:
        fields |= {"shared_ffn_hidden": read(cfg, (shared,), int), "shared_expert_gate": True}
    return fields


def _qwen2_moe_extra(cfg: dict) -> dict[str, Any]:
    # Qwen2MoeTopKRouter: norm_topk_prob (default false), the weights cast to the logits' dtype
    return _moe_extra(cfg, experts="num_experts", shared="shared_expert_intermediate_size") | {
        "normalize_top_k": _flag(cfg, "norm_topk_prob", False),
        "top_k_weights_fp32": False,
    }


def _deepseek_v3_extra(cfg: dict) -> dict[str, Any]:
    """DeepseekV3Config's defaults where a key is absent (configuration_deepseek_v3.py): MLA
    (q_lora_rank null: q_proj), the routed experts from layer first_k_dense_replace on, the
    shared experts as one MLP of n_shared_experts × moe_intermediate_size (modeling_deepseek_v3.py)."""
    q_lora = cfg.get("q_lora_rank", 1536)
    fields: dict[str, Any] = {
        "q_lora_rank": 0 if q_lora is None else read(cfg, ("q_lora_rank",), int),
        "kv_lora_rank": read(cfg, ("kv_lora_rank",), int, 512),
        "qk_nope_head_dim": read(cfg, ("qk_nope_head_dim",), int, 128),
        "qk_rope_head_dim": read(cfg, ("qk_rope_head_dim",), int, 64),
        "v_head_dim": read(cfg, ("v_head_dim",), int, 128),
    }
    layers = read(cfg, SHAPE_KEYS["num_layers"], int, 61)
    first_dense = cfg.get("first_k_dense_replace", 3)
    if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
        raise MemplanError(f"config.json first_k_dense_replace must be a non-negative integer, got {first_dense!r}")
    if first_dense >= layers:  # every layer a DeepseekV3MLP
        return fields
    width = read(cfg, ("moe_intermediate_size",), int, 2048)
    shared = cfg.get("n_shared_experts", 1)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise MemplanError(f"config.json n_shared_experts must be a non-negative integer, got {shared!r}")
    return fields | {
        "num_experts": read(cfg, ("n_routed_experts",), int, 256),
        "experts_per_token": read(cfg, ("num_experts_per_tok",), int, 8),
        "moe_ffn_hidden": width,
        "shared_ffn_hidden": shared * width,
        "first_dense_layers": first_dense,
        "normalize_top_k": _flag(cfg, "norm_topk_prob", True),
        "top_k_weights_fp32": True,  # DeepseekV3TopkRouter: sigmoid of fp32 logits, gathered
    }


# BertLayer / RobertaLayer: post-LayerNorm blocks, every linear with a bias (modeling_bert.py)
_BERT = Family(
    "bert",
    True,
    {"attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1},
    lambda cfg: (False, True),
    _bert_extra,
)
FAMILIES = {
    "llama": Family("llama", False, {"attention_dropout": 0.0}, _llama_biases),
    "mistral": Family("llama", False, {"attention_dropout": 0.0}),
    # Qwen2Attention: q/k/v always have a bias, o_proj and the MLP never (modeling_qwen2.py).
    "qwen2": Family("llama", False, {"attention_dropout": 0.0}, lambda cfg: (True, False)),
    # Qwen3Attention: q/k/v biases only with attention_bias (default false), per-head q_norm and
    # k_norm over head_dim (modeling_qwen3.py; Qwen3Config's head_dim defaults to 128, read below)
    "qwen3": Family(
        "llama",
        False,
        {"attention_dropout": 0.0},
        lambda cfg: (_flag(cfg, "attention_bias", False), False),
        lambda cfg: {"qk_norm": True},
    ),
    # Phi3Attention / Phi3MLP fuse qkv_proj and gate_up_proj: the llama counts, no biases
    # (modeling_phi3.py); resid_pdrop and embd_pdrop default to 0
    "phi3": Family(
        "llama",
        False,
        {"attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
        extra=lambda cfg: {"fused_projections": True},
    ),
    "gpt2": Family(
        "gpt2", True, {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1}, lambda cfg: (False, True), _gpt2_extra
    ),
    # MixtralExperts: num_local_experts of intermediate_size; no shared expert (modeling_mixtral.py)
    "mixtral": Family(
        "llama", False, {"attention_dropout": 0.0}, extra=lambda cfg: _moe_extra(cfg, experts="num_local_experts")
    ),
    # Qwen3MoeSparseMoeBlock: routed experts of moe_intermediate_size, no shared expert; the router
    # casts its top-k weights to the logits' dtype (Qwen3MoeTopKRouter); Qwen3 attention's q/k
    # norms and q/k/v biases only with attention_bias (modeling_qwen3_moe.py)
    "qwen3_moe": Family(
        "llama",
        False,
        {"attention_dropout": 0.0},
        lambda cfg: (_flag(cfg, "attention_bias", False), False),
        lambda cfg: (
            _moe_extra(cfg, experts="num_experts")
            | {"normalize_top_k": _flag(cfg, "norm_topk_prob", False), "top_k_weights_fp32": False, "qk_norm": True}
        ),
    ),
    # Qwen2MoeSparseMoeBlock: routed experts of moe_intermediate_size, one shared expert of
    # shared_expert_intermediate_size behind a sigmoid gate; q/k/v biases (modeling_qwen2_moe.py)
    "qwen2_moe": Family(
        "llama",
        False,
        {"attention_dropout": 0.0},
        lambda cfg: (True, False),
        _qwen2_moe_extra,
    ),
    # DeepseekV3Attention: multi-head latent attention, o_proj and q_a/kv_a biases with
    # attention_bias (refused by ModelSpec); DeepseekV3MoE after the first dense layers
    "deepseek_v3": Family(
        "llama",
        False,
        {"attention_dropout": 0.0},
        lambda cfg: (_flag(cfg, "attention_bias", False), False),
        _deepseek_v3_extra,
    ),
    # GPTNeoXAttention's attention_bias=False (rare) drops the q/k/v/dense biases, which ModelSpec
    # cannot express: they are still counted (4 * hidden per layer). use_parallel_residual=False
    # changes no parameter; ModelSpec's neox family always assumes the parallel residual.
    "gpt_neox": Family("neox", False, {"attention_dropout": 0.0, "hidden_dropout": 0.0}, lambda cfg: (False, True)),
    # ViTLayer: qkv_bias=False drops only the q/k/v biases; likewise still counted (3 * hidden).
    "vit": Family(
        "vit",
        False,
        {"attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0},
        lambda cfg: (False, True),
        _vit_extra,
    ),
    "bert": _BERT,
    "roberta": _BERT,
}


UNDESCRIBED = {
    "deberta": "its disentangled attention (relative position embeddings, c2p/p2c terms) has no ModelSpec "
    "fields; bert and roberta are described",
    "deberta-v2": "its disentangled attention (relative position buckets, c2p/p2c terms, shared key "
    "projections) has no ModelSpec fields; bert and roberta are described",
    "deepseek_v2": "its multi-head latent attention (q_lora_rank, kv_lora_rank) has no ModelSpec fields",
    "gemma2": "its alternating sliding-window / global attention and its attention and final logit soft-caps "
    "(attn_logit_softcapping, final_logit_softcapping) are not modelled",
    "gemma3_text": "its interleaved sliding-window / global attention (layer_types) and per-head q/k norms are "
    "not modelled",
    "gemma3": "its interleaved sliding-window / global attention (layer_types), per-head q/k norms and vision "
    "tower are not modelled",
    "gemma": "its embedding scaled by sqrt(hidden) and (1 + weight) RMSNorms are not measured yet",
    "ministral": "its interleaved sliding-window / full attention (layer_types, sliding_window) is not modelled",
}
"""Families whose block ModelSpec cannot express: refused with the feature, not estimated wrong."""


def read(cfg: dict, keys: tuple[str, ...], kind: type, default: Any = _MISSING) -> Any:
    """The first of ``keys`` that is set (null counts as unset), checked to be a ``kind``."""
    key = next((k for k in keys if cfg.get(k) is not None), None)
    if key is None:
        if default is _MISSING:
            aliases = f" (or {' or '.join(keys[1:])})" if keys[1:] else ""
            raise MemplanError(f"config.json has no {keys[0]}{aliases}")
        return default
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise MemplanError(f"config.json {key} must be a positive integer, got {value!r}")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise MemplanError(f"config.json {key} must be a number, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise MemplanError(f"config.json {key} must be true or false, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise MemplanError(f"config.json {key} must be a string, got {value!r}")
    return value


def load_config(source: str | Path | dict) -> tuple[dict, Path | None]:
    """The config as a dict, and the file it came from (None for a dict)."""
    if isinstance(source, dict):
        return source, None
    if not isinstance(source, (str, Path)):
        raise MemplanError(f"config source must be a path or a dict, got {type(source).__name__}")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MemplanError(
            f"config file {str(path)!r} does not exist; pass a Hugging Face config.json or the folder holding one"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise MemplanError(f"cannot read config file {str(path)!r}: {err}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise MemplanError(
            f"{str(path)!r} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    if not isinstance(cfg, dict):
        raise MemplanError(
            f"{str(path)!r} holds a JSON {type(cfg).__name__}, not an object; "
            'a config.json is an object like {"model_type": "llama", ...}'
        )
    return cfg, path


def model_from_hf_config(source: str | Path | dict, *, name: str | None = None) -> ModelSpec:
    """A ModelSpec equivalent to ``source``, a Hugging Face config.json path or dict.

    The parameter count equals that of the transformers model (``AutoModelForCausalLM``,
    ``ViTForImageClassification`` for vit, ``*ForMaskedLM`` or ``*ForSequenceClassification``
    for bert and roberta, as ``architectures`` names it) built from the same config.
    """
    return model_from_config(*load_config(source), name=name)


def model_from_config(cfg: dict, path: Path | None, *, name: str | None = None) -> ModelSpec:
    """``model_from_hf_config`` of a config already read (``load_config``) from ``path``."""
    model_type = read(cfg, ("model_type",), str)
    family = FAMILIES.get(model_type)
    # trace mode builds any model transformers knows (calibrate/trace.py): the way to a number
    trace = f"; measure it with `memplan calibrate run --config {path or 'config.json'} --mode trace --gpus N`"
    if model_type in UNDESCRIBED:
        raise MemplanError(f"model_type {model_type!r} cannot be described yet: {UNDESCRIBED[model_type]}{trace}")
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise MemplanError(f"model_type {model_type!r} is not supported (supported: {supported}){trace}")
    fields = family.extra(cfg)
    for spec_field, keys in SHAPE_KEYS.items():
        if spec_field not in fields:
            fields[spec_field] = read(cfg, keys, int)
    heads = fields["num_heads"]
    fields["num_kv_heads"] = read(cfg, ("num_key_value_heads",), int, heads)  # absent: no GQA
    # LlamaAttention and its kin: getattr(config, "head_dim", None) or hidden_size // num_attention_heads
    # (Qwen3Config alone defaults it, to 128); Qwen3-0.6B/4B and Mistral-Nemo set it apart from hidden/heads
    default_head_dim = 128 if model_type == "qwen3" else 0
    fields["head_dim"] = read(cfg, ("head_dim",), int, default_head_dim)
    if fields.get("kv_lora_rank"):  # DeepseekV3Config sets head_dim = qk_rope_head_dim: no head width
        fields["head_dim"] = 0
    if fields["head_dim"] and fields["head_dim"] * heads != fields["hidden"] and family.arch != "llama":
        raise MemplanError(
            f"config.json head_dim {fields['head_dim']} differs from hidden_size/num_attention_heads "
            f"= {fields['hidden']}/{heads}; only llama-family configs (llama, mistral, qwen2, qwen3, phi3, "
            "mixtral, qwen2_moe, qwen3_moe) set it apart"
        )
    act = read(cfg, ACTIVATION_KEYS, str, "")
    if act and act not in ACTIVATIONS:
        raise MemplanError(f"config.json activation {act!r} is not supported; supported: " + ", ".join(ACTIVATIONS))
    qkv_bias, linear_bias = family.biases(cfg)
    return ModelSpec(
        name=name or _default_name(cfg, path, model_type),
        arch=family.arch,
        tied_embeddings=family.arch != "vit" and _flag(cfg, "tie_word_embeddings", family.tied),
        dropout=max(float(read(cfg, (key,), float, default)) for key, default in family.dropouts.items()),
        activation=ACTIVATIONS.get(act, ""),
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        **fields,
    )


def _default_name(cfg: dict, path: Path | None, model_type: str) -> str:
    given = cfg.get("_name_or_path")
    if isinstance(given, str) and given:
        return given
    return path.resolve().parent.name if path is not None else model_type


BNB_ACCEPTED = {
    "bnb_4bit_quant_type": ("nf4", "fp4"),
    "bnb_4bit_compute_dtype": ("bfloat16", "float16", None),
    "bnb_4bit_quant_storage": ("uint8", None),
    "llm_int8_skip_modules": (None,),
    "llm_int8_enable_fp32_cpu_offload": (False, None),
}
"""transformers' BitsAndBytesConfig fields (utils/quantization_config.py) a 4-bit checkpoint's
``quantization_config`` may hold and memplan's qlora models: both 4-bit codes (one byte per two
weights, the same absmax blocks: bitsandbytes functional.quantize_4bit), a 2-byte compute dtype
(the dequantized weight's), uint8 storage, every block linear quantized. ``llm_int8_threshold``
and ``llm_int8_has_fp16_weight`` are LLM.int8's (8-bit) and change nothing here."""


def bnb_4bit_double_quant(cfg: dict, path: Path | None) -> bool | None:
    """A config.json's bitsandbytes 4-bit ``quantization_config`` (a pre-quantized checkpoint, or
    ``save_pretrained`` after ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``):
    its ``bnb_4bit_use_double_quant`` (BitsAndBytesConfig's default False); None: the config
    holds no 4-bit quantization. What memplan does not model is refused, naming the field."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    where = f"{path or 'config.json'} quantization_config"
    method = quant.get("quant_method")
    if method != "bitsandbytes":
        raise MemplanError(
            f"{where}.quant_method {method!r} is not modelled; memplan models bitsandbytes 4-bit (qlora)"
        )
    if quant.get("load_in_8bit"):
        raise MemplanError(f"{where}.load_in_8bit true (LLM.int8) is not modelled; memplan models load_in_4bit (qlora)")
    if not quant.get("load_in_4bit"):
        return None
    for field, accepted in BNB_ACCEPTED.items():
        value = quant.get(field)
        if value not in accepted and not (value == [] and None in accepted):
            shown = ", ".join(str(a).lower() if a is not None else "unset" for a in accepted)
            raise MemplanError(f"{where}.{field} {value!r} is not modelled; accepted: {shown}")
    return bool(quant.get("bnb_4bit_use_double_quant", False))
