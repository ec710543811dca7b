"""What a block keeps under the activation-checkpointing policies that frameworks ship.

``selective`` and ``full`` are ``activations.block_kept``'s; this module adds torchtitan's
per-op selective checkpointing (``op``), its layer-level option (checkpoint every N-th
block, ``ac_every``) and torchtune's activation offloading.

It also says what a ``torch.compile``d block keeps (inductor's partitioner is a
rematerialisation policy too). Measured on CPU: ``op`` against torchtitan's own
SelectiveAC (kept bytes and the block's backward peak), ``ac_every``, ``compile``
(tests/test_loop.py).

Known limitations: ``op`` under autocast is modelled as without it (the casts are
recomputed; what the autocast weight cache holds under SAC is not measured); sdpa's math
path (dropout on CPU) is refused under ``op``; on CUDA the sdpa kernels' outputs are
saved (they are in torchtitan's list), which CPU cannot show. ``compile`` is measured on
two llama shapes only. Offloading is modelled from torchtune's source (it needs CUDA
streams), not measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .activations import Saved, Shapes, block_backward_transient, block_kept, checkpoint_inputs, shapes
from .errors import MemplanError
from .loop import Loop
from .specs import ModelSpec, TrainSpec

# torchtitan 0.3.0 distributed/activation_checkpoint.py SelectiveAC._wrap_block: MUST_SAVE
# for torch._functorch.partitioners.get_default_op_list().compute_intensive_ops (mm, addmm,
# bmm, the CUDA sdpa kernels, ...) and its own list (sdpa math/cudnn, max, linear), except
# every second mm/linear of a block; the CPU flash kernel is in neither, so it is recomputed
_MM, _ALWAYS, _NEVER = "mm", "saved", "recomputed"


def _attention_ops(x: Shapes, device: str) -> list[tuple[str, Saved]]:
    t = x.tokens
    if x.attention == "math-fp32":
        raise MemplanError(
            "ac op is not modelled for sdpa's math path (dropout on CPU); use eager attention or no dropout"
        )
    if x.attention == "eager":
        # matmul(q, kᵀ) and matmul(probs, v) run as aten.bmm
        return [
            (_ALWAYS, Saved("attention scores (bmm output)", "c·b·a·s²", x.c * t * x.a * x.s)),
            (_ALWAYS, Saved("attention output (bmm output)", "c·b·s·q", x.c * t * x.q)),
        ]
    kind = _ALWAYS if device == "cuda" else _NEVER
    return [
        (kind, Saved("attention output (sdpa)", "c·b·s·q", x.c * t * x.q)),
        (kind, Saved("sdpa logsumexp", "4·b·a·s", 4 * x.b * x.a * x.s)),
    ]


def _forward_ops(model: ModelSpec, train: TrainSpec) -> list[tuple[str, Saved]]:
    """A block's compute ops in forward order, each with its output."""
    x = shapes(model, train)
    t, c = x.tokens, x.c
    linear = _MM if not (model.linear_bias or model.qkv_bias) else _ALWAYS  # a bias makes it addmm

    def out(name: str, width: str, n: int) -> Saved:
        return Saved(f"{name} projection output", f"c·b·s·{width}", c * t * n)

    if model.arch == "llama":
        qkv = [(linear, out("q", "q", x.q)), (linear, out("k", "kv", x.kv)), (linear, out("v", "kv", x.kv))]
    else:
        qkv = [(linear, out("fused qkv", "(q + 2·kv)", x.q + 2 * x.kv))]
    mlp_in = [(linear, out("gate", "f", x.f))] if model.gated_mlp else []
    return (
        qkv
        + _attention_ops(x, train.device)
        + [(linear, out("o", "h", x.h))]
        + mlp_in
        + [(linear, out("up", "f", x.f)), (linear, out("down", "h", x.h))]
    )


def op_sac_kept(model: ModelSpec, train: TrainSpec) -> list[Saved]:
    """What one block keeps from forward to backward under torchtitan's per-op SAC: the
    checkpoint's input, and the outputs of the ops its policy marks MUST_SAVE (cached by
    create_selective_checkpoint_contexts until the recompute reuses them)."""
    x = shapes(model, train)
    kept = [Saved("checkpointed block input", "r·b·s·h", x.r * x.tokens * x.h)]
    mm_count = 0
    for kind, saved in _forward_ops(model, train):
        mm_count += kind == _MM
        if kind == _ALWAYS or (kind == _MM and mm_count % 2 == 1):  # mm 1, 3, 5, ... saved
            kept.append(saved)
    return kept


