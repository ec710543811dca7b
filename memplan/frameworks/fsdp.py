"""FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``): sharded states, the
unsharded units around the one that runs, the reduce-scatter input, and the moments FSDP2 adds
to the step (its blocks' backward, its root unit's gradients and reduce-scatter). What it writes
for ``--emit`` is ``fsdp_emit``'s."""

from __future__ import annotations

from typing import ClassVar

from ..breakdown import Component, Term, term
from ..moments import MomentSpec, insert
from ..precision import POLICIES
from .base import TORCH_DTYPE, Emitter, Framework
from .fsdp_emit import FSDP1_SHARDING, FSDP2_STRATEGIES, fsdp1_snippet, fsdp2_snippet

B, G = Component.BUFFERS, Component.GRADIENTS
__all__ = ["FSDP", "FSDP1_SHARDING", "FSDP2_STRATEGIES"]  # the strategies' names, where emit reads them


def _gathered(step, key: str, count: int, name: str):
    return term(B, key, name, f"{step.gather_bytes}·{count:,}", step.gather_bytes * count)


def _outside_blocks(step, instant: str) -> list[tuple[str, int, str]]:
    """(key, parameter count, name) of the units outside the blocks that are gathered at
    ``instant`` (forward, loss: the loss's forward and backward; head: the LM head's backward;
    block: a block's backward), by
    the recipe's unit layout (``loop.FSDP_UNITS``). FSDP2 reshards a unit after its backward
    (reshard_after_backward) and after forward where reshard_after_forward says so."""
    model, s, units = step.job.model, step.strategy, step.fsdp_units
    kept_after_forward = not s.reshard_after_forward
    if units != "blocks":
        # root-kept: fully_shard's root default keeps it from forward to the end of backward;
        # all: torchtune's root reshards after forward, gathered again in its pre-backward
        gathered = units == "root-kept" or kept_after_forward or instant in ("block", "head")
        return [("fsdp.root_unit", step.root_params if gathered else 0, "unsharded root unit (embeddings, head)")]
    # torchtitan / accelerate: [final norm, lm head] (+ a tied embedding) kept after forward,
    # resharded after its backward; the input embedding its own unit; learned positions in the root.
    # Each as this rank holds it: under TP the DTensor's local shard of the vocabulary-parallel
    # embedding and head, under PP only the stage's own (memplan.parallel.step.RankStep)
    head, embedding = step.head_unit_params(), step.embedding_unit_params()
    # a tied embedding's head unit is gathered again for the input embedding's backward, the
    # step's last, and stays gathered through the blocks' backward in between (measured: the
    # held-out qwen2 tied case under torchtitan's units, the unit's parameters in the peak of
    # its last block's backward)
    gathered_in_blocks = head if model.tied_embeddings else 0
    return [
        (
            "fsdp.head_unit",
            head if instant != "block" else gathered_in_blocks,
            "unsharded head unit (final norm, lm head)",
        ),
        ("fsdp.embedding_unit", embedding if kept_after_forward else 0, "unsharded input embedding unit"),
        ("fsdp.root_unit", step.root_params - head - embedding, "unsharded root unit (learned positions)"),
    ]


_BLOCK_INDEX = {"first": lambda L: 0, "lower": lambda L: 1, "upper": lambda L: L - 2, "last": lambda L: L - 1}
"""The block each of ``FSDP_BLOCK_MOMENTS``' and ``FSDP_MIDDLE_BLOCK_MOMENTS``' instants is in."""


