"""Multi-head latent attention (DeepSeek-V2/V3): parameters, saved activations and FLOPs (what is
refused: specs.check_mla_job).

Source: transformers 5.24 ``models/deepseek_v3/modeling_deepseek_v3.py`` DeepseekV3Attention:
q is ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (h → q_lora_rank → heads·(nope + rope)), or
``q_proj(x)`` (h → heads·(nope + rope)) when q_lora_rank is None; ``kv_a_proj_with_mqa`` (h →
kv_lora_rank + rope) is split into the latent, normalised by ``kv_a_layernorm`` and expanded by
``kv_b_proj`` (kv_lora_rank → heads·(nope + v)), and the rope part, one head shared by all;
rotary on the rope parts of q and k; ``o_proj`` heads·v → h; no biases (attention_bias false).

Symbols: t tokens (b·s), a heads, Q q_lora_rank, R kv_lora_rank, dn qk_nope_head_dim, dr
qk_rope_head_dim, dv v_head_dim, dqk = dn + dr; c compute bytes, r residual-stream bytes.
"""

from __future__ import annotations

import math

from .saved import Saved, Shapes
from .specs import MLA_FIELDS as MLA_FIELDS  # the MLA sub-spec of a ModelSpec: its fields, their check
from .specs import ModelSpec, attention_tensors, qk_head_dim  # and its counts


def mla_matrices(model: ModelSpec) -> int:
    """The attention's weight matrices (what autocast caches a low-precision copy of)."""
    return sum(math.prod(t) for t in attention_tensors(model) if len(t) == 2)


def attention_flops_per_token(model: ModelSpec, seq_len: int) -> int:
    """Forward FLOPs per token per layer of q·kᵀ (a·dqk wide) and probs·v (a·dv wide)."""
    return 2 * model.num_heads * (qk_head_dim(model) + model.v_head_dim) * seq_len


def attention_math(model: ModelSpec, on_cpu: bool) -> bool:
    """CPU sdpa runs its math path when v's head dim differs from q/k's (the flash kernel takes one
    head dim; measured: q, k, v and the softmax kept in fp32 whatever the compute dtype)."""
    return on_cpu and qk_head_dim(model) != model.v_head_dim


def mla_saved(model: ModelSpec, x: Shapes) -> list[Saved]:
    """What one block's latent attention keeps for backward beyond the norms and the norm output
    (read off saved-tensor hooks on DeepseekV3DecoderLayer, tests/test_mla.py)."""
    t, a, c = x.tokens, x.a, x.c
    Q, R, dr, dv = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim, model.v_head_dim
    dqk = qk_head_dim(model)
    saved = []
    if Q:
        # q_a_layernorm (DeepseekV3RMSNorm): its fp32 input, rstd, the normalised input (weight·),
        # and its output, q_b_proj's input (under autocast: the output's cast for q_b_proj)
        saved += [
            Saved("q_a_layernorm: fp32 input", "4·b·s·Q", 4 * t * Q),
            Saved("q_a_layernorm: rstd", "4·b·s", 4 * t),
            Saved("q_a_layernorm: normalised, output (q_b_proj input)", "2·c·b·s·Q", 2 * c * t * Q),
        ]
    # kv_a_layernorm over the latent split off kv_a_proj_with_mqa's output: in fp32 its .to(fp32)
    # is the split view itself, which pins the whole (R + dr)-wide output; else an R-wide fp32 cast
    latent = R + dr if c == 4 else R
    saved += [
        Saved("kv_a_layernorm: fp32 input", "4·b·s·(R + dr)" if c == 4 else "4·b·s·R", 4 * t * latent),
        Saved("kv_a_layernorm: rstd", "4·b·s", 4 * t),
        Saved("kv_a_layernorm: normalised, output (kv_b_proj input)", "2·c·b·s·R", 2 * c * t * R),
    ]
    saved.append(Saved("attention output (o_proj input)", "c·b·s·a·dv", c * t * a * dv))
    if x.attention == "math-fp32":
        # the math path's bmm inputs: q, k per head, a contiguous copy of v; the softmax
        return saved + [
            Saved("q, k (every head), v (fp32)", "4·b·s·a·(2·dqk + dv)", 4 * t * a * (2 * dqk + dv)),
            Saved("softmax output (fp32)", "4·b·a·s²", 4 * t * a * x.s),
        ]
    # the fused kernel keeps q, k, its output and logsumexp, and v: a split view of kv_b_proj's
    # output, which pins all a·(dn + dv) of it (measured on CPU with dqk = dv)
    dn = model.qk_nope_head_dim
    return saved + [
        Saved("q, k (every head)", "c·b·s·a·2·dqk", c * t * a * 2 * dqk),
        Saved("kv_b_proj output (pinned by v)", "c·b·s·a·(dn + dv)", c * t * a * (dn + dv)),
        Saved("sdpa output", "c·b·s·a·dv", c * t * a * dv),
        Saved("sdpa logsumexp", "4·b·a·s", 4 * x.b * a * x.s),
    ]