def checkpointed(index: int, every: int) -> bool:
    """Whether block ``index`` (0-based) is checkpointed when every N-th one is: torchtitan's
    layer SAC counts wrapped blocks from 1 and wraps when ``_count % ac_freq == 0``
    (parallelisms/parallelize_llama.py checkpoint_wrapper), so blocks N-1, 2N-1, ..."""
    return (index + 1) % every == 0


def num_checkpointed(num_layers: int, every: int) -> int:
    return num_layers // every


def _policy(loop: Loop, index: int) -> str:
    return loop.ac if checkpointed(index, loop.ac_every) else "none"


def _under(train: TrainSpec, policy: str) -> TrainSpec:
    """The step with one block's policy as its own (itself where it already is)."""
    if train.activation_checkpointing == policy and train.ac_every == 1:
        return train
    return replace(train, activation_checkpointing=policy, ac_every=1)


def block_kept_under(
    model: ModelSpec, train: TrainSpec, loop: Loop, index: int, *, inputs_cast: bool = False
) -> list[Saved]:
    """What block ``index`` keeps from its forward to its backward under the loop's AC
    policy and ``ac_every``; an uncheckpointed block of a compiled loop keeps what
    inductor's partitioner saves. ``inputs_cast`` as in ``activations.block_saved``."""
    policy = _policy(loop, index)
    if policy == "op":
        # the checkpoint's inputs beside the ops' saved outputs (the block input is op_sac_kept's first)
        return op_sac_kept(model, train) + checkpoint_inputs(model, train, inputs_cast=inputs_cast)[1:]
    if policy == "none" and loop.compile:
        return compiled_block_saved(model, train, inputs_cast=inputs_cast)
    return block_kept(model, _under(train, policy), inputs_cast=inputs_cast)


def block_transient_under(
    model: ModelSpec,
    train: TrainSpec,
    loop: Loop,
    index: int,
    *,
    inputs_cast: bool = False,
    share: Callable[[list[Saved]], list[Saved]] = list,
) -> list[Saved]:
    """Extra bytes while block ``index`` runs its backward, beyond what it kept. An op-SAC
    block peaks there exactly where a full-AC one does (measured on CPU against
    torchtitan's SelectiveAC): the recompute rebuilds the whole saved set, taking the SAC
    cache's tensors instead of recomputing them, so it needs that much less on top.
    ``share``: one rank's share of a list of saved tensors (a TP rank's slice of each)."""
    policy = _policy(loop, index)
    full = block_backward_transient(model, _under(train, "full" if policy == "op" else policy), inputs_cast=inputs_cast)
    if policy != "op":
        return full
    temporaries, *recomputed = full  # block_backward_transient lists the gradient temporaries first
    cache = sum(s.bytes for s in share(op_sac_kept(model, train)[1:]))
    return [
        temporaries,
        Saved(
            "recomputed activations beyond the SAC cache",
            "block saved − SAC cache",
            sum(s.bytes for s in share(recomputed)) - cache,
        ),
    ]


# torchtune 0.6.1 training/_activation_offloading.py OffloadActivations: saved tensors of at
# least min_offload_size bytes (not parameters) are copied to host in pack_tensor; with
# use_streams the last max_fwd_stash_size offloaded tensors stay referenced on the GPU
# (fwd_stash) until the first backward node's hook
OFFLOAD_MIN_BYTES = 1024
OFFLOAD_STASH_TENSORS = 5
# The saved tensors packed after the last block's checkpoint input: the final norm's (the
# output head runs under NoOpManager, the loss outside the offloading context). pack_tensor
# numbers every packed tensor, parameters and small ones included, and at each offload drops
# from the stash the ids at least max_fwd_stash_size below the current one (l.155-165).
# LlamaRMSNorm (transformers modeling_llama.py; torchtune's RMSNorm saves the same): pow saves
# its input, rsqrt its result, the mul both operands, weight * x both: the last offloaded is
# the 5th or 6th pack. LayerNorm (native_layer_norm): input, weight, bias, mean, rstd; its
# mean and rstd (4·b·s bytes each) are offloaded only from min_offload_size up.
_RMS_NORM_LAST_OFFLOADED = 5
_LAYER_NORM_LAST_OFFLOADED = (1, 5)  # (its stats under min_offload_size, from it up)


def offloaded(saved: list[Saved]) -> tuple[list[Saved], list[Saved]]:
    """(stays on the GPU, moved to host) of a list of saved tensors; an entry counts as
    one tensor for the size threshold (entries that group several tensors group equal
    ones, so this only matters for toy shapes)."""
    return [s for s in saved if s.bytes < OFFLOAD_MIN_BYTES], [s for s in saved if s.bytes >= OFFLOAD_MIN_BYTES]