def _post_forward_copies(step, instant: str) -> list[Term]:
    """``fully_shard(reshard_after_forward=N)`` with N below the shard group: after its forward a
    unit keeps a clone of its 1/N slice of the all-gather output (torch 2.13 _fsdp_param.py
    to_sharded_post_forward), freed when its backward's all-gather has copied out
    (``to_unsharded``). At ``instant``: every block's after the forward; at a block's backward
    those of the blocks below it, and its own through its copy-out (a prefetched unit's until its
    own); an input embedding unit's (torchtitan's, accelerate's) until the step's last backward;
    a root resharded after forward (torchtune's) until its pre-backward, at the head."""
    group, L = step.job.post_forward_group, step.job.model.num_layers
    if not group or instant == "start":
        return []
    which = instant.split("_")[0]
    blocks = _BLOCK_INDEX[which](L) + instant.endswith("copy") if which in _BLOCK_INDEX else L
    units = step.fsdp_units
    outside = (
        step.embedding_unit_params()
        if units == "blocks" and not step.job.model.tied_embeddings
        else step.root_params
        if units == "all" and instant in ("forward", "loss")
        else 0
    )
    g, bp = step.gather_bytes, step.block_params
    copies = [
        term(
            B,
            "fsdp.post_forward",
            f"{blocks} blocks' post-forward copies (1/{group})",
            f"{g}·{blocks}·{bp:,}/{group}",
            -(-g * blocks * bp // group),
        )
    ]
    if outside:
        copies.append(
            term(
                B,
                "fsdp.post_forward",
                f"{'input embedding' if units == 'blocks' else 'root'} unit's post-forward copy (1/{group})",
                f"{g}·{outside:,}/{group}",
                -(-g * outside // group),
            )
        )
    return [c for c in copies if c.bytes]


def _forward_start(step) -> list:
    """At the first block's all-gather copy-out: the unit gathered before it (the root, or the
    input embedding's own unit) with its all-gather output retained (``FORWARD_START``), and
    the first block's all-gather output and unsharded parameters."""
    model = step.job.model
    if step.gather_group == 1:
        return []  # a group of one copies the shard in place (wait_for_unshard): nothing retained
    if step.fsdp_units == "blocks":
        # tied: the head unit holding the embedding, with the root's learned positions
        first = step.root_params if model.tied_embeddings else step.embedding_unit_params()
        kept = not step.strategy.reshard_after_forward
    else:
        first, kept = step.root_params, step.fsdp_units == "root-kept" or not step.strategy.reshard_after_forward
    terms = [
        _gathered(step, "fsdp.first_unit_all_gather", first, "first unit's all-gather output (retained)"),
        _gathered(step, "fsdp.first_block", 2 * step.block_params, "first block's all-gather output and parameters"),
    ]
    return [_gathered(step, "fsdp.root_unit", first, "unsharded first unit"), *terms] if kept else terms


def _block_backward(step, instant: str) -> list:
    """FSDP2 full shard's buffers in a block's backward (``FSDP_BLOCK_MOMENTS``; torch 2.13
    _fsdp_param_group.py); ``instant`` is WHICH_AT, WHICH the first, last, upper or lower block,
    AT copy, start or end. Copy: ``pre_backward``'s copy-out (``wait_for_unshard``) holds the
    block's all-gather buffer and its unsharded parameters. Start: the buffer freed, the block's
    backward beside the all-gather buffer of the unit ``_backward_prefetch`` gathers next (the
    block before; at the first block a torchtitan / accelerate input embedding unit, nothing where
    the root holding it is gathered already) and the first weight gradient it makes. End, before
    ``post_backward``: the unsharded parameters, all the block's unsharded gradients (the
    parameters' dtype), the next unit's buffer. All three: the reduce-scatter input of the unit
    reduced before, kept in ``FSDPCommContext.reduce_scatter_states`` until this block's
    post-backward (the block after; at the last block a torchtitan / accelerate untied head unit,
    which reduced after the head's backward, while a unit holding the input embedding reduces
    last)."""
    model, L, bp = step.job.model, step.job.model.num_layers, step.block_params
    g, r, own_units = step.gather_bytes, step.reduce_bytes, step.fsdp_units == "blocks"
    vh = step.embedding_unit_params()
    gathers = step.gather_group > 1  # a group of one copies in place, retains nothing (``_forward_start``)
    which = instant.split("_")[0]
    # a tied head unit holds the input embedding: it reduces last, in the root's post-backward
    own_head = own_units and not model.tied_embeddings
    if which != "last" and L > 1:
        before, before_name = bp, "reduce-scatter input of the block after (retained)"
    else:
        before, before_name = (
            (step.head_unit_params() if own_head else 0),
            "head unit's reduce-scatter input (retained)",
        )
    if which == "first" or L == 1:
        nxt, nxt_name = (vh if own_head else 0), "input embedding unit's all-gather buffer (prefetched)"
    else:
        nxt, nxt_name = bp, "block before's all-gather buffer (prefetched)"
    if not gathers:
        before, nxt = 0, 0
    retained = [term(B, "fsdp.retained_reduce_input", before_name, f"{r}·{before:,}", r * before)] if before else []
    prefetched = [_gathered(step, "fsdp.prefetched", nxt, nxt_name)] if nxt else []
    if prefetched and which == "last" and not step.strategy.reshard_after_forward:
        # shard-grad-op prefetches nothing: the blocks before the last are still gathered from forward
        g, name = step.gather_bytes, f"unsharded {L - 1} blocks before it (forward→backward)"
        prefetched = [term(B, "fsdp.all_blocks", name, f"{g}·{L - 1}·{bp:,}", g * (L - 1) * bp)]
    unsharded = _gathered(step, "fsdp.block", bp, "unsharded block")
    if instant.endswith("copy"):
        if not gathers:
            return [unsharded]
        return [_gathered(step, "fsdp.block", 2 * bp, "block's all-gather buffer and unsharded parameters")] + retained
    if instant.endswith("start"):
        # the copy-out freed the block's all-gather buffer; the block's backward runs beside the
        # next unit's and makes its MLP output projection's weight gradient first (measured: the
        # held-out neox hf-trainer peak, the input embedding unit's buffer and that gradient in
        # the first block's backward)
        return [
            unsharded,
            *prefetched,
            term(
                B,
                "fsdp.block_grads",
                "MLP output projection's unsharded gradient",
                f"{g}·h·f",
                g * step.first_weight_grad(),
            ),
            *retained,
        ]
    return [
        unsharded,
        term(B, "fsdp.block_grads", "unsharded block gradients", f"{g}·block params", g * bp),
        *prefetched,
        *retained,
    ]


# -- the moments FSDP2 adds to the step (memplan.step.MOMENTS), each inserted beside one it names --

WHOLE_HEAD_BACKWARD = MomentSpec(
    name="fsdp.head",
    phase="backward",
    label="backward of the LM head",
    groups=("states", "grads.carried", "activations.blocks", "activations.outside_head", "gathered.head", "loss.head"),
)
"""FSDP2, the head applied once (no chunked output): the head's backward holds the logit
gradient and the head weight's unsharded gradient (before its unit's reduce-scatter) while the
head unit is gathered and the last block prefetched (measured: the held-out torchtitan FSDP
case without AC, llama h768, whose peak is here in MemTracker's head-module snapshot). Under
autocast the largest instant is the weight gradient's cast back to the fp32 parameter's dtype
(the backward of autocast's weight copy): the compute-dtype gradient and its fp32 cast beside the
head input's gradient, the weight copy and the logit gradient freed by the matmul's backward
(measured per module: the held-out neox hf-trainer amp-fp16 case, whose peak is here)."""


FORWARD_START = MomentSpec(
    name="fsdp.forward_start",
    phase="forward",
    label="start of forward (first units' all-gathers copied out)",
    groups=("states", "grads.carried", "gathered.start"),
)
"""FSDP2: in forward the all-gather output of the unit before is kept until the next unit's
copy-out (``FSDPParamGroup.wait_for_unshard``), so the first unit outside the blocks is live
twice while the first block is gathered (measured: the held-out matrix's 128k-vocabulary
one-block case, whose peak is here)."""


ROOT_BACKWARD = MomentSpec(
    name="fsdp.root_backward",
    phase="backward",
    label="backward of the input embedding (root unit gradients)",
    groups=("states", "grads.blocks", "logits.block", "gathered.root", "grads.root_unsharded"),
)
"""FSDP2: the root unit's gradients stay unsharded until its
post-backward reduce-scatter, after the input embedding's backward, while its parameters are
still gathered (measured: the held-out matrix's large-vocabulary FSDP cases, whose peak holds
no activations, the gathered root unit and its gradients)."""


def _block_moments(which: str) -> tuple[MomentSpec, ...]:
    """A block's all-gather copy-out, its backward beside the next unit's buffer, its end."""
    grads, kept = f"grads.{which}_block", f"activations.{which}_block"
    return (
        MomentSpec(
            name=f"fsdp.block.{which}.copy",
            phase="backward",
            label=f"the {which} block's all-gather copied out (start of its backward)",
            groups=("states", grads, kept, "logits.block", f"gathered.{which}_copy"),
        ),
        MomentSpec(
            name=f"fsdp.block.{which}.start",
            phase="backward",
            label=f"backward of the {which} block (the next unit prefetched)",
            groups=("states", grads, kept, "logits.block", f"gathered.{which}_start", f"block.backward.{which}"),
        ),
        MomentSpec(
            name=f"fsdp.block.{which}.end",
            phase="backward",
            label=f"end of the {which} block's backward (before its reduce-scatter)",
            groups=("states", grads, f"activations.below_{which}", "logits.block", f"gathered.{which}_end"),
        ),
    )


FSDP_BLOCK_MOMENTS = {which: _block_moments(which) for which in ("last", "first")}
"""FSDP2 full shard, the first and the last block's backward at three instants each (torch 2.13
_fsdp_param_group.py): ``pre_backward`` copies the block's all-gather out (``wait_for_unshard``:
the all-gather buffer and the unsharded parameters both live) with every activation still kept;
then ``_backward_prefetch`` allocates the next unit's all-gather buffer, beside which the block's
backward runs (its transient and the first weight gradient it makes); at its end, before
``post_backward`` reshards it, its unsharded gradients are complete, the next unit's buffer
waits and its own activations are freed. All three hold the reduce-scatter input of the unit
reduced before (``reduce_scatter_states``, popped in this block's post-backward). Measured per
module with MemTracker: the held-out neox plain-freed peak is the first block's copy-out, the
neox hf-trainer peak its backward beside the input embedding unit's buffer, the mistral
hf-trainer peak its end."""


FSDP_MIDDLE_BLOCK_MOMENTS = {which: _block_moments(which) for which in ("upper", "lower")}
"""With three blocks or more, the blocks between at either end (``between``): upper,
block L−2, with the most activations kept; lower, block 1, with the most gradient shards
reduced (the same block when L is 3); each with a block before it prefetched and the block
after's reduce-scatter input retained (measured: the tuned matrix's 4-block llama FSDP full-AC
case, whose peak is in block 1's MLP backward)."""


ROOT_REDUCE = MomentSpec(
    name="fsdp.root_reduce",
    phase="backward",
    label="reduce-scatter of the input embedding's unit (root post-backward)",
    groups=("states", "grads.before_root", "logits.block", "grads.root_reduce"),
)
"""FSDP2: the unit holding the input embedding reduces in the root's post-backward callback
(its inputs, token ids, need no gradient), after resharding: its reduce-scatter input, the
reduce output and its cast to the fp32 shard's dtype live together, and ``foreach_reduce``'s
loop variable keeps the unit's last parameter's unsharded gradient (measured: the held-out
llama plain-kept mixed-bf16 case on 2 gloo ranks, whose peak is here)."""


def splits_blocks(step) -> bool:
    """Whether the blocks' backward is FSDP2 full shard's three instants per block
    (``FSDP_BLOCK_MOMENTS``). No-shard is fully_shard over a shard group of one (the replicate
    dimension holds the world: calibrate.wrappers): the same hooks, nothing gathered, so the
    same instants (measured: a 2-layer h256 llama, pure bf16, full AC, 2 gloo ranks, its peak at
    the end of a block's backward, inside the input norm's; one moment per block missed it)."""
    return step.strategy.id in ("fsdp-full-shard", "fsdp-no-shard") and _blocks_measured(step) and not _one_unit(step)


def sgo_like_full_shard(step) -> bool:
    """FSDP2 shard-grad-op where full shard would split its blocks' moments: the blocks stay
    gathered from forward to backward (one moment per block), but its units reduce as full
    shard's do, so the head's gradients beside the blocks are the same
    (``block_grad_groups``)."""
    return step.strategy.id == "fsdp-shard-grad-op" and _blocks_measured(step) and not _one_unit(step)


def _blocks_measured(step) -> bool:
    """Where FSDP2's block instants were measured: a full fine-tune of a dense decoder, one
    micro-batch, its states on the GPU (on any GPU count: the sweep's families share one set
    of moments)."""
    model, train = step.job.model, step.job.train
    return (
        step.P == "P"
        and not model.num_experts
        and model.arch not in ("bert", "vit")
        and train.grad_accum == 1
        and not train.optimizer_in_backward
        and not step.params_on_host
        and not step.grads_on_host
        # float8's casts are transient and not modelled (loop_notes); measured per module, the
        # held-out float8 case's peak holds 26 MiB of them in the first block's backward, which
        # the one-moment-per-block model covers by counting a block's buffers too many
        and not train.float8
        and _whole_model_per_rank(step)
    )


def _whole_model_per_rank(step) -> bool:
    """No pipeline stages (pipelining defers FSDP's reshard and reduce-scatter to a stage's last
    backward, torch pipelining stage.py backward_maybe_with_nosync) and no tensor-parallel
    slices (the vocabulary-parallel head): the layout's rank step (memplan.parallel.step) keeps
    one moment per block there."""
    layout = getattr(step, "layout", step.job.layout)  # RankStep's whole job's layout
    return layout.pp == 1 and layout.tp == 1


def between(step) -> tuple[tuple[str, int], ...]:
    """(name, index) of the blocks between the first and the last that ``FSDP_MIDDLE_BLOCK_
    MOMENTS`` look at: going down a block adds its reduced gradient shard and drops its kept
    activations, so the largest such moment is at block L−2 or block 1."""
    L = step.job.model.num_layers
    return (("upper", L - 2), ("lower", 1)) if L > 3 else (("upper", 1),) if L == 3 else ()


def block_grad_groups(step) -> dict[str, list[Term]]:
    """The gradients beside the blocks' backward under ``FSDP_BLOCK_MOMENTS``: a head unit of
    its own (torchtitan's, accelerate's, untied) has reduced them to its shard after the head's
    backward; a unit holding the head and the input embedding (fully_shard's root, torchtune's,
    a tied head unit) keeps the head's unsharded: its post-backward hook hangs on its forward
    inputs, token ids that need no gradient, so it reduces in the root's post-backward callback,
    after the input embedding's
    (measured per module: the held-out neox plain-freed case, the final norm's and head's
    gradients unsharded through both blocks' backward; the mistral hf-trainer case, the head
    unit's shard)."""
    model, L, bp = step.job.model, step.job.model.num_layers, step.block_params
    own_head_unit = step.fsdp_units == "blocks" and not model.tied_embeddings
    sharded = step.head_unit_params() if own_head_unit else 0
    unsharded = (
        []
        if own_head_unit
        else [
            term(
                G,
                "fsdp.head_grads",
                "unsharded final norm and head gradients (the root unit reduces last)",
                f"{step.gather_bytes}·(norm + V·h)",
                step.gather_bytes * step.head_weight_params(),
            )
        ]
    )
    return {
        "grads.last_block": step.grad_share(sharded, "head unit params") + unsharded,
        **{
            f"grads.{name}_block": step.grad_share(sharded + (L - 1 - k) * bp, "params of the blocks after it")
            + unsharded
            for name, k in between(step)
        },
        "grads.first_block": step.grad_share(sharded + (L - 1) * bp, "params of the blocks after the first")
        + unsharded,
    }


def root_reduce(step) -> bool:
    """Whether the step has ``ROOT_REDUCE``: the unit of an untied input embedding or a root
    holding the embeddings reduces last."""
    return (splits_blocks(step) or sgo_like_full_shard(step)) and not (
        step.fsdp_units == "blocks" and step.job.model.tied_embeddings
    )


def root_reduce_groups(step) -> dict[str, list[Term]]:
    """``ROOT_REDUCE``'s terms (torch 2.13 _fsdp_collectives.py foreach_reduce): the
    reduce-scatter input (reduce dtype, the whole unit), the reduce output (its shard) and, when
    the reduce dtype is not the fp32 shard's, the output's cast; the unit's last parameter's
    unsharded gradient, which the loop variable of foreach_reduce's Shard(dim) pass keeps after
    ``unsharded_grads.clear()`` (Hugging Face registers lm_head last; a tied root's last is the
    final norm; an embedding unit's only parameter is the embedding)."""
    model, r, g = step.job.model, step.reduce_bytes, step.gather_bytes
    vh = step.vocab_params()
    unit = step.embedding_unit_params() if step.fsdp_units == "blocks" else step.root_params
    last = model.norm_params if step.fsdp_units != "blocks" and model.tied_embeddings else vh
    shard = step.local(unit, True)
    cast = step.shard_master and r != 4
    return {
        "grads.before_root": step.grad_share(step.params - unit, "params of the units reduced before it"),
        "grads.root_reduce": [
            term(B, "fsdp.root_reduce", "its reduce-scatter input", f"{r}·{unit:,}", r * unit),
            term(B, "fsdp.root_reduce", "its reduce output", f"{r}·{unit:,}/{step.n}", r * shard),
            *(
                [term(G, "fsdp.root_reduce", "the reduce output cast to fp32", f"4·{unit:,}/{step.n}", 4 * shard)]
                if cast
                else []
            ),
            term(G, "fsdp.root_reduce", "its last parameter's unsharded gradient", f"{g}·{last:,}", g * last),
        ],
    }


def root_grad_groups(step) -> dict[str, list[Term]]:
    """The moment after the input embedding's backward (``ROOT_BACKWARD``): the blocks'
    gradients reduced and sharded, the root unit gathered with its unsharded gradients; a
    tied embedding's gradient is added to the head's out of place (AccumulateGrad), so the
    head's, the embedding's own and their sum are live at once (measured: the tied cases
    of the held-out matrix hold three V·h gradients there)."""
    model, L = step.job.model, step.job.model.num_layers
    tied = 2 * step.vocab_params() if model.tied_embeddings and step.P == "P" else 0
    # torchtitan's / accelerate's head unit has reduced its gradients after its own backward
    head = step.head_unit_params() if step.fsdp_units == "blocks" and not model.tied_embeddings else 0
    count = (step.root_params - head if step.P == "P" else step.trained.root) + tied
    blocks = (
        step.grad_terms()
        if step.job.train.grad_accum > 1 or step.zero_filled()
        else step.grad_share(sum(step.trained.blocks), f"{L} blocks' params")
    )
    return {
        "grads.blocks": blocks,
        "gathered.root": [
            term(
                B,
                "fsdp.root_unit",
                "unsharded root unit (embeddings, head)" if not head else "unsharded input embedding unit",
                f"{step.gather_bytes}·{step.root_params - head:,}",
                step.gather_bytes * (step.root_params - head),
            )
        ],
        "grads.root_unsharded": [
            term(
                G,
                "fsdp.root_grads",
                "unsharded root unit gradients (before its "
                "reduce-scatter)" + (", the tied embedding's three times" if tied else ""),
                f"{step.gather_bytes}·{count:,}",
                step.gather_bytes * count,
            ),
            *retained_reduce_input(step),
        ],
    }


def retained_reduce_input(step) -> list[Term]:
    """FSDP2 keeps the last reduce-scatter's input alive until the next unit's post-backward
    reduces (FSDPCommContext.reduce_scatter_states, at most reduce_scatter_max_input_buffers
    = 1: torch 2.13 _fsdp_param_group.py post_backward): the first block's, at the input
    embedding's backward (measured: the tied cases of the held-out matrix, one block's
    gradients in the reduce dtype above the root unit's)."""
    if step.gather_group == 1:
        return []
    return [
        term(
            B,
            "fsdp.retained_reduce_input",
            "first block's reduce-scatter input (kept until the root's reduce-scatter)",
            f"{step.reduce_bytes}·block params",
            step.reduce_bytes * step.block_params,
        )
    ]


def _one_unit(step) -> bool:
    return step.job.one_fsdp_unit


def _whole_model(step) -> list[Term]:
    """The whole model as one FSDP1 unit (``--fsdp-wrap none``): all-gathered into its flat parameter
    in the root's pre-forward, not resharded after forward (the root's never is: torch 2.13
    fsdp/_runtime_utils.py _post_forward_reshard), freed in its post-backward (measured:
    validation.lightning_loop, Lightning's FSDPStrategy() without auto_wrap_policy)."""
    return [_gathered(step, "fsdp.whole_model", step.params, "unsharded model (one FSDP unit, forward→backward)")]


def _unsharded_grads(step, count: int, what: str) -> list[Term]:
    g = step.gather_bytes
    return [term(G, "fsdp.unit_grads", f"unsharded gradients of the {what}", f"{g}·{count:,}", g * count)]


def one_unit_groups(step) -> dict[str, list[Term]]:
    """The gradients of one FSDP unit: unsharded in the gathered dtype as the backward makes them, each
    parameter's own (the views' gradients wait in autograd's input buffer of the flat parameter's
    split), until the step's last gradient; then autograd's split backward concatenates them into the
    flat parameter's gradient, the reduce-scatter's input, while they are still live (``ROOT_BACKWARD``:
    the gathered model, its gradients twice, the sharded states; measured: the lightning_loop one-unit
    cases at one micro-batch of 64 tokens, fp32 4.50 and bf16-mixed 3.00 units of 4·P, their peak
    here). A tied embedding's weight gets two gradients, the head's and its own, summed in that buffer:
    one more V·h counted beside its gradient (not measured: the one-unit cases are untied)."""
    model, L = step.job.model, step.job.model.num_layers
    tied = step.vocab_params() if model.tied_embeddings else 0
    groups = {
        "grads.last_block": _unsharded_grads(step, step.root_params, "embedding/head params"),
        "grads.first_block": _unsharded_grads(
            step, step.params - step.pending_params(), "params but the input embedding"
        ),
        "grads.blocks": [],
        "gathered.root": _whole_model(step),
        "grads.root_unsharded": _unsharded_grads(step, step.params + tied, "model (each parameter's)")
        + [
            term(
                G,
                "fsdp.unit_grads",
                "the unit's flat gradient (their concatenation, the reduce-scatter input)",
                f"{step.gather_bytes}·{step.params:,}",
                step.gather_bytes * step.params,
            )
        ],
    }
    j = step.last_checkpointed()
    if j is not None:
        after = step.root_params + (L - 1 - j) * step.block_params
        what = f"embedding/head params and {L - 1 - j} blocks"
        groups["grads.last_checkpointed"] = _unsharded_grads(step, after, what)
    return groups


class FSDP(Framework):
    id = "fsdp"
    label = "FSDP"
    native_precisions = ("fp32", "amp-bf16", "amp-fp16", "mixed-bf16", "mixed-fp16", "bf16")
    # CPUOffloadPolicy moves parameters, gradients and the optimizer step together
    offload_moves_states = True
    # MixedPrecisionPolicy: the fp32 shard is the master copy; gathered in param_dtype
    shard_is_master = True
    # measured: the first block's sharded gradients appear only after its reduce-scatter
    # (DDP's appear during the block's backward)
    block_grads_after_reduce = True
    emitters: ClassVar[dict[str, Emitter]] = {"fsdp2": fsdp2_snippet, "fsdp1": fsdp1_snippet}
    # the root unit holds a tied embedding's gradients at ROOT_BACKWARD
    sums_tied_grads = False
    # its head weight's gradient is the unsharded parameter's, in the gathered dtype
    unsharded_head_grads = True

    def gathered(self, step, instant: str) -> list:
        s, L, bp = step.strategy, step.job.model.num_layers, step.block_params
        if _one_unit(step):
            return _whole_model(step)
        if instant == "start":
            return _forward_start(step)
        if instant.split("_")[0] in _BLOCK_INDEX:
            return (
                [_gathered(step, key, count, name) for key, count, name in _outside_blocks(step, "block") if count]
                + _block_backward(step, instant)
                + _post_forward_copies(step, instant)
            )
        terms = [_gathered(step, key, count, name) for key, count, name in _outside_blocks(step, instant) if count]
        if instant == "forward" and step.loss_in_model and s.reshard_after_forward and step.gather_group > 1:
            # FSDP2 keeps the last forward all-gather's output (FSDPCommContext.all_gather_state)
            # until the root's forward returns (torch 2.13 _fsdp_param_group.py wait_for_unshard,
            # _fsdp_state.py _post_forward); a loss computed inside the model runs before that
            # (measured: hf-trainer-fsdp-amp-bf16, the head unit's all-gather output in the peak)
            last = (
                next(n for key, n, _ in _outside_blocks(step, "loss") if key == "fsdp.head_unit")
                if step.fsdp_units == "blocks"
                else bp
            )
            what = "head unit" if step.fsdp_units == "blocks" else "last block"
            terms.append(_gathered(step, "fsdp.retained_all_gather", last, f"{what}'s all-gather output (retained)"))
        if not s.reshard_after_forward:
            terms.append(_gathered(step, "fsdp.all_blocks", L * bp, f"unsharded {L} blocks (forward→backward)"))
        elif step.gather_group > 1 and (instant == "head" or (instant == "loss" and step.fsdp_units == "root-kept")):
            # a root holding parameters runs its pre-backward hook on the loss the model returns
            # and prefetches the last block's all-gather (measured); a head unit's hook, or a
            # root's whose model returns the logits, runs on the logits' gradient, before the head's
            terms.append(_gathered(step, "fsdp.prefetched_block", bp, "unsharded last block (backward prefetch)"))
        elif instant == "block":
            both = step.gather_group > 1
            terms.append(
                _gathered(
                    step,
                    "fsdp.block",
                    (2 if both else 1) * bp,
                    "unsharded block + prefetched block" if both else "unsharded block",
                )
            )
        if instant == "block":
            terms.append(
                term(
                    B,
                    "fsdp.block_grads",
                    "unsharded block gradients + reduce-scatter input",
                    f"({step.gather_bytes} + {step.reduce_bytes})·block {'params' if step.P == 'P' else 'trained'}",
                    (step.gather_bytes + step.reduce_bytes)
                    * (step.block_params if step.P == "P" else step.trained.blocks[-1]),
                )
            )
        return terms + _post_forward_copies(step, instant)

    def holds_root_grads(self, step) -> bool:
        return not step.job.train.optimizer_in_backward

    def applies_head_once(self, step) -> bool:
        """``WHOLE_HEAD_BACKWARD``: an LM head applied once and a logits tensor."""
        model, loop = step.job.model, step.job.train.loop
        return (
            not step.chunked_head()
            and loop.loss not in ("fused-linear-ce", "cce-compile")
            and model.arch != "vit"
            and not model.num_labels  # a classifier's head has no V·h weight nor b·s·V logits
        )

    def moment_groups(self, step, groups: dict[str, list[Term]]) -> dict[str, list[Term]]:
        if _one_unit(step):
            return one_unit_groups(step)
        split, sgo = splits_blocks(step), sgo_like_full_shard(step)
        out: dict[str, list[Term]] = {}
        if sgo:
            # shard-grad-op reshards each block after its backward (reshard_after_backward): at the
            # first block's the others are sharded again (measured per module with MemTracker: the
            # tuned matrix's 4-block shard-grad-op case, block 0 alone unsharded in its backward)
            bp, g = step.block_params, step.gather_bytes
            one = term(B, "fsdp.all_blocks", "unsharded first block (the others resharded)", f"{g}·{bp:,}", g * bp)
            block = [one if t.key == "fsdp.all_blocks" else t for t in groups["gathered.block"]]
            out["gathered.block"] = block
            out["gathered.first_block"] = self.first_block_gathered(step, block)
        if step.holds_root_grads():
            out.update(root_grad_groups(step))
        if split or sgo:
            L = step.job.model.num_layers
            out.update(block_grad_groups(step))
            out["activations.below_last"] = (step.block_terms(range(L - 1)) if L > 1 else []) + step.block_end_terms(
                L - 1
            )
            out["activations.below_first"] = step.block_end_terms(0)
        if split:
            for name, k in between(step):
                out[f"activations.{name}_block"] = step.block_terms(range(k + 1))
                out[f"activations.below_{name}"] = step.block_terms(range(k)) + step.block_end_terms(k)
                out[f"block.backward.{name}"] = step.transient_terms(k)
            blocks = ("first", *(name for name, _ in between(step)), "last")
            for where in (f"{w}_{at}" for w in blocks for at in ("copy", "start", "end")):
                out[f"gathered.{where}"] = self.gathered(step, where)
        elif sgo:
            # the ends of the first and the last block's backward as full shard's
            # (FSDP_BLOCK_MOMENTS), the same instants: at the first the blocks after it resharded
            # after their backward, at the last the blocks before it still gathered from forward, so
            # full shard never estimates above shard-grad-op (tests/test_invariants.py)
            for where in ("first_end", "last_end"):
                out[f"gathered.{where}"] = self.gathered(step, where)
        if root_reduce(step):
            out.update(root_reduce_groups(step))
        return out

    def schedule(self, step, specs: tuple[MomentSpec, ...]) -> tuple[MomentSpec, ...]:
        if splits_blocks(step):
            middle = tuple(m for name, _ in between(step) for m in FSDP_MIDDLE_BLOCK_MOMENTS[name])
            specs = insert(specs, *FSDP_BLOCK_MOMENTS["last"], instead="block.last")
            specs = insert(specs, *middle, *FSDP_BLOCK_MOMENTS["first"], instead="block.first")
        elif sgo_like_full_shard(step):
            ends = (FSDP_BLOCK_MOMENTS[which][-1] for which in ("last", "first"))
            specs = insert(specs, *ends, after="block.first")
        if step.whole_head_backward():
            specs = insert(specs, WHOLE_HEAD_BACKWARD, after="backward.start")
        if step.holds_root_grads():
            specs = insert(specs, ROOT_BACKWARD, before="optimizer")
        if root_reduce(step):
            specs = insert(specs, ROOT_REDUCE, before="optimizer")
        return insert(specs, FORWARD_START, before="forward.end")

    def first_block_gathered(self, step, block: list) -> list:
        """No block prefetched at the first block's backward: FSDP2 prefetches the unit before
        the one whose pre-backward runs in forward order (torch 2.13 _fsdp_param_group.py
        _backward_prefetch: post_forward_order[curr_index - 1], nothing at index 0). A root
        holding the embeddings records its post-forward last, after every block's: nothing is
        prefetched (measured: bert-h256-mlm under FSDP2 mixed-bf16 on 2 ranks, MemTracker's
        timeline of the first block's backward: its all-gather output and parameters, the
        second block's retained reduce-scatter input, no other block). Under torchtitan's units
        the input embedding's own unit comes before it and is prefetched (measured: the held-out
        torchtitan llama-h768 mixed-bf16 case, its V·h all-gather output in the first block's
        backward); a tied one is the head unit's, gathered already. Not for a ViT: its FSDP2 full-AC
        case in validation/records/accuracy_matrix_cpu.jsonl (3272cd9f97) measures a block's worth more there
        (−3.68 % without the block, +2.44 % with it; cause not found), so it keeps the block."""
        if step.gather_group == 1 or step.job.model.arch == "vit" or _one_unit(step):
            return block
        model, bp = step.job.model, step.block_params
        prefetched = []
        if step.fsdp_units == "blocks" and not model.tied_embeddings and step.strategy.reshard_after_forward:
            n = step.embedding_unit_params()
            prefetched = [_gathered(step, "fsdp.prefetched_embedding", n, "input embedding unit (backward prefetch)")]
        unsharded = _gathered(step, "fsdp.block", bp, "unsharded block")
        terms = [t for b in block for t in ([unsharded, *prefetched] if b.key == "fsdp.block" else [b])]
        return [t for t in terms if t.key != "fsdp.post_forward"] + _post_forward_copies(step, "first_copy")

    def accelerate(self, job, strategy) -> dict:
        # no-shard is FSDP1's alone; one unit (NO_WRAP) is measured under FSDP1
        v2 = strategy.id != "fsdp-no-shard" and not job.one_fsdp_unit
        return {
            "distributed_type": "FSDP",
            "fsdp_config": {
                "fsdp_version": 2 if v2 else 1,
                "fsdp_auto_wrap_policy": "NO_WRAP" if job.one_fsdp_unit else "TRANSFORMER_BASED_WRAP",
                "fsdp_reshard_after_forward": strategy.reshard_after_forward if v2 else "NO_SHARD",
                "fsdp_sharding_strategy": FSDP1_SHARDING[strategy.id],
                "fsdp_offload_params": job.plan.offload in ("params", "all"),
                "fsdp_activation_checkpointing": job.train.activation_checkpointing != "none",
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                "fsdp_cpu_ram_efficient_loading": True,
                "fsdp_use_orig_params": True,
            },
        }

    # accelerate's bf16/fp16 under FSDP sets a MixedPrecisionPolicy (accelerate 1.x,
    # FullyShardedDataParallelPlugin.set_mixed_precision): mixed-*, not autocast
    def accelerate_mixed_precision(self, job) -> str:
        return "no" if POLICIES[job.train.precision].autocast else super().accelerate_mixed_precision(job)

    def accelerate_note(self, job) -> str:
        policy = POLICIES[job.train.precision]
        if not policy.autocast:
            return ""
        dtype = TORCH_DTYPE[policy.compute_dtype]
        return (
            f"# {policy.id}: wrap the forward in torch.autocast('cuda', dtype={dtype}); "
            "accelerate's own mixed_precision would give FSDP a MixedPrecisionPolicy (mixed-*)\n"
        )
