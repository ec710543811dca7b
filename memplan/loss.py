"""Bytes the loss keeps: at the end of forward and when backward starts, per loss kind.

``logits_live`` is the b·s·V logits tensor itself (kept by the caller, or freed before
backward); ``loss_saved`` is what the loss adds on top of it. The step's moments use both
(see ``step.py``: "end of forward", "start of backward", and the blocks' backward).

Known limitations: ``fused-linear-ce`` is Liger's ``LigerFusedLinearCrossEntropyFunction``
modelled from its source (liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5); its
Triton kernels do not run on CPU (``RuntimeError: 0 active drivers``), so it is modelled,
not measured. ``cce-compile`` is cut-cross-entropy 25.1.1's ``torch_compile`` implementation,
measured on CPU (the held-out cce-compile cases); its default Triton implementation (``cce``:
the head input and an fp32 log-sum-exp kept, both gradients computed in backward, no logits)
is not modelled. ``chunked-ce`` and ``ce`` are modelled eager, and compiled when the loop
compiles (the compiled loss's backward is modelled, its saved list measured).
"""

from __future__ import annotations

import math

from .activations import Saved, fp32_logits, head_outputs, shapes
from .activations import loss_saved as ce_saved
from .errors import MemplanError
from .loop import Loop
from .specs import ModelSpec, TrainSpec

# model_saved terms the fused loss does not keep: it saves gradients, not the head input
FUSED_DROPS = ("final norm output (head input)", "head input cast")
# cce-compile under autocast saves the head input's cast, not the gathered rows it was cast from
CCE_AUTOCAST_DROPS = ("final norm output (head input)",)


INSTANTS = ("forward", "loss", "block")


def logits_live(model: ModelSpec, train: TrainSpec, loop: Loop, *, instant: str) -> list[Saved]:
    """The logits tensor at the end of forward, at the start of backward (``loss``) and
    while the blocks run their backward (``block``). A freed one is gone once backward
    starts: nothing eager autograd saves refers to it (``.float()`` saves nothing,
    log_softmax saves its output); a compiled loss saves its input, the logits, until its
    own backward has run (measured); cut-cross-entropy's compiled graph likewise (cce-compile)."""
    assert instant in INSTANTS, instant
    x = shapes(model, train)
    held = instant == "forward" or loop.logits != "freed" or (instant == "loss" and loop.compile)
    if loop.loss == "cce-compile":  # inside its compiled graph, which saves them; no caller sees them
        held = instant != "block"
    if loop.loss == "fused-linear-ce" or not held:
        return []
    chunks = f", {loop.loss_chunks} chunks" if loop.loss == "chunked-ce" else ""
    rows, cols, formula = head_outputs(model, x)  # an encoder's classifier: b·N
    size = 4 if fp32_logits(model, train, x) else x.c  # activations.model_saved's logits term
    return [Saved(f"logits (at {instant}{chunks})", f"{size}·{formula}", size * rows * cols)]


def outputs_held(model: ModelSpec, train: TrainSpec, loop: Loop) -> list[Saved]:
    """What the caller's outputs hold from the end of backward until the next step's forward
    returns where the loop holds them (logits held: ``outputs = model(**batch)`` rebinds the name
    only when that forward returns): the logits (``logits_live``), and with ``use_cache`` the
    DynamicCache. Measured: validation.outputs_kept (the optimizer step and the next forward
    each carry them)."""
    if loop.logits != "held":
        return []
    logits = [
        Saved(f"{s.name.replace('at block', 'held by the outputs')}", s.formula, s.bytes)
        for s in logits_live(model, train, loop, instant="block")
    ]
    return logits + kv_cache(model, train)


def kv_cache(model: ModelSpec, train: TrainSpec) -> list[Saved]:
    """transformers' DynamicCache of a forward with ``use_cache=True`` (cache_utils.py
    DynamicLayer.update: ``torch.cat([self.keys, key_states], dim=-2)``, a copy of each layer's
    keys and values, b·s·kv each). Under gradient checkpointing transformers turns the cache off
    (utils/generic.py merge_with_config_defaults, modeling_layers.py GradientCheckpointingLayer:
    "use_cache=True is incompatible with gradient checkpointing"): none under full AC. Under
    autocast the keys are fp32: the rotary embedding's cos and sin come in the hidden states'
    dtype (fp32 parameters) and ``q·cos`` promotes (models/llama/modeling_llama.py
    apply_rotary_pos_emb), the values stay in the compute dtype."""
    if not train.use_cache or train.activation_checkpointing == "full":
        return []
    if model.arch not in ("llama", "gpt2", "neox") or model.mla:
        what = f"{model.name} ({'mla' if model.mla else model.arch})"
        raise MemplanError(
            lambda n: (
                f"{n('use_cache')} is modelled for decoders with one key and value per layer (llama, gpt2, "
                f"neox), not for {what}"
            )
        )
    x = shapes(model, train)
    keys = 4 if x.autocast and model.arch in ("llama", "neox") else x.c
    L, tokens = model.num_layers, x.b * x.s
    return [
        Saved("KV cache keys (held by the outputs)", f"{keys}·L·b·s·kv", keys * L * tokens * x.kv),
        Saved("KV cache values (held by the outputs)", f"{x.c}·L·b·s·kv", x.c * L * tokens * x.kv),
    ]


