"""The four inputs of every estimate: what is trained, how, on what, and sharded how.

Keyword-only frozen dataclasses, validated once in ``__post_init__``; everything
downstream trusts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from operator import attrgetter
from typing import Any, TypeVar

from .errors import InputError, MemplanError
from .layout import Layout, check_layout
from .loop import AC_POLICIES, Loop, loss_in_model
from .settings import check_choice as _check_choice
from .settings import check_positive as _check_positive
from .strategies import STRATEGIES

ARCHS = ("llama", "gpt2", "neox", "vit", "bert")
ACTIVATIONS = ("silu", "gelu", "gelu_new")
PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "mixed-bf16", "mixed-fp16", "bf16")
OPTIMIZERS = (
    "adamw",
    "adam",
    "sgd",
    "sgd-momentum",
    "adam8bit",
    "adafactor",
    "torch-adafactor",
    "lion",
    "lion8bit",
    "paged-adamw8bit",
)
"""adafactor: transformers' Adafactor (the HF Trainer's optim="adafactor"); torch-adafactor:
torch.optim.Adafactor (torch >= 2.5); lion, lion8bit, adam8bit, paged-adamw8bit: bitsandbytes'
Lion, Lion8bit, AdamW8bit, PagedAdamW8bit (the HF Trainer's lion_32bit, lion_8bit, adamw_bnb_8bit,
paged_adamw_8bit)."""
OPTIMIZER_IMPLS = ("foreach", "fused", "single")
AC_MODES = ("none", "selective", "full")
"""The policies the recommendation searches; ``loop.AC_POLICIES`` adds torchtitan's op SAC."""
ATTENTIONS = ("sdpa", "eager")
DEVICES = ("cuda", "cpu")
OFFLOADS = ("none", "optimizer", "params", "all")
FSDP_WRAPS = ("blocks", "none")
"""FSDP's units: blocks, each decoder block its own unit and the root the rest (``fully_shard`` per
block, FSDP1's ``auto_wrap_policy`` of the decoder layer: every recipe's); none, no wrapping policy,
the whole model one unit (``FullyShardedDataParallel(model)`` alone, Lightning's ``FSDPStrategy()``
default, accelerate's FSDP1 ``NO_WRAP``)."""
ONE_UNIT_STRATEGIES = ("fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard")
"""The strategies whose one unit is measured (validation.lightning_loop): a root unit is never resharded
after forward (torch fsdp/_runtime_utils.py _post_forward_reshard), so the three hold the same."""
REDUCE_DTYPES = ("fp32", "bf16", "fp16")


