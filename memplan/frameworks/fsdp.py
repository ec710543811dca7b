"""FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``): sharded states, the
unsharded units around the one that runs, and the reduce-scatter input."""

from __future__ import annotations

from typing import ClassVar

from ..breakdown import Component
from ..precision import POLICIES
from .base import TORCH_DTYPE, Emitter, Framework, header, needs, term

B = Component.BUFFERS
FSDP1_SHARDING = {
    "fsdp-full-shard": "FULL_SHARD",
    "fsdp-shard-grad-op": "SHARD_GRAD_OP",
    "fsdp-hybrid-shard": "HYBRID_SHARD",
    "fsdp-no-shard": "NO_SHARD",
}
FSDP2_STRATEGIES = ("fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard")
"""The strategies ``fully_shard`` writes (no-shard is FSDP1's NO_SHARD)."""


def _gathered(step, key: str, count: int, name: str):
    return term(B, key, name, f"{step.gather_bytes}·{count:,}", step.gather_bytes * count)


def _dtypes(job) -> tuple[str, str]:
    """(compute dtype, reduce dtype) of the policy: mixed-bf16 -> (bf16, bf16 unless --reduce-dtype)."""
    compute = POLICIES[job.train.precision].compute_dtype
    return compute, job.train.reduce_dtype or compute


def _mp_args(job) -> str:
    """MixedPrecisionPolicy / MixedPrecision arguments. Under autocast (amp-*) the parameters
    stay fp32 as estimated: no param_dtype, only an explicit --reduce-dtype."""
    compute, reduce = _dtypes(job)
    if POLICIES[job.train.precision].autocast:
        return f"reduce_dtype={TORCH_DTYPE[reduce]}" if job.train.reduce_dtype else ""
    return f"param_dtype={TORCH_DTYPE[compute]}, reduce_dtype={TORCH_DTYPE[reduce]}"


def _autocast_lines(job) -> list[str]:
    """The forward under torch.autocast, for amp-* (FSDP's mixed precision would be mixed-*)."""
    policy = POLICIES[job.train.precision]
    if not policy.autocast:
        return []
    return [
        "",
        "",
        "def forward(model: torch.nn.Module, *args, **kwargs):",
        f"    # {policy.id}: fp32 parameters and gradients, the forward under autocast",
        f'    with torch.autocast("cuda", dtype={TORCH_DTYPE[policy.compute_dtype]}):',
        "        return model(*args, **kwargs)",
    ]


def _ac_lines(job, indent: str) -> list[str]:
    ac = job.train.activation_checkpointing
    if ac == "none":
        return []
    target = "block_cls" if ac == "full" else "attention_cls"
    note = "each block's input kept, the block recomputed" if ac == "full" else "attention recomputed"
    return [
        f"{indent}# activation checkpointing {ac}: {note}",
        f"{indent}apply_activation_checkpointing(",
        (
            f"{indent}    model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, "
            "checkpoint_impl=CheckpointImpl.NO_REENTRANT),"
        ),
        f"{indent}    check_fn=lambda m: isinstance(m, {target}))",
    ]


def _ac_imports(job) -> list[str]:
    if job.train.activation_checkpointing == "none":
        return []
    return [
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
        "    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)",
    ]