def _chunk_rows(seq: int, chunks: int) -> list[int]:
    """Sequence lengths of torch.chunk(seq, chunks): ⌈s/n⌉ each, the last the rest."""
    rows = math.ceil(seq / chunks)
    return [min(rows, seq - start) for start in range(0, seq, rows)]


def _chunked_ce(model: ModelSpec, train: TrainSpec, loop: Loop) -> tuple[list[Saved], list[Saved]]:
    """torchtune 0.6.1 modules/loss/ce_chunked_output_loss.py, run eagerly: each chunk's
    ``F.cross_entropy(logits.float())`` keeps its fp32 log_softmax output until backward,
    so the chunking saves only the full fp32 copy (one chunk's copy at a time)."""
    x = shapes(model, train)
    rows, bv = _chunk_rows(x.s, loop.loss_chunks), x.b * x.V
    copy = 4 if x.c < 4 else 0  # .float() of an fp32 chunk is the chunk itself
    done = [sum(rows[: i + 1]) for i in range(len(rows))]
    # labels.chunk(n, dim=1) then .reshape(-1) copies unless b is 1; each nll_loss saves its chunk
    label_bytes = 8 * x.b if x.b > 1 else 0

    def labels(k: int, through: int) -> list[Saved]:
        return (
            [Saved(f"label chunks 1..{k} (int64 copies, saved by nll_loss)", "8·b·s", label_bytes * through)]
            if label_bytes and through
            else []
        )

    i = max(range(len(rows)), key=lambda j: 4 * done[j] + copy * rows[j])
    forward = [Saved(f"log_softmax outputs of chunks 1..{i + 1} (fp32)", "4·b·s·V", 4 * bv * done[i])]
    if copy:
        forward.append(Saved(f"fp32 copy of chunk {i + 1}", "4·b·⌈s/n⌉·V", 4 * bv * rows[i]))
    forward += labels(i + 1, done[i])
    # backward runs the chunks' loss nodes last-created first, all before the head's matmul
    # backwards (autograd's ready queue orders by sequence number; measured): chunk k's two
    # fp32 gradients live beside the log_softmax outputs of chunks ≤ k and the logit-chunk
    # gradients (compute dtype) of the chunks after k, which wait for the head; chunk k's
    # nll_loss has released its labels by then

    def live(k: int) -> int:
        return 4 * bv * done[k] + label_bytes * (done[k] - rows[k]) + 8 * bv * rows[k] + x.c * bv * (x.s - done[k])

    k = max(range(len(rows)), key=live)
    backward = [
        Saved(f"log_softmax outputs of chunks 1..{k + 1} (fp32)", "4·b·s·V", 4 * bv * done[k]),
        Saved(f"loss gradients of chunk {k + 1} (nll, log_softmax)", "2·4·b·⌈s/n⌉·V", 8 * bv * rows[k]),
    ]
    if k < len(rows) - 1:
        backward.append(
            Saved(
                f"logit gradients of chunks {k + 2}..{len(rows)} (wait for the head)",
                "c·b·(s - done)·V",
                x.c * bv * (x.s - done[k]),
            )
        )
    return forward, backward + labels(k, done[k] - rows[k])


def _compiled_ce(model: ModelSpec, train: TrainSpec, loop: Loop) -> tuple[list[Saved], list[Saved]]:
    """A torch.compile'd cross-entropy, per chunk for chunked-ce (torchtune's compile_loss
    compiles compute_cross_entropy; torchtitan compiles its loss with compile.components
    "loss"): inductor saves the logits it was given (``logits_live``), each token's max and
    log-sum-exp in fp32 and the labels, and recomputes the softmax in backward. The saved
    list is measured (saved-tensor hooks, CPU inductor); the backward is modelled: one
    chunk's logit gradient at a time beyond those that wait for the head, which replace
    the logits they came from."""
    x = shapes(model, train)
    chunked = loop.loss == "chunked-ce"
    rows = max(_chunk_rows(x.s, loop.loss_chunks)) if chunked else x.s
    saved = [Saved("per-token max and log-sum-exp (fp32)", "2·4·b·s", 8 * x.tokens)]
    if chunked and x.b > 1:
        saved.append(Saved("label chunks (int64 copies)", "8·b·s", 8 * x.tokens))
    if fp32_logits(model, train, x):
        # logits the model upcast (torchtune's output.float()) come in fp32, so the compiled loss
        # saves them in fp32 (``logits_live``) and returns an fp32 gradient; the cast's backward
        # then makes the compute-dtype gradient after the loss's saved logits are released
        # (measured: torchtune's own model, the held-out compiled llama3_2 case)
        gradient = Saved("fp32 logit gradient", "4·b·s·V", 4 * x.tokens * x.V)
    else:
        gradient = Saved("logit gradient of one chunk", "c·b·⌈s/n⌉·V", x.c * x.b * rows * x.V)
    return saved, saved + [gradient]


