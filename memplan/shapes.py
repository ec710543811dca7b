"""A job's symbols (``Shapes``: b, s, h, …, the attention path the step takes), which every
producer of saved tensors reads."""

from __future__ import annotations

from functools import lru_cache

from .loop import kv_copies
from .mla import attention_math
from .precision import POLICIES
from .saved import Shapes
from .specs import ModelSpec, TrainSpec


@lru_cache(maxsize=4096)  # every term of every moment asks; specs are frozen
def shapes(model: ModelSpec, train: TrainSpec) -> Shapes:
    policy = POLICIES[train.precision]
    on_cpu = train.device == "cpu"
    attention = train.attention
    c = policy.compute_bytes
    if attention == "sdpa":
        math = model.dropout > 0 or (model.mla and attention_math(model, on_cpu))
        attention = "math-fp32" if (on_cpu and math) or _cuda_math(model, train, c) else "flash"
    # ViTEmbeddings: one token per patch plus the class token, whatever seq-len says
    s = model.max_positions if model.arch == "vit" else train.seq_len
    return Shapes(
        b=train.micro_batch,
        s=s,
        h=model.hidden,
        q=model.q_hidden,
        kv=model.kv_hidden,
        a=model.num_heads,
        d=model.qk_rope_head_dim or model.head_size,  # MLA: rotary over the rope part alone
        f=model.ffn_hidden,
        V=model.vocab_size,
        c=c,
        r=policy.stream_bytes,
        m=c if on_cpu else 1,
        p=model.dropout,
        autocast=policy.autocast,
        attention=attention,
        kv_saved=model.q_hidden if attention != "flash" or copied_kv(train) else model.kv_hidden,
    )


def _cuda_math(model: ModelSpec, train: TrainSpec, compute_bytes: int) -> bool:
    """fp32 grouped-query sdpa on CUDA runs the math backend: flash takes no fp32 and the
    memory-efficient kernel refuses ``enable_gqa`` ("No available kernel"), measured on an H200
    with torch 2.11 (validation/records/gpu_campaign_h200.md, item 4); where the recipe's model copies k and v
    to every query head first, the efficient kernel takes them."""
    grouped = model.kv_hidden < model.q_hidden and not model.mla and not copied_kv(train)
    return train.device != "cpu" and compute_bytes == 4 and grouped


def copied_kv(train: TrainSpec) -> bool:
    """The step's k/v copies: as given, or as the recipe's model makes them (``loop.kv_copies``)."""
    return kv_copies(train.recipe) if train.kv_copies is None else train.kv_copies