def _square_grid_plus_one(n: int) -> bool:
    return n >= 2 and math.isqrt(n - 1) ** 2 == n - 1


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer (or a ViT or BERT-style encoder) described by its shapes.

    The family fixes the block's layout: ``llama`` (RMSNorm, SwiGLU, RoPE, GQA, no
    biases), ``gpt2`` (LayerNorm, GELU, learned positions, biases, dropout, tied head),
    ``neox`` (LayerNorm, GELU, rotary, parallel residual, biases, untied head),
    ``vit`` (LayerNorm, GELU, patch embedding, class token, classifier head),
    ``bert`` (BERT / RoBERTa: bidirectional attention, post-LayerNorm blocks, word + position
    + token type embeddings with a LayerNorm, GELU, biases; an MLM or a classification head).
    """

    name: str = "custom"
    arch: str = "llama"
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int = 0
    """0 means as many as ``num_heads`` (no GQA)."""
    head_dim: int = 0
    """One attention head's width; 0 means hidden // num_heads. Llama-family configs may set it
    apart (config.json ``head_dim``: Qwen3-0.6B's 16 heads of 128 over hidden 1024, Mistral-Nemo's
    32 of 128 under 5120): q_proj is hidden → heads·head_dim, k/v_proj hidden → kv_heads·head_dim,
    o_proj heads·head_dim → hidden (modeling_llama.py LlamaAttention). Kept 0 where it equals
    hidden // num_heads, so one model has one spec."""
    ffn_hidden: int
    vocab_size: int
    """Token vocabulary; for ``vit`` the number of classes of the head."""
    tied_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on q/k/v only (Qwen2); ``linear_bias`` implies it."""
    linear_bias: bool = False
    max_positions: int = 0
    """Learned position embeddings (gpt2); for ``vit`` the number of patches + 1."""
    dropout: float = 0.0
    """Dropout probability on attention probabilities and residual branches."""
    patch_size: int = 16
    image_channels: int = 3
    activation: str = ""
    """MLP activation: silu (SwiGLU), gelu (fused kernel) or gelu_new (HF GPT-2's tanh
    formula in Python, which saves three more ffn-wide tensors); "" means the family's."""
    qk_norm: bool = False
    """Qwen3's per-head RMSNorms on q and k before the rotary embedding (q_norm, k_norm of
    head_dim each: modeling_qwen3.py Qwen3Attention)."""
    fused_projections: bool = False
    """A llama block whose q/k/v and gate/up projections are one linear each (Phi-3's qkv_proj
    and gate_up_proj: modeling_phi3.py Phi3Attention, Phi3MLP): the same parameters, but one
    LoRA adapter per fused module."""
    # multi-head latent attention (DeepSeek-V2/V3; ``memplan.mla`` holds the formulas)
    q_lora_rank: int = 0
    """MLA's q down-projection rank (q_a_proj h → rank, q_a_layernorm, q_b_proj); 0: q_proj."""
    kv_lora_rank: int = 0
    """MLA's k/v latent width (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj); 0: not MLA."""
    qk_nope_head_dim: int = 0
    """MLA: a q/k head's width without rotary."""
    qk_rope_head_dim: int = 0
    """MLA: a q/k head's rotary width (k's rotary part one head shared by all)."""
    v_head_dim: int = 0
    """MLA: a v head's width (o_proj takes heads·v_head_dim)."""
    # mixture of experts (llama family only; ``memplan.moe`` holds the formulas)
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    experts_per_token: int = 0
    """Routed experts each token goes to (top-k)."""
    moe_ffn_hidden: int = 0
    """One routed expert's SwiGLU width; 0 means ``ffn_hidden``."""
    shared_ffn_hidden: int = 0
    """The always-on shared expert(s)' total SwiGLU width (DeepSeek: count × expert width); 0: none."""
    shared_expert_gate: bool = False
    """Qwen2-MoE's sigmoid gate on the shared expert (a linear h→1)."""
    first_dense_layers: int = 0
    """Leading dense layers (DeepSeek-V3's first_k_dense_replace)."""
    moe_every: int = 1
    """Layer i (0-based) is MoE when (i + 1) is a multiple of this (Qwen2/3-MoE's decoder_sparse_step)."""
    normalize_top_k: bool = True
    """The router renormalises the top-k weights (Mixtral always; Qwen-MoE's norm_topk_prob)."""
    top_k_weights_fp32: bool = True
    """The routing weights stay fp32 (Mixtral); Qwen2-MoE casts them to the compute dtype."""
    capacity_factor: float = 0.0
    """Each expert takes at most C·k·T/E tokens, padded to that (GShard, Switch); 0: dropless."""
    # encoders (bert family)
    type_vocab_size: int = 0
    """Token type embeddings (BERT 2, RoBERTa 1); bert only."""
    num_labels: int = 0
    """bert: 0 an MLM head over the vocabulary at every position (BertForMaskedLM,
    RobertaForMaskedLM); N a sequence classifier over N labels on the first token
    (BertForSequenceClassification's pooler + classifier, RoBERTa's classification head)."""

    def __post_init__(self):
        _check_choice(self.arch, ARCHS, "arch")
        if self.num_experts:
            check_moe(self)
        if not self.activation:
            default = {"llama": "silu", "gpt2": "gelu_new"}.get(self.arch, "gelu")
            object.__setattr__(self, "activation", default)
        _check_choice(self.activation, ACTIVATIONS, "activation")
        if (self.activation == "silu") != (self.arch == "llama"):
            raise MemplanError(
                f"activation {self.activation!r} does not fit arch {self.arch!r}: "
                "llama uses silu, the others gelu or gelu_new"
            )
        _check_positive(self, "num_layers", "hidden", "num_heads", "ffn_hidden", "vocab_size")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _check_positive(self, "num_kv_heads")
        if self.head_dim and not self.hidden % self.num_heads and self.head_dim == self.hidden // self.num_heads:
            object.__setattr__(self, "head_dim", 0)  # the default spelled out: one spec per model
        if self.head_dim:
            _check_positive(self, "head_dim")
            if self.arch != "llama":
                raise MemplanError(
                    f"head_dim {self.head_dim} apart from hidden/heads = {self.hidden}/{self.num_heads} is "
                    f"modelled for arch llama (q/k/v/o projections apart), not {self.arch!r}"
                )
        elif self.hidden % self.num_heads:
            raise MemplanError(
                f"hidden {self.hidden} is not divisible by heads {self.num_heads}; give head_dim for heads "
                "narrower or wider than hidden/heads"
            )
        if self.num_heads % self.num_kv_heads:
            raise MemplanError(
                lambda n: f"heads {self.num_heads} is not divisible by {n.word('kv_heads')} {self.num_kv_heads}"
            )
        check_mla(self)
        if self.arch == "vit" and not _square_grid_plus_one(self.max_positions):
            raise MemplanError(
                f"vit max_positions must be its patch count + 1 over a square patch grid "
                f"(197 = 14² + 1 for 224-pixel images in 16-pixel patches), got {self.max_positions}"
            )
        if self.arch == "bert" and (self.max_positions <= 0 or not self.linear_bias):
            raise MemplanError(
                f"bert needs its learned position count (max_positions, 512 for BERT) and linear biases, "
                f"got max_positions {self.max_positions}, linear_bias {self.linear_bias}"
            )
        encoder_fields = self.num_labels or self.type_vocab_size
        if self.num_labels < 0 or self.type_vocab_size < 0 or (self.arch != "bert" and encoder_fields):
            raise MemplanError(
                f"num_labels {self.num_labels} and type_vocab_size {self.type_vocab_size} apply to arch bert only "
                "and are ≥ 0"
            )
        if self.arch == "bert" and self.num_labels:  # a classifier has no decoder to tie
            object.__setattr__(self, "tied_embeddings", False)
        if not 0.0 <= self.dropout < 1.0:
            raise MemplanError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.fused_projections and (self.arch != "llama" or self.num_experts or self.kv_lora_rank):
            raise MemplanError("fused_projections (Phi-3's qkv_proj, gate_up_proj) apply to dense arch llama only")
        if self.num_layers > 10_000 or self.hidden > 1_000_000 or self.vocab_size > 10_000_000:
            raise MemplanError(
                f"model shape is absurd (layers {self.num_layers}, hidden {self.hidden}, "
                f"vocab {self.vocab_size}); layers ≤ 10000, hidden ≤ 1e6, vocab ≤ 1e7"
            )

    @property
    def head_size(self) -> int:
        """One head's width: ``head_dim``, or hidden // num_heads where it is 0."""
        return self.head_dim or self.hidden // self.num_heads

    @property
    def q_hidden(self) -> int:
        """The query (and attention output) width, heads·head_dim: ``hidden`` unless head_dim is set apart."""
        return self.num_heads * self.head_size

    @property
    def kv_hidden(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek): kv_lora_rank set."""
        return self.kv_lora_rank > 0

    @property
    def gated_mlp(self) -> bool:
        return self.arch == "llama"

    @property
    def norm_params(self) -> int:
        """One norm: RMSNorm has a weight, LayerNorm a weight and a bias."""
        return self.hidden if self.arch == "llama" else 2 * self.hidden

    def block_param_counts(self) -> dict[str, int]:
        """Parameters of one block, per projection (the FSDP unit of every strategy)."""
        h, q, kv, f = self.hidden, self.q_hidden, self.kv_hidden, self.ffn_hidden
        bias = self.linear_bias
        qkv_bias = bias or self.qkv_bias
        # q_proj h → q, k_proj and v_proj h → kv, o_proj q → h (modeling_llama.py LlamaAttention)
        counts = {
            "attn_qkv": h * (q + 2 * kv) + (q + 2 * kv) * qkv_bias,
            "attn_out": q * h + h * bias,
            "mlp_in": (2 if self.gated_mlp else 1) * h * f + f * bias * (2 if self.gated_mlp else 1),
            "mlp_out": f * h + h * bias,
            "norms": 2 * self.norm_params + (2 * self.head_size if self.qk_norm else 0),
        }
        if self.mla:  # DeepseekV3Attention's projections and latent norms (memplan.mla)
            mla = mla_block_param_counts(self)
            counts |= {"attn_qkv": mla["attn_qkv"], "attn_out": mla["attn_out"]}
            counts["norms"] += mla["norms"]
        return counts

    @lru_cache(maxsize=1024)  # noqa: B019 - frozen specs, asked for by every term of every estimate
    def block_params(self) -> int:
        """One block's parameters; an MoE model's largest block (a sparse one)."""
        if self.num_experts:
            return moe_block_params(self)
        return sum(self.block_param_counts().values())

    def blocks_params(self) -> int:
        """Every block's parameters (an MoE model mixes dense and sparse blocks)."""
        if self.num_experts:
            return moe_blocks_params(self)
        return self.num_layers * self.block_params()

    def embedding_params(self) -> int:
        """Input side: token (or patch) embedding plus learned positions / class token."""
        h = self.hidden
        if self.arch == "vit":
            patch = self.image_channels * self.patch_size**2 * h + h
            return patch + h + self.max_positions * h  # + class token
        if self.arch == "bert":  # BertEmbeddings: word, position, token type, LayerNorm
            return (self.vocab_size + self.max_positions + self.type_vocab_size) * h + self.norm_params
        return self.vocab_size * h + self.max_positions * h

    def head_params(self) -> int:
        """Output side: final norm plus the LM head (or classifier); 0 extra when tied."""
        h = self.hidden
        if self.arch == "vit":
            return self.norm_params + h * self.vocab_size + self.vocab_size
        if self.arch == "bert" and self.num_labels:
            # BertPooler dense h→h + classifier h→N (RobertaClassificationHead: dense + out_proj)
            return h * h + h + h * self.num_labels + self.num_labels
        if self.arch == "bert":
            # BertLMPredictionHead: transform dense h→h + LayerNorm; decoder tied to the word
            # embedding, its own bias over the vocabulary (RobertaLMHead: the same tensors)
            return h * h + h + self.norm_params + self.vocab_size + (0 if self.tied_embeddings else self.vocab_size * h)
        return self.norm_params + (0 if self.tied_embeddings else self.vocab_size * h)

    @property
    def num_params(self) -> int:
        return _num_params(self)

    def describe(self) -> str:
        gqa = f", kv-heads {self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        gqa += f", head-dim {self.head_dim}" if self.head_dim else ""
        if self.mla:  # DeepSeek's latent attention: q rank (0: q_proj), kv latent, q/k and v head widths
            gqa = f", MLA q-rank {self.q_lora_rank} kv-rank {self.kv_lora_rank} "
            gqa += f"qk {self.qk_nope_head_dim}+{self.qk_rope_head_dim} v {self.v_head_dim}"
        moe = f", {self.num_experts} experts top-{self.experts_per_token}" if self.num_experts else ""
        if self.arch == "bert":
            moe = f", {self.num_labels}-label classifier" if self.num_labels else ", MLM head"
        return (
            f"{self.name}: {self.arch}, {self.num_layers} layers, hidden {self.hidden}, "
            f"heads {self.num_heads}{gqa}, ffn {self.ffn_hidden}{moe}, vocab {self.vocab_size}"
            f"{', tied embeddings' if self.tied_embeddings else ''} "
            f"= {self.num_params / 1e9:.3f}B parameters"
        )