def offloaded_outside(model: ModelSpec, train: TrainSpec) -> list[Saved]:
    """Host copies of what the offloading context packs outside the blocks: the input ids
    (the embedding's saved indices) and the final norm's packs, one copy per pack
    (pack_tensor copies each packed tensor, l.169-190, the same tensor packed twice twice);
    measured on CPU with calibrate.offload (a llama's 15.03 MiB host total, exact)."""
    x = shapes(model, train)
    t = x.tokens
    if model.arch == "llama":  # pow and the mul pack the fp32 input, rsqrt and the mul rstd, weight * x the output
        packs = [
            Saved("final norm: fp32 input, twice", "2·4·b·s·h", 2 * 4 * t * x.h),
            Saved("final norm: normalised", "r·b·s·h", x.r * t * x.h),
            Saved("final norm: rstd, twice", "2·4·b·s", 2 * 4 * t),
        ]
    else:  # native_layer_norm packs its input, mean and rstd
        stat = x.r if x.m == x.c else 4
        packs = [
            Saved("final norm: input", "r·b·s·h", x.r * t * x.h),
            Saved("final norm: mean, rstd", "2·4·b·s", 2 * stat * t),
        ]
    packs.append(Saved("input ids (embedding)", "8·b·s", 8 * t))
    return offloaded(packs)[1]


def offload_stash_blocks(model: ModelSpec, tokens: int) -> int:
    """Blocks whose (full-AC) checkpoint input is still on the GPU at the end of forward and
    the start of backward: those among the stash's last 5 ids once the final norm's last
    offloaded tensor is packed. torchtune requires AC with offloading: one packed tensor per
    block (its input). For a llama none (measured on CPU with calibrate.offload's replica)."""
    if model.arch == "llama":
        last = _RMS_NORM_LAST_OFFLOADED
    else:  # from the source, not measured
        last = _LAYER_NORM_LAST_OFFLOADED[4 * tokens >= OFFLOAD_MIN_BYTES]
    return min(model.num_layers, max(0, OFFLOAD_STASH_TENSORS - last))


def compiled_block_saved(model: ModelSpec, train: TrainSpec, *, inputs_cast: bool = False) -> list[Saved]:
    """What a ``torch.compile``d llama block saves for backward: inductor's min-cut
    partitioner (torch._functorch.partitioners.min_cut_rematerialization_partition) keeps
    the matmul and sdpa inputs and outputs and recomputes the pointwise chains between
    them: each RMSNorm from its input and rstd (no fp32 copy, no normalised output), the
    SwiGLU's silu from the gate. Read off saved-tensor hooks on a compiled block (torch
    2.13, CPU inductor); the test re-measures it. Modelled for llama with sdpa and no
    autocast; other blocks are refused rather than guessed. With ``inputs_cast`` (FSDP2's
    MixedPrecisionPolicy) cos/sin arrive cast: modelled as no cast of the block's own."""
    x = shapes(model, train)
    if model.arch != "llama" or x.attention != "flash" or x.autocast:
        raise MemplanError(
            f"compile is modelled for llama blocks with sdpa and no autocast, "
            f"not {model.arch} with {x.attention} attention{' under autocast' if x.autocast else ''}"
        )
    t = x.tokens
    # the cos/sin casts to the compute dtype, shared by q and k (eager casts them for each)
    rotary = [Saved("rotary cos/sin casts", "2·c·s·d", 2 * x.c * x.s * x.d)] if x.c < 4 and not inputs_cast else []
    return rotary + [
        Saved("block input (norm 1 recomputed from it)", "r·b·s·h", x.r * t * x.h),
        Saved("rstd of norm 1 and norm 2 (fp32)", "2·4·b·s", 8 * t),
        Saved("norm 1 output (q, k, v projection input)", "c·b·s·h", x.c * t * x.h),
        # torchtune's attention copies k and v per query head before sdpa, which saves the copies
        # (measured: its own compiled layer, validation/records/heldout_matrix_cpu.md)
        Saved(
            "q, k (after rotary), v",
            "c·b·s·(q + 2·q): k, v per query head" if x.kv_saved != x.kv else "c·b·s·(q + 2·kv)",
            x.c * t * (x.q + 2 * x.kv_saved),
        ),
        Saved("attention output", "c·b·s·q", x.c * t * x.q),
        Saved("sdpa logsumexp", "4·b·a·s", 4 * x.b * x.a * x.s),
        Saved("o projection input (attention output, transposed copy)", "c·b·s·q", x.c * t * x.q),
        Saved("residual after attention (norm 2 recomputed from it)", "r·b·s·h", x.r * t * x.h),
        Saved("SwiGLU gate, up, product", "3·c·b·s·f", 3 * x.c * t * x.f),
    ]