def fsdp2_snippet(job, strategy) -> str:
    """``fully_shard`` per block, then the root (torchtitan's parallelize order: AC first)."""
    needs(job, "fsdp2", FSDP2_STRATEGIES)
    c, mp = job.cluster, _mp_args(job)
    mesh = (
        f'init_device_mesh("cuda", ({c.num_nodes}, {c.gpus_per_node}), mesh_dim_names=("replicate", "shard"))'
        if strategy.shard_group == "node"
        else f'init_device_mesh("cuda", ({c.gpus},))'
    )
    offload = job.plan.offload in ("params", "all")
    imported = "CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy" if mp else "CPUOffloadPolicy, OffloadPolicy"
    policies = "mp_policy=mp, offload_policy=offload" if mp else "offload_policy=offload"
    lines = [
        f"# {header(job)}",
        "import functools",
        "",
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        f"from torch.distributed.fsdp import {imported}, fully_shard",
        *_ac_imports(job),
        "",
        "",
        "def wrap(model: torch.nn.Module, block_cls: type, attention_cls: type | None = None) -> torch.nn.Module:",
        f"    mesh = {mesh}",
        *([f"    mp = MixedPrecisionPolicy({mp})"] if mp else []),
        f"    offload = {'CPUOffloadPolicy()' if offload else 'OffloadPolicy()'}",
        *_ac_lines(job, "    "),
        "    # shard each block (or the checkpoint wrapper around it), then the root",
        "    wrappers = {id(getattr(m, '_checkpoint_wrapped_module', None)): m for m in model.modules()}",
        "    for block in [m for m in model.modules() if isinstance(m, block_cls)]:",
        (
            f"        fully_shard(wrappers.get(id(block), block), mesh=mesh, {policies}, "
            f"reshard_after_forward={strategy.reshard_after_forward})"
        ),
        f"    fully_shard(model, mesh=mesh, {policies}, reshard_after_forward=False)",
        "    return model",
        *_autocast_lines(job),
        "",
    ]
    return "\n".join(lines)


def fsdp1_snippet(job, strategy) -> str:
    """``FullyShardedDataParallel`` with a transformer auto-wrap policy per block."""
    needs(job, "fsdp1", tuple(FSDP1_SHARDING))
    compute, _ = _dtypes(job)
    mp, offload = _mp_args(job), job.plan.offload in ("params", "all")
    if mp and not POLICIES[job.train.precision].autocast:
        mp += f", buffer_dtype={TORCH_DTYPE[compute]}"
    lines = [
        f"# {header(job)}",
        "import functools",
        "",
        "import torch",
        (
            "from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, "
            f"{'MixedPrecision, ' if mp else ''}ShardingStrategy"
        ),
        "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy",
        *_ac_imports(job),
        "",
        "",
        "def wrap(model: torch.nn.Module, block_cls: type, attention_cls: type | None = None) -> torch.nn.Module:",
        "    model = FSDP(",
        "        model,",
        f"        sharding_strategy=ShardingStrategy.{FSDP1_SHARDING[strategy.id]},",
        "        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls}),",
        *([f"        mixed_precision=MixedPrecision({mp}),"] if mp else []),
        f"        cpu_offload=CPUOffload(offload_params={offload}),",
        "        device_id=torch.cuda.current_device(),",
        "    )",
        *_ac_lines(job, "    "),
        "    return model",
        *_autocast_lines(job),
        "",
    ]
    return "\n".join(lines)


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
    """FSDP2 full shard's buffers in a block's backward (``memory.FSDP_BLOCK_MOMENTS``; torch 2.13
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
    gathers = step.gather_group > 1  # a group of one copies in place, retains nothing (memory.py)
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

    def gathered(self, step, instant: str) -> list:
        s, L, bp = step.strategy, step.job.model.num_layers, step.block_params
        if instant == "start":
            return _forward_start(step)
        if instant.split("_")[0] in ("first", "upper", "lower", "last"):
            return [
                _gathered(step, key, count, name) for key, count, name in _outside_blocks(step, "block") if count
            ] + _block_backward(step, instant)
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
        return terms

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
        case in docs/accuracy_matrix_cpu.jsonl (3272cd9f97) measures a block's worth more there
        (−3.68 % without the block, +2.44 % with it; cause not found), so it keeps the block."""
        if step.gather_group == 1 or step.job.model.arch == "vit":
            return block
        model, bp = step.job.model, step.block_params
        prefetched = []
        if step.fsdp_units == "blocks" and not model.tied_embeddings and step.strategy.reshard_after_forward:
            n = step.embedding_unit_params()
            prefetched = [_gathered(step, "fsdp.prefetched_embedding", n, "input embedding unit (backward prefetch)")]
        unsharded = _gathered(step, "fsdp.block", bp, "unsharded block")
        return [t for b in block for t in ([unsharded, *prefetched] if b.key == "fsdp.block" else [b])]

    def accelerate(self, job, strategy) -> dict:
        v2 = strategy.id != "fsdp-no-shard"
        return {
            "distributed_type": "FSDP",
            "fsdp_config": {
                "fsdp_version": 2 if v2 else 1,
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
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