# --- the MoE sub-spec of a ModelSpec: its fields, their check and its parameter counts (``moe`` holds
# the terms; sources there) ---


MOE_FIELDS = (
    "num_experts",
    "experts_per_token",
    "moe_ffn_hidden",
    "shared_ffn_hidden",
    "shared_expert_gate",
    "first_dense_layers",
    "moe_every",
    "normalize_top_k",
    "top_k_weights_fp32",
    "capacity_factor",
)
"""The ModelSpec fields of the experts (a dense model leaves them at their defaults)."""


def check_moe(model: ModelSpec) -> None:
    """The MoE fields of a ModelSpec, checked once (``ModelSpec.__post_init__``)."""
    for name in ("num_experts", "experts_per_token", "moe_ffn_hidden", "shared_ffn_hidden", "first_dense_layers"):
        value = getattr(model, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MemplanError(f"{name} must be a non-negative integer, got {value!r}")
    if model.arch != "llama":
        raise MemplanError(f"experts are modelled for arch llama (SwiGLU experts), not {model.arch!r}")
    if not 1 <= model.experts_per_token <= model.num_experts:
        raise MemplanError(
            f"experts_per_token {model.experts_per_token} must be between 1 and num_experts {model.num_experts}"
        )
    C = model.capacity_factor
    if isinstance(C, bool) or not isinstance(C, (int, float)) or not 0 <= C <= model.num_experts:
        raise MemplanError(f"capacity_factor must be 0 (dropless) or a number up to num_experts, got {C!r}")
    if not isinstance(model.moe_every, int) or model.moe_every < 1:
        raise MemplanError(f"moe_every must be a positive integer, got {model.moe_every!r}")
    if model.shared_expert_gate and not model.shared_ffn_hidden:
        raise MemplanError("shared_expert_gate needs a shared expert: give shared_ffn_hidden")
    if num_moe_layers(model) == 0:
        raise MemplanError(
            f"no MoE layer: first_dense_layers {model.first_dense_layers} and moe_every {model.moe_every} "
            f"leave all {model.num_layers} layers dense"
        )


def is_moe_layer(model: ModelSpec, index: int) -> bool:
    """Whether layer ``index`` is sparse (every layer of a dense model counts as its own kind)."""
    # Qwen2/3-MoE: (layer_idx + 1) % decoder_sparse_step == 0; DeepSeek-V3: layer_idx >= first_k_dense_replace
    return not model.num_experts or (index >= model.first_dense_layers and (index + 1) % model.moe_every == 0)


def num_moe_layers(model: ModelSpec) -> int:
    return sum(is_moe_layer(model, i) for i in range(model.num_layers))


def expert_width(model: ModelSpec) -> int:
    return model.moe_ffn_hidden or model.ffn_hidden


def expert_params(model: ModelSpec) -> int:
    """One routed expert: gate_up_proj (2f × h) and down_proj (h × f), no biases."""
    return 3 * model.hidden * expert_width(model)


def moe_block_param_counts(model: ModelSpec) -> dict[str, int]:
    """One sparse block: attention and norms as the dense block's, the MLP replaced by the
    router (E × h, no bias), E experts and the shared expert (with Qwen2-MoE's h → 1 gate)."""
    h, E = model.hidden, model.num_experts
    dense = model.block_param_counts()
    return {
        "attn_qkv": dense["attn_qkv"],
        "attn_out": dense["attn_out"],
        "router": E * h,
        "experts": E * expert_params(model),
        "shared_expert": 3 * h * model.shared_ffn_hidden + h * model.shared_expert_gate,
        "norms": dense["norms"],
    }


def moe_block_params(model: ModelSpec) -> int:
    return sum(moe_block_param_counts(model).values())


def moe_blocks_params(model: ModelSpec) -> int:
    sparse = num_moe_layers(model)
    dense = sum(model.block_param_counts().values())
    return sparse * moe_block_params(model) + (model.num_layers - sparse) * dense


# --- the MLA sub-spec of a ModelSpec: its fields, their check and its parameter counts (``mla`` holds
# the terms; sources there) ---


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The ModelSpec fields of the latent attention (all 0: not MLA; q_lora_rank 0 alone: q_proj)."""


def check_mla(model: ModelSpec) -> None:
    """The MLA fields of a ModelSpec, checked once (``ModelSpec.__post_init__``)."""
    for name in MLA_FIELDS:
        value = getattr(model, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MemplanError(f"{name} must be a non-negative integer, got {value!r}")
    if not model.kv_lora_rank:
        if any(getattr(model, name) for name in MLA_FIELDS):
            raise MemplanError("MLA shapes need kv_lora_rank (0: not MLA): give kv_lora_rank or none of them")
        return
    missing = [n for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if not getattr(model, n)]
    if missing:
        raise MemplanError(f"MLA (kv_lora_rank {model.kv_lora_rank}) needs positive {', '.join(missing)}")
    if model.qk_rope_head_dim % 2:
        raise MemplanError(f"qk_rope_head_dim must be even (rotary pairs), got {model.qk_rope_head_dim}")
    if model.arch != "llama" or model.head_dim or model.qk_norm or model.qkv_bias or model.linear_bias:
        raise MemplanError(
            "MLA is modelled for arch llama without head_dim, qk_norm or biases (DeepSeek's attention_bias false)"
        )
    if model.num_kv_heads != model.num_heads:
        raise MemplanError(
            f"MLA expands k and v for every head: num_kv_heads {model.num_kv_heads} must equal heads {model.num_heads}"
        )


def qk_head_dim(model: ModelSpec) -> int:
    return model.qk_nope_head_dim + model.qk_rope_head_dim


def attention_tensors(model: ModelSpec) -> list[tuple[int, ...]]:
    """The attention's parameter tensors in DeepseekV3Attention's registration order: q_proj, or
    q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj."""
    h, a, Q, R = model.hidden, model.num_heads, model.q_lora_rank, model.kv_lora_rank
    dqk, dr, dn, dv = qk_head_dim(model), model.qk_rope_head_dim, model.qk_nope_head_dim, model.v_head_dim
    q = [(a * dqk, h)] if not Q else [(Q, h), (Q,), (a * dqk, Q)]
    return q + [(R + dr, h), (R,), (a * (dn + dv), R), (h, a * dv)]


def mla_block_param_counts(model: ModelSpec) -> dict[str, int]:
    """The attention's share of ``ModelSpec.block_param_counts``: every projection but o_proj as
    attn_qkv, o_proj as attn_out, the two latent norms with the block's norms."""
    tensors = attention_tensors(model)
    norms = sum(t[0] for t in tensors if len(t) == 1)
    o_proj = math.prod(tensors[-1])
    return {"attn_qkv": sum(math.prod(t) for t in tensors if len(t) == 2) - o_proj, "attn_out": o_proj, "norms": norms}


@lru_cache(maxsize=256)
def _loop(values: tuple[Any, ...]) -> Loop:
    """A step's ``loop.Loop`` by its settings' values in ``_LOOP_FIELDS``' order, built once per
    distinct loop (the step's hot path reads it)."""
    return Loop(**{name: value for (name, _), value in zip(_LOOP_FIELDS, values)})


_LOOP_AS = {"ac": "activation_checkpointing"}
"""The TrainSpec field of a Loop setting where the names differ (the rest share theirs)."""
_LOOP_FIELDS = tuple((f.name, _LOOP_AS.get(f.name, f.name)) for f in fields(Loop))
"""(Loop setting, TrainSpec field) of every Loop field."""
_loop_values = attrgetter(*(attr for _, attr in _LOOP_FIELDS))
"""A TrainSpec's values of ``_LOOP_FIELDS``, as a tuple in their order."""


@lru_cache(maxsize=1024)
def _num_params(model: ModelSpec) -> int:
    return model.embedding_params() + model.blocks_params() + model.head_params()


# --- what is trained: the fine-tuning fields of a TrainSpec, checked (``finetune`` holds the terms) ---

MODES = ("full", "lora", "qlora", "frozen:N")
TARGET_SETS = ("attention", "all-linear")
"""``attention``: every projection of the attention (q, k, v, o); ``all-linear``: every linear
layer of the blocks (peft's ``all-linear``, which leaves the output head out)."""


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """What one step trains (validated when built by ``tuning``)."""

    mode: str
    """full | lora | qlora | frozen."""
    frozen_blocks: int = 0
    """frozen:N: the first N blocks (and the input embedding) get no gradient."""
    rank: int = 8
    alpha: float = 16.0
    """LoRA's scaling numerator: it scales the adapter's output and changes no memory."""
    targets: tuple[str, ...] = ()
    """The block projections that carry an adapter (``LINEARS``' names)."""
    dropout: float = 0.0
    double_quant: bool = True
    """qlora: bitsandbytes' double quantization of the 4-bit blocks' absmax statistics
    (``BitsAndBytesConfig(bnb_4bit_use_double_quant=...)``, Params4bit's compress_statistics)."""
    dora: bool = False
    """peft's DoRA (``LoraConfig(use_dora=True)``): a trained magnitude vector per adapted linear,
    which rescales its base and LoRA outputs (``finetune.dora_saved``)."""

    @property
    def adapters(self) -> bool:
        return self.mode in ("lora", "qlora")

    def describe(self) -> str:
        if self.mode == "frozen":
            return f"frozen:{self.frozen_blocks} (input embedding and first {self.frozen_blocks} blocks frozen)"
        if not self.adapters:
            return "full"
        drop = f", dropout {self.dropout:g}" if self.dropout else ""
        dora = ", DoRA" if self.dora else ""
        return f"{self.mode} rank {self.rank} on {','.join(self.targets)}{drop}{dora}"


LINEARS = {
    "llama": ("q", "k", "v", "o", "gate", "up", "down"),
    "phi3": ("o", "qkv", "gate_up", "down"),  # Phi3Attention registers o_proj first
    "gpt2": ("qkv", "o", "up", "down"),
    "neox": ("qkv", "o", "up", "down"),
    "vit": ("q", "k", "v", "o", "up", "down"),
    "bert": ("q", "k", "v", "o", "up", "down"),
}
"""The linear layers of one block per family, by the names ``--lora-targets`` takes (``phi3``: a
llama block with fused projections, ``ModelSpec.fused_projections``)."""
ATTENTION = ("q", "k", "v", "qkv", "o")
MODULES = {"gpt2": {"c_attn": ("qkv",), "c_proj": ("o", "down"), "c_fc": ("up",)}}
"""transformers' module names that are not ``LINEARS``' name + ``_proj``, and the linears each
names (modeling_gpt2.py: GPT2Attention c_attn, c_proj; GPT2MLP c_fc, c_proj)."""


def _bad_tuning(field: str, value, accepted: str) -> InputError:
    return InputError(
        lambda n: f"{n.word(field)} {value!r} is not accepted; give {accepted}",
        field=field,
        value=value,
        accepted=accepted,
    )


def _targets(value: str) -> tuple[str, ...]:
    """The names a target list gives (``q,v``; peft's ``q_proj`` style, and the module names of
    ``MODULES`` such as GPT-2's ``c_attn``, too)."""
    if value in TARGET_SETS:
        return (value,)
    modules = {n for names in MODULES.values() for n in names}
    given = (n.strip() for n in value.split(",") if n.strip())
    names = tuple(dict.fromkeys(n if n in modules else n.removesuffix("_proj") for n in given))
    known = {n for names in LINEARS.values() for n in names} | modules
    if not names or any(n not in known for n in names):
        raise _bad_tuning("lora_targets", value, f"attention, all-linear or a list of {', '.join(sorted(known))}")
    return names


@lru_cache(maxsize=256)
def tuning(
    mode: str, rank: int, alpha: float, targets: str, dropout: float, dora: bool = False, double_quant: bool = True
) -> Tuning:
    """The ``Tuning`` of TrainSpec's fine-tuning fields, checked."""
    if dora and mode != "lora":
        raise InputError(
            lambda n: (
                f"{n('dora')} applies to {n('finetune')} lora only (peft's DoRA is measured on "
                f"unquantized linears), got {n('finetune')} {mode}"
            ),
            field="dora",
            value=dora,
            accepted="finetune lora",
        )
    if mode.startswith("frozen:"):
        count = mode.removeprefix("frozen:")
        if not count.isdigit() or int(count) < 1:
            raise _bad_tuning("finetune", mode, "full, lora, qlora or frozen:N with N ≥ 1 blocks")
        return Tuning(mode="frozen", frozen_blocks=int(count))
    if mode not in MODES[:3]:
        raise _bad_tuning("finetune", mode, "full, lora, qlora or frozen:N")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad_tuning("lora_rank", rank, "a positive integer")
    if not 0.0 <= dropout < 1.0:
        raise _bad_tuning("lora_dropout", dropout, "a probability in [0, 1)")
    if not double_quant and mode != "qlora":
        raise _bad_tuning("qlora_double_quant", double_quant, "true unless finetune is qlora (4-bit base weights)")
    return Tuning(
        mode=mode,
        rank=rank,
        alpha=float(alpha),
        targets=_targets(targets),
        dropout=float(dropout),
        dora=bool(dora),
        double_quant=bool(double_quant),
    )


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """One optimizer step: micro-batches, precision, optimizer and memory-saving switches."""

    seq_len: int = 2048
    """Tokens per sample; a ViT's are fixed by its image size (``Job`` sets them)."""
    micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "mixed-bf16"
    reduce_dtype: str | None = None
    """Gradient reduction dtype; None means the policy's default (its compute dtype)."""
    optimizer: str = "adamw"
    optimizer_impl: str | None = None
    """foreach | fused | single; None means torch's default on the device."""
    activation_checkpointing: str = Loop.ac
    """none | selective | op | full (``loop.Loop.ac``)."""
    attention: str = "sdpa"
    device: str = "cuda"
    # the training loop's conventions (``loop.Loop``, whose docstrings say what each does)
    logits: str = Loop.logits
    loss: str = Loop.loss
    loss_chunks: int = Loop.loss_chunks
    ac_every: int = Loop.ac_every
    compile: bool = Loop.compile
    float8: bool = Loop.float8
    offload_activations: bool = Loop.offload_activations
    optimizer_in_backward: bool = Loop.optimizer_in_backward
    zero_grad: str = Loop.zero_grad
    recipe: str = Loop.recipe
    """The recipe the loop's conventions were resolved from (``loop.resolve``)."""
    kv_copies: bool | None = None
    """Whether the model's attention copies k and v to every query head before attention;
    None: as the recipe's model does (``loop.kv_copies``: torchtune's)."""
    use_cache: bool = False
    """Hugging Face's ``use_cache=True`` (its configs' default) in a loop whose outputs are held
    (logits held): the outputs also hold the DynamicCache, every layer's keys and values."""
    # what is trained (``Tuning``, whose docstrings say what each does)
    finetune: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: str = "attention"
    lora_dropout: float = 0.0
    dora: bool = False
    qlora_double_quant: bool = True

    def __post_init__(self):
        _check_positive(self, "seq_len", "micro_batch", "grad_accum")
        _check_choice(self.precision, PRECISIONS, "precision")
        _check_choice(self.optimizer, OPTIMIZERS, "optimizer")
        _check_choice(self.activation_checkpointing, AC_POLICIES, "activation checkpointing")
        self.loop  # noqa: B018 -- the loop's conventions checked
        self.tuning  # noqa: B018 -- the fine-tuning mode checked
        _check_use_cache(self)
        _check_choice(self.attention, ATTENTIONS, "attention")
        if self.kv_copies not in (None, True, False):
            raise MemplanError(f"kv_copies must be true, false or unset, got {self.kv_copies!r}")
        _check_choice(self.device, DEVICES, "device")
        if self.reduce_dtype is not None:
            _check_choice(self.reduce_dtype, REDUCE_DTYPES, "reduce dtype")
        if self.optimizer_impl is None:
            # torch picks foreach only when every tensor is on an accelerator
            # (torch/optim/optimizer.py: _default_to_fused_or_foreach); on CPU a for-loop.
            object.__setattr__(self, "optimizer_impl", "foreach" if self.device == "cuda" else "single")
        _check_choice(self.optimizer_impl, OPTIMIZER_IMPLS, "optimizer implementation")
        if self.seq_len > 10_000_000 or self.micro_batch > 1_000_000:
            raise MemplanError(
                lambda n: (
                    f"{n.word('seq_len')} {self.seq_len} or {n.word('micro_batch')} "
                    f"{self.micro_batch} is absurd; {n.word('seq_len')} ≤ 1e7, {n.word('micro_batch')} ≤ 1e6"
                )
            )

    @property
    def loop(self):
        """The training loop's conventions as a ``loop.Loop``."""
        return _loop(_loop_values(self))

    def with_ac(self, policy: str, **changes) -> TrainSpec:
        """A copy under AC ``policy`` (and ``changes``): the every-N-th-block setting kept for a
        policy, reset to every block for none (which checkpoints no block at all), so a search
        over policies never builds AC none with the user's ac-every."""
        every = self.ac_every if policy != "none" else 1
        return replace(self, activation_checkpointing=policy, ac_every=every, **changes)

    @property
    def tuning(self) -> Tuning:
        """What is trained, as a ``Tuning``."""
        return tuning(
            self.finetune,
            self.lora_rank,
            self.lora_alpha,
            self.lora_targets,
            self.lora_dropout,
            dora=self.dora,
            double_quant=self.qlora_double_quant,
        )

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch


def _check_use_cache(train: TrainSpec) -> None:
    """use_cache means something where a Hugging Face model's outputs outlive the step: logits held
    under a recipe whose model is a transformers one (recipes.csv loss_in_model)."""
    if not isinstance(train.use_cache, bool):
        raise InputError(
            lambda n: f"{n.word('use_cache')} must be true or false, got {train.use_cache!r}",
            field="use_cache",
            value=train.use_cache,
            accepted="true or false",
        )
    if not train.use_cache:
        return
    if train.logits != "held":
        field, value = "logits", train.logits
    elif not loss_in_model(train.recipe):
        field, value = "recipe", train.recipe
    else:
        return
    raise InputError(
        lambda n: (
            f"{n('use_cache')} applies to {n('logits')} held under a Hugging Face recipe (plain, hf-trainer, "
            f"accelerate: the held outputs keep the KV cache), got {n(field)} {value}"
        ),
        field="use_cache",
        value=True,
        accepted="logits held, recipe plain, hf-trainer or accelerate",
    )


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The GPUs: how many, how they are grouped into nodes, and how much memory each has."""

    gpus: int = 1
    gpus_per_node: int = 0
    """0 means min(gpus, 8)."""
    gpu_mem_bytes: int = 80 * 2**30
    gpu_name: str = "custom"
    headroom: float = 0.05
    """Fraction of each GPU's memory kept free."""
    alloc_conf: str = ""
    """The ``PYTORCH_CUDA_ALLOC_CONF`` the job runs with: what the allocator's replay follows."""

    def __post_init__(self):
        _check_positive(self, "gpus", "gpu_mem_bytes")
        if self.gpus > 1_000_000:
            raise MemplanError(f"gpus must be at most 1000000, got {self.gpus}")
        if self.gpus_per_node == 0:
            object.__setattr__(self, "gpus_per_node", min(self.gpus, 8))
        _check_positive(self, "gpus_per_node")
        if self.gpus % self.gpus_per_node:
            raise MemplanError(
                lambda n: f"gpus {self.gpus} is not a multiple of {n.word('gpus_per_node')} {self.gpus_per_node}"
            )
        if not (isinstance(self.headroom, (int, float)) and 0.0 <= self.headroom < 1.0) or math.isnan(self.headroom):
            raise MemplanError(f"headroom must be a fraction in [0, 1), got {self.headroom!r}")

    @property
    def num_nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_mem_bytes * (1.0 - self.headroom))