def _fused_linear_ce(model: ModelSpec, train: TrainSpec) -> tuple[list[Saved], list[Saved]]:
    """Liger 0.8.5 ops/fused_linear_cross_entropy.py fused_linear_cross_entropy_forward:
    forward computes both gradients chunk by chunk and saves them (ctx.save_for_backward
    of grad_input, grad_weight); no b·s·V tensor exists. Modelled, not measured."""
    x = shapes(model, train)
    t, h, V = x.tokens, x.h, x.V
    head_bytes = 4 if x.autocast else x.c  # the head weight's dtype: fp32 under autocast
    # chunk_size = next_power_of_2(⌈BT / ⌈V / H⌉⌉), at most BT (chunk_mem_const 1)
    rows = min(2 ** math.ceil(math.log2(math.ceil(t / math.ceil(V / h)))), t)
    grads = [
        Saved("head input gradient (computed in forward)", "r·b·s·h", x.r * t * h),
        Saved("head weight gradient (computed in forward)", f"{head_bytes}·V·h", head_bytes * V * h),
    ]
    forward = grads + [
        Saved("logits chunk (gradient written in place)", "c·chunk·V", x.c * rows * V),
        Saved("per-token loss (fp32)", "4·b·s", 4 * t),
    ]
    if head_bytes == 4 and not x.autocast:
        # fp32: grad_weight += torch.mm(grad_logits_chunk.t(), input_chunk).float(), a V×h temporary
        forward.append(Saved("head weight gradient of one chunk (fp32 temporary)", "4·V·h", 4 * V * h))
    return forward, grads


def _cce_compile(model: ModelSpec, train: TrainSpec) -> tuple[list[Saved], list[Saved]]:
    """cut-cross-entropy 25.1.1 torch_compile.py, called with shift=True as its transformers
    patch calls it: ``e[valids]`` gathers the b·(s−1) shifted rows of the head input, then one
    inductor graph computes ``F.cross_entropy((e @ c.T).float(), targets)``. It saves the
    gathered rows (kept as the head input, ``model_saved``), the logits in the compute dtype
    (``logits_live``: held until its backward), each row's max and log-sum-exp in fp32, and
    the targets and row indices (int64). No gradient is computed in forward; its backward
    writes the logits' gradient into the logits' buffer, then makes the head's two gradients
    (``step.Step.head_backward_terms``). Measured: saved-tensor hooks on the compiled graph,
    its allocator timeline (e 2×512×256, c 32000×256: backward adds V·h + b·(s−1)·h, fp32),
    and the held-out cce-compile cases."""
    x = shapes(model, train)
    rows = x.b * (x.s - 1)
    saved = [
        Saved("per-row max and log-sum-exp (fp32)", "2·4·b·(s−1)", 8 * rows),
        Saved("targets and row indices (int64)", "2·8·b·(s−1)", 16 * rows),
    ]
    # under autocast, e @ c.T inside the graph saves both casts, model_saved's "head input cast"
    # and "autocast head weight copy", in place of the gathered rows (measured at the loss alone)
    return saved, saved


def loss_saved(model: ModelSpec, train: TrainSpec, loop: Loop) -> tuple[list[Saved], list[Saved]]:
    """What the loss keeps beyond the logits: at its forward's peak (end of forward) and at
    its backward's peak (start of backward)."""
    if loop.loss == "fused-linear-ce":
        return _fused_linear_ce(model, train)
    if loop.loss == "cce-compile":
        return _cce_compile(model, train)
    if loop.compile:
        return _compiled_ce(model, train, loop)
    if loop.loss == "chunked-ce":
        return _chunked_ce(model, train, loop)
    return ce_saved(model, train)


def by_moment(model: ModelSpec, train: TrainSpec, loop: Loop) -> dict[str, list[Saved]]:
    """The logits and loss bytes of each of the step's activation moments: ``forward`` (end
    of forward), ``loss`` (start of backward) and ``block`` (the blocks' backward)."""
    forward, backward = loss_saved(model, train, loop)
    return {
        "forward": logits_live(model, train, loop, instant="forward") + forward,
        "loss": logits_live(model, train, loop, instant="loss") + backward,
        "block": logits_live(model, train, loop, instant="block"),
    }
