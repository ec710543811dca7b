"""Tensor (+ sequence) parallel, per rank: which parameters and which saved tensors a TP rank
holds a 1/tp slice of.

The plan is torchtitan's (torchtitan/models/llama3/parallelize.py, ``apply_tp``):
ColwiseParallel on wq, wk, wv, w1, w3 (their outputs sharded over heads / the MLP width),
RowwiseParallel on wo, w2 (inputs sharded, output reduce-scattered over the sequence under SP),
SequenceParallel on the norms (replicated weights, activations sharded over the sequence),
the token embedding RowwiseParallel over the vocabulary, the head ColwiseParallel with its
output kept sharded over the vocabulary for loss parallel (``loss_parallel``). What autograd
saves is ``activations.block_saved``'s list; each entry is sharded one of three ways below.
PyTorch's TP tutorial's plans (``layout.TP_PLANS``) shard the blocks alike and differ outside
them: the embedding and head split ``Layout.vocab_tp`` ways, the logits ``Layout.logits_tp``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TypeVar

from ..breakdown import Component, Term, term
from ..layout import Layout
from ..saved import Saved
from ..shapes import shapes
from ..specs import ModelSpec

HEADS = (
    "q, k, v",
    "attention output",
    "sdpa logsumexp",
    "softmax output (fp32)",
    "attention probs (compute dtype)",
    "attention dropout mask",
    "fused qkv output pinned by v",
    "SwiGLU gate, silu, up, product",
    "MLP up output, GELU output",
    "gelu_new intermediates",
    "block backward gradient temporaries",
    "autocast weight copies",
    # per-op SAC's saved outputs (checkpointing._forward_ops): eager attention's scores per local
    # head; the column-parallel linears' 1/tp; the row-parallel o and down outputs are whole
    # partial sums before their reduction (measured: the 6-block tp8 + SP and tp4 cases,
    # validation/records/opsac_tp_cpu.md)
    "attention scores (bmm output)",
    "q projection output",
    "k projection output",
    "v projection output",
    "fused qkv projection output",
    "gate projection output",
    "up projection output",
    # a held output's KV cache (loss.kv_cache): the column-parallel k and v's local heads
    "KV cache",
)
"""Saved by or after a column-parallel linear: local heads, a 1/tp slice of the MLP width, and the
weight copies autocast makes of sharded weights."""
LOGITS = ("log_softmax output", "fp32 copy of logits", "loss gradients", "logits")
"""The logits and the loss's tensors: a 1/tp slice of the vocabulary under loss parallel
(torchtitan's plan), whole on every rank where the head's output is all-gathered (the tutorial's
``output_layouts=Replicate()``) or the head replicated (``blocks``): ``Layout.logits_tp``."""
HEAD_COPY = ("autocast head weight copy",)
"""The head's weight as autocast casts it: the rank's own slice of a vocabulary-parallel head
(``Layout.vocab_tp``)."""
SEQUENCE = (
    "norm 1",
    "norm 2",
    "final norm:",
    "block input",
    "residual after attention",
    "final norm input",
    "residual dropout masks",
    "embedding dropout mask",
    "checkpointed block input",
    "reduce-scatter outputs",
)
"""The residual stream and what the norms keep: a 1/tp slice of the sequence under SP,
whole without it."""
# everything else (the norms' outputs that column-parallel linears keep all-gathered, the rotary
# tables, the head's input) is whole on every TP rank


_Item = TypeVar("_Item", Saved, Term)


def _divisor(saved: Saved | Term, layout: Layout) -> int:
    if saved.name.startswith(LOGITS):
        return layout.logits_tp
    if saved.name.startswith(HEAD_COPY):
        return layout.vocab_tp
    if saved.name.startswith(HEADS):
        return layout.tp
    if saved.name.startswith(SEQUENCE) and layout.sp:
        return layout.tp
    return 1


def shard_saved(saved: list[_Item], layout: Layout) -> list[_Item]:
    """One TP rank's share of saved tensors or their terms (``activations`` lists them for the
    whole model)."""
    if layout.tp == 1:
        return saved
    return list(_sharded(tuple(saved), layout))


@lru_cache(maxsize=8192)  # the layout search asks for the same lists under every strategy and AC
def _sharded(saved: tuple, layout: Layout) -> tuple:
    out = []
    for s in saved:
        k = _divisor(s, layout)
        out.append(s if k == 1 else replace(s, formula=f"({s.formula})/{k}", bytes=s.bytes // k))
    return tuple(out)


def op_sac_reduce_scatters(model: ModelSpec, train, layout: Layout) -> list[Saved]:
    """Under SP, torchtitan's per-op SAC also saves the row-parallel linears' reduce-scatters
    (``_c10d_functional.reduce_scatter_tensor`` is in its save list; an all-reduce is not): the
    o and down outputs over the sequence, b·s·h each, whole here (``shard_saved`` slices them)."""
    if layout.tp == 1 or not layout.sp:
        return []
    x = shapes(model, train)
    return [Saved("reduce-scatter outputs (o, down)", "2·c·b·s·h", 2 * x.c * x.tokens * x.h)]


def block_params(model: ModelSpec, tp: int) -> int:
    """One block's parameters on a TP rank: column-parallel weights and biases and row-parallel
    weights are 1/tp, row-parallel biases and the norms whole."""
    counts = model.block_param_counts()
    h = model.hidden
    row_biases = 2 * h * model.linear_bias  # wo's and w2's biases
    sharded = counts["attn_qkv"] + counts["attn_out"] + counts["mlp_in"] + counts["mlp_out"] - row_biases
    return sharded // tp + row_biases + counts["norms"]


def embedding_params(model: ModelSpec, tp: int) -> int:
    """The input side on a TP rank: the token embedding split over the vocabulary (``tp``:
    ``Layout.vocab_tp``, 1 where the plan leaves it replicated)."""
    return model.vocab_size * model.hidden // tp + model.max_positions * model.hidden


def head_params(model: ModelSpec, tp: int) -> int:
    """The output side on a TP rank: the final norm whole, the head split over the vocabulary
    (``tp``: ``Layout.vocab_tp``)."""
    return model.head_params() - (0 if model.tied_embeddings else model.vocab_size * model.hidden * (tp - 1) // tp)


ASYNC_TP_NOTE = (
    "async TP's symmetric-memory workspace is modelled from torch's source, not measured "
    "(it needs CUDA symmetric memory)"
)


def async_tp_workspace(model: ModelSpec, local, layout: Layout) -> list[Term]:
    """Async TP's one symmetric-memory workspace per TP group (torch/distributed/_symmetric_memory
    ``get_symm_mem_workspace``, grown to the largest request and kept): the fused
    matmul-reduce-scatter asks for two output chunks (``_pipelined_produce_and_all2all``:
    2·b·(s/tp)·h·c, the largest of its requests; the fused all-gather-matmul asks for one input
    shard, b·(s/tp)·h·c). It is allocated by the symmetric-memory allocator, outside the caching
    allocator's count: an overhead beside ``allocated``. ``local`` is the rank's step (its 1/cp of
    the sequence)."""
    if not layout.async_tp:
        return []
    x = shapes(model, local)
    return [
        term(
            Component.BUFFERS,
            "async_tp.workspace",
            "async TP symmetric-memory workspace (fused matmul-reduce-scatter's two output chunks)",
            "2·c·b·(s/tp)·h",
            2 * x.c * x.tokens * x.h // layout.tp,
        )
    ]


def loss_parallel_backward(terms: list[Term], layout: Layout) -> list[Term]:
    """Loss parallel's backward (torch/distributed/tensor/parallel/loss.py,
    ``_nll_loss_and_log_softmax_backward``) holds three vocabulary-wide tensors at once (the
    zeros it scatters into, ``exp(x)`` and their sum) where eager cross-entropy holds two (the
    nll and log_softmax gradients). Under loss parallel only (``Layout.loss_parallel``)."""
    if not layout.loss_parallel:
        return terms
    return [
        replace(t, formula=f"3/2·{t.formula}", bytes=t.bytes * 3 // 2) if t.name.startswith("loss gradients") else t
        for t in terms
    ]