AUTO = "auto"
"""Hugging Face's DeepSpeed placeholder: the Trainer fills it from the model (``ZeroConfig``)."""


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The memory-relevant keys of a DeepSpeed ``zero_optimization`` section (deepspeed/runtime/zero/
    config.py DeepSpeedZeroConfig), in elements. The defaults are the config ``--emit deepspeed``
    writes (tables/deepspeed.csv, ``overlap_comm`` on); ``memplan.frameworks.dsconfig`` reads a
    user's file, DeepSpeed's own defaults where it is silent. ``"auto"`` (Hugging Face's
    placeholder) resolves from the model as the Trainer resolves it (``resolved``)."""

    reduce_bucket_size: int | str = 500_000_000
    """Elements of each gradient reduce (ipg) bucket; ``"auto"``: hidden²."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO-1/2's parameter all-gather chunk after the step (measured: allocates nothing of its own)."""
    overlap_comm: bool = True
    """ZeRO-1/2: a second reduce bucket (double buffering); DeepSpeed's default: on for stage 3 only."""
    contiguous_gradients: bool = True
    """Gradients copied into the reduce buckets as they are produced (the buckets exist only with it)."""
    stage3_prefetch_bucket_size: int | str = 50_000_000
    """ZeRO-3: parameters gathered ahead of use; ``"auto"``: 0.9·hidden²."""
    stage3_param_persistence_threshold: int | str = 100_000
    """ZeRO-3: a tensor of at most this many elements stays gathered; ``"auto"``: 10·hidden."""

    def __post_init__(self):
        for name in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            value = getattr(self, name)
            if value != AUTO and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise MemplanError(f"zero_optimization.{name} {value!r} is not a count of elements or 'auto'")
        value = self.allgather_bucket_size
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MemplanError(f"zero_optimization.allgather_bucket_size {value!r} is not a positive count of elements")

    def resolved(self, hidden: int) -> ZeroConfig:
        """The ``"auto"`` values filled as Hugging Face's Trainer fills them from the model's
        hidden size (transformers/integrations/deepspeed.py trainer_config_finalize)."""
        auto: dict[str, Any] = {
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        }
        return replace(self, **{k: v for k, v in auto.items() if getattr(self, k) == AUTO})


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How the step is distributed: a strategy id and what is offloaded to host RAM."""

    strategy: str = "fsdp-full-shard"
    offload: str = "none"
    ep: int = 1
    """Expert-parallel degree (experts sharded over ep ranks); moves into the Layout at merge."""
    zero: ZeroConfig | None = None
    """A DeepSpeed strategy's ``zero_optimization`` settings; None: those ``--emit deepspeed`` writes."""
    # DistributedDataParallel's keywords (torch/nn/parallel/distributed.py), a ddp strategy's own
    gradient_as_bucket_view: bool = False
    """DDP: each gradient is a view into its all-reduce bucket, not a second copy."""
    bucket_cap_mb: float | None = None
    """DDP: the all-reduce buckets' size in MiB; None: DDP's 25 (the first bucket 1)."""
    static_graph: bool = False
    """DDP: the graph declared the same every step."""
    reshard_after_forward: int | None = None
    """FSDP2 full shard, ``fully_shard(reshard_after_forward=N)`` with N an integer: each unit
    resharded after forward to a group of N ranks (its post-forward copy, 1/N of the unit, kept
    until its backward gathers from it); None: full shard's own (all the shard group's ranks).
    In every plan, as DDP's keywords; read by full shard's adapter alone."""
    fsdp_wrap: str = "blocks"
    """FSDP's units (``FSDP_WRAPS``): blocks, or none (the whole model one FSDP1 unit). In every plan,
    as DDP's keywords; read by the sharded FSDP strategies' adapter alone (``ONE_UNIT_STRATEGIES``)."""

    def __post_init__(self):
        if isinstance(self.zero, dict):  # a record's spec (dataclasses.asdict)
            object.__setattr__(self, "zero", ZeroConfig(**self.zero))
        _check_positive(self, "ep")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise InputError(
                lambda n: f"{n('bucket_cap_mb')} must be a positive number of MiB, got {cap!r}",
                field="bucket_cap_mb",
                value=cap,
                accepted="a positive number of MiB",
            )

        group = self.reshard_after_forward
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 2):
            raise InputError(
                lambda n: (
                    f"{n('reshard_after_forward')} must be an integer of at least 2 (the ranks a unit reshards to "
                    f"after forward; 1 keeps it unsharded: strategy fsdp-shard-grad-op), got {group!r}"
                ),
                field="reshard_after_forward",
                value=group,
                accepted="an integer ≥ 2 dividing the FSDP shard group",
            )
        _check_choice(self.strategy, tuple(STRATEGIES), "strategy")
        _check_choice(self.offload, OFFLOADS, "offload")
        _check_choice(self.fsdp_wrap, FSDP_WRAPS, "fsdp_wrap")
        if self.offload != "none" and not STRATEGIES[self.strategy].supports_offload(self.offload):
            raise MemplanError(
                f"offload {self.offload!r} is not available with {self.strategy}; "
                f"it needs {STRATEGIES[self.strategy].offload_hint()}"
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keywords given to ``DistributedDataParallel`` beyond its defaults (the harness passes
        them as they are, calibrate/wrappers.py; another strategy's adapter reads none of them)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in DDP_KEYWORDS and getattr(self, f.name) != f.default
        }


DDP_KEYWORDS = ("gradient_as_bucket_view", "bucket_cap_mb", "static_graph")
"""The ``Plan`` fields that are DistributedDataParallel's keywords of the same names."""


def _vit_train(model: ModelSpec, train: TrainSpec) -> TrainSpec:
    """A ViT sees every patch plus the class token (ViTEmbeddings), whatever seq-len says: the
    default seq-len becomes that count; any other value is refused rather than ignored."""
    tokens = model.max_positions
    if train.seq_len == tokens:
        return train
    if train.seq_len != TrainSpec.__dataclass_fields__["seq_len"].default:
        raise MemplanError(
            f"seq-len {train.seq_len} does not apply to {model.name} (vit): its sequence is fixed by "
            f"the image size at {tokens} tokens ({tokens - 1} patches + the class token); leave seq-len "
            f"at its default or give {tokens}"
        )
    return replace(train, seq_len=tokens)


MLA_ACCEPTED = (
    "MLA is modelled for full fine-tunes in fp32, bf16, mixed-bf16 or amp-bf16 with sdpa, without AC or with "
    "full AC, on data-parallel strategies (measured: single, DDP, FSDP2, EP under FSDP2), not under TP / CP / PP, "
    "compile or op SAC"
)


def check_mla_job(job: Job) -> None:
    """What an MLA estimate is measured for (validation/records/mla_matrix_cpu.md); anything else refused."""
    model, train = job.model, job.train
    if not model.kv_lora_rank:
        return
    reason = ""
    if not job.layout.is_data_parallel:
        reason = f"layout tp {job.layout.tp} cp {job.layout.cp} pp {job.layout.pp}"
    elif train.precision not in ("fp32", "bf16", "mixed-bf16", "amp-bf16"):
        reason = f"precision {train.precision}"
    elif train.attention != "sdpa":
        reason = f"attention {train.attention}"
    elif train.activation_checkpointing not in ("none", "full"):
        reason = f"activation checkpointing {train.activation_checkpointing}"
    elif train.compile:
        reason = "compile"
    elif train.tuning.adapters or train.finetune != "full":
        reason = f"finetune {train.finetune}"
    elif train.kv_copies:
        reason = "kv copies (torchtune's attention)"
    if reason:
        raise MemplanError(f"{model.name}: multi-head latent attention under {reason} is not modelled; {MLA_ACCEPTED}")


def _check_reshard_group(job: Job) -> None:
    """FSDP2's integer ``reshard_after_forward`` where it was measured: a factor of the shard
    group (torch 2.13 _fsdp_init.py _get_post_forward_mesh_info), plain data parallel (its
    post-forward reshard refuses DTensor parameters, to_sharded_post_forward: no TP), parameters
    on the GPU."""
    group, dp = job.plan.reshard_after_forward, job.dp
    problem = (
        f"it must divide the {dp} ranks full shard shards over"
        if group is None or dp % group
        else "torch reshards DTensor (tensor-parallel) parameters to the whole group only"
        if job.layout.tp > 1
        else "it is not measured beside context or pipeline parallel"
        if not job.layout.is_data_parallel
        else "it is not measured with offloaded parameters"
        if job.plan.offload in ("params", "all")
        else ""
    )
    if problem:
        raise InputError(
            lambda n: f"{n('reshard_after_forward')} {group}: {problem}",
            field="reshard_after_forward",
            value=group,
            accepted=f"a factor of {dp} (≥ 2) on plain data parallel",
        )


def _check_one_unit(job: Job) -> None:
    """The whole model as one FSDP unit where it was measured (validation.lightning_loop: Lightning's
    FSDPStrategy() on a dense decoder, full training, one micro-batch, plain data parallel, states
    on the GPU)."""
    train, model = job.train, job.model
    problem = (
        "it is not measured beside tensor, context or pipeline parallel"
        if not job.layout.is_data_parallel
        else f"it is not measured with offload {job.plan.offload}"
        if job.plan.offload != "none"
        else "the root unit is not resharded after forward: no reshard-after-forward group"
        if job.plan.reshard_after_forward is not None
        else f"it is not measured with finetune {train.finetune}"
        if train.finetune != "full"
        else f"it is not measured with grad-accum {train.grad_accum}"
        if train.grad_accum > 1
        else "it is not measured with optimizer-in-backward"
        if train.optimizer_in_backward
        else f"it is not measured for {model.name} ({model.arch}{', MoE' if model.num_experts else ''})"
        if model.num_experts or model.arch in ("bert", "vit")
        else ""
    )
    if problem:
        raise InputError(
            lambda n: f"{n('fsdp_wrap')} none (the whole model one FSDP unit): {problem}",
            field="fsdp_wrap",
            value="none",
            accepted="none on plain data parallel for a dense decoder's full training, one micro-batch, no offload",
        )


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything one estimate needs."""

    model: ModelSpec
    train: TrainSpec = field(default_factory=TrainSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    plan: Plan = field(default_factory=Plan)
    layout: Layout = field(default_factory=Layout)
    """The mesh beyond data parallel (tp, cp, pp, ep); the plan's strategy runs over dp."""

    def __hash__(self) -> int:
        # every cache of the estimate is keyed by the job: its hash (that of its five parts, each
        # of every field) is computed once and kept in the instance's dict (left out of a pickle:
        # another process hashes strings with another seed)
        found = self.__dict__.get("_hash")
        if found is None:
            found = self.__dict__["_hash"] = hash((self.model, self.train, self.cluster, self.plan, self.layout))
        return found

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self):
        if self.model.arch == "vit":
            object.__setattr__(self, "train", _vit_train(self.model, self.train))
        if self.model.arch in ("bert", "gpt2") and 0 < self.model.max_positions < self.train.seq_len:
            raise InputError(
                lambda n: (
                    f"{n.word('seq_len')} {self.train.seq_len} exceeds {self.model.name}'s "
                    f"{self.model.max_positions} learned positions; give {n('seq_len')} ≤ {self.model.max_positions}"
                ),
                field="seq_len",
                value=self.train.seq_len,
                accepted=f"at most {self.model.max_positions}",
            )
        if not self.layout.is_data_parallel:
            m = self.model
            check_layout(
                self.layout,
                gpus=self.cluster.gpus,
                heads=m.num_heads,
                kv_heads=m.num_kv_heads,
                ffn=m.ffn_hidden,
                vocab=m.vocab_size,
                layers=m.num_layers,
                seq_len=self.train.seq_len,
            )
        if self.model.mla:
            check_mla_job(self)
        if self.plan.reshard_after_forward is not None and self.plan.strategy == "fsdp-full-shard":
            _check_reshard_group(self)
        if self.plan.fsdp_wrap == "none" and self.plan.strategy in ONE_UNIT_STRATEGIES:
            _check_one_unit(self)
        strategy = STRATEGIES[self.plan.strategy]
        if not strategy.allows_gpus(self.dp):
            raise MemplanError(
                f"strategy {strategy.id!r} ({strategy.label}) runs on at most {strategy.max_gpus} "
                f"GPU, got {'gpus' if self.layout.is_data_parallel else 'dp'}={self.dp}; use ddp or a sharded strategy"
            )

    @property
    def dp(self) -> int:
        """GPUs the plan's strategy shards or replicates over: all of them without a layout."""
        return self.layout.dp(self.cluster.gpus)

    @property
    def one_fsdp_unit(self) -> bool:
        """Whether the whole model is one FSDP unit (``Plan.fsdp_wrap`` none under a sharded FSDP strategy)."""
        return self.plan.fsdp_wrap == "none" and self.plan.strategy in ONE_UNIT_STRATEGIES

    @property
    def post_forward_group(self) -> int | None:
        """The ranks FSDP2 full shard reshards a unit to after forward where the plan gives fewer
        than it shards over (``fully_shard(reshard_after_forward=N)``); None: full shard's own."""
        group = self.plan.reshard_after_forward
        return group if self.plan.strategy == "fsdp-full-shard" and group and group < self.dp else None

    def with_(self, **changes) -> Job:
        """Copy with fields of the nested specs changed by name, e.g. ``with_(gpus=16, micro_batch=2)``."""
        if changes.keys() == {"micro_batch"}:
            return self._with_micro_batch(changes["micro_batch"])
        unknown = next((key for key in changes if key not in _PART_OF), None)
        if unknown is not None:
            raise MemplanError(f"unknown setting {unknown!r}")
        if changes.get("activation_checkpointing") == "none" and "ac_every" not in changes:
            changes = {**changes, "ac_every": 1}  # as TrainSpec.with_ac: no block checkpointed
        # every change applied before any check: a part is validated with all of its changes
        return Job(
            model=_changed(self.model, changes),
            train=_changed(self.train, changes),
            cluster=_changed(self.cluster, changes),
            plan=_changed(self.plan, changes),
            layout=_changed(self.layout, changes),
        )

    def _with_micro_batch(self, micro_batch) -> Job:
        """``with_(micro_batch=...)`` of a job already checked: only the micro-batch's own checks
        run again (no other check of a job reads it), the rest is copied as it is."""
        if type(micro_batch) is not int or not 0 < micro_batch <= 1_000_000 or self.model.arch == "vit":
            return Job(
                model=self.model,
                train=replace(self.train, micro_batch=micro_batch),
                cluster=self.cluster,
                plan=self.plan,
                layout=self.layout,
            )
        train = object.__new__(TrainSpec)
        train.__dict__.update(self.train.__dict__, micro_batch=micro_batch)
        job = object.__new__(Job)
        job.__dict__.update(self.__getstate__(), train=train)
        return job


_Part = TypeVar("_Part", ModelSpec, TrainSpec, ClusterSpec, Plan, Layout)


def _fields_of(part) -> dict:
    return part.__dataclass_fields__


def _changed(part: _Part, changes: dict) -> _Part:
    own = _fields_of(part)
    mine = {key: value for key, value in changes.items() if key in own}
    return replace(part, **mine) if mine else part


# every setting ``Job.with_`` accepts, by name
_PART_OF = frozenset(name for part in (ModelSpec, TrainSpec, ClusterSpec, Plan, Layout) for name in _fields_of(part))
