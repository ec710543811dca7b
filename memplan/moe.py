"""Mixture of experts: parameters, saved activations and expert parallelism.

Sources: transformers 5.23 ``models/mixtral/modeling_mixtral.py`` (MixtralTopKRouter,
MixtralExperts' eager forward), ``qwen2_moe`` (the gated shared expert), ``qwen3_moe``
(decoder_sparse_step), ``deepseek_v3`` (first_k_dense_replace, the shared experts as one
MLP of n_shared_experts × moe_intermediate_size); torchtitan 0.3.0
``models/common/token_dispatcher.py`` (AllToAllTokenDispatcher: argsort by expert, an
all-to-all of the k·T routed rows out and back).

Every formula takes the expert-parallel degree ``ep`` as an argument: where it comes from
(``Plan.ep`` today) is the caller's business.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

from .errors import MemplanError
from .saved import Saved, Shapes
from .shapes import shapes
from .specs import MOE_FIELDS as MOE_FIELDS  # the MoE sub-spec of a ModelSpec: its fields, their check
from .specs import ModelSpec, expert_params, expert_width, moe_block_param_counts, num_moe_layers  # and its counts
from .specs import is_moe_layer as is_moe_layer


def all_blocks_alike(model: ModelSpec) -> bool:
    return not model.num_experts or num_moe_layers(model) == model.num_layers


def dense_view(model: ModelSpec) -> ModelSpec:
    """An MoE model's dense layers as a model of their own (SwiGLU of ``ffn_hidden``)."""
    defaults: dict[str, Any] = {f.name: f.default for f in fields(model) if f.name in MOE_FIELDS}
    return replace(model, **defaults)


def fsdp_traffic_params(model: ModelSpec, ep: int, ranks: int) -> float:
    """The parameter count whose ring collectives over ``ranks`` move what FSDP moves under EP:
    the rest over all of them, each rank's E/ep experts over the ranks/ep that share them, a
    ring's (m-1)/m per byte (none on one rank)."""
    experts = routed_expert_params(model)
    group = ranks // ep
    share = (group - 1) / group / ((ranks - 1) / ranks) if ranks > 1 else 0.0
    return model.num_params - experts + experts / ep * share


def largest_expert_tensor(model: ModelSpec, ep: int) -> int:
    """transformers keeps a layer's experts as 3-D tensors: gate_up_proj (E/ep × 2f × h) is one."""
    return model.num_experts // ep * 2 * expert_width(model) * model.hidden


def moe_matrices(model: ModelSpec) -> int:
    """A sparse block's MLP weight matrices (what autocast caches a copy of)."""
    counts = moe_block_param_counts(model)
    return counts["router"] + counts["experts"] + counts["shared_expert"]


def routed_expert_params(model: ModelSpec) -> int:
    """Every routed expert of every sparse layer: what expert parallelism shards."""
    return num_moe_layers(model) * model.num_experts * expert_params(model)


def active_params(model: ModelSpec) -> int:
    """Parameters one token runs through: top-k of the routed experts (the FLOPs' count)."""
    if not model.num_experts:
        return model.num_params
    idle = model.num_experts - model.experts_per_token
    return model.num_params - num_moe_layers(model) * idle * expert_params(model)


# -- expert parallelism -----------------------------------------------------------------


def check_ep(model: ModelSpec, ep: int, gpus: int) -> None:
    """``ep`` divides the GPUs and the experts; a dense model takes ep 1 only."""
    if ep == 1:
        return
    if not model.num_experts:
        raise MemplanError(f"ep {ep} needs a mixture-of-experts model; {model.name} is dense (use ep 1)")
    if model.num_experts % ep:
        raise MemplanError(f"ep {ep} does not divide num_experts {model.num_experts}; use a divisor of it")
    if gpus % ep:
        raise MemplanError(f"ep {ep} does not divide gpus {gpus}; use a divisor of the GPU count")


def local_params(model: ModelSpec, ep: int, shards: int, *, sharded: bool) -> int:
    """Parameters one rank holds. Routed experts live on their EP rank (E/ep of them);
    a sharded strategy shards the rest over all ``shards`` ranks and the local experts over
    the ``shards/ep`` ranks that hold the same experts (torchtitan's dp_mod_ep FSDP mesh)."""
    experts = routed_expert_params(model)
    rest = model.num_params - experts
    if not sharded:
        return rest + math.ceil(experts / ep)
    return math.ceil(rest / shards) + math.ceil(experts / ep / max(shards // ep, 1))


def local_block_params(model: ModelSpec, ep: int) -> int:
    """One sparse block as FSDP gathers it under EP: everything but the other ranks' experts."""
    idle = model.num_experts - model.num_experts // ep
    return model.block_params() - idle * expert_params(model)


def routed_rows(tokens: int, model: ModelSpec, ep: int) -> int:
    """Routed token copies one rank's experts process for its ``tokens``: dropless, k·T with a
    balanced router (exactly k·T without EP); with a capacity factor C each of the E/ep local
    experts takes ⌈C·k·T·ep/E⌉ rows of the ep ranks' tokens, padded to it (GShard §2.2)."""
    k, E, C = model.experts_per_token, model.num_experts, model.capacity_factor
    if C:
        return (E // ep) * math.ceil(C * k * tokens * ep / E)
    return k * tokens


def dropless_bound_rows(tokens: int, model: ModelSpec, ep: int) -> int:
    """Dropless worst case: every EP rank sends all its tokens here, each token at most
    min(k, E/ep) copies (its top-k experts are distinct)."""
    return ep * tokens * min(model.experts_per_token, model.num_experts // ep)


def ep_notes(job) -> tuple[str, ...]:
    """What a dropless EP estimate assumes of the router."""
    ep, model = job.plan.ep, job.model
    if ep == 1 or model.capacity_factor:
        return ()
    tokens = job.train.tokens_per_micro_batch
    return (
        f"ep {ep}, dropless: a balanced router is assumed ({routed_rows(tokens, model, ep):,} routed rows per "
        f"rank and sparse layer); a skewed one can send a rank up to {dropless_bound_rows(tokens, model, ep):,}",
    )


def moe_saved(model: ModelSpec, x: Shapes, rows: int, ep: int = 1) -> list[Saved]:
    """What one sparse block's MLP keeps for backward, ``rows`` routed copies on this rank
    (k·T at balance). Measured with saved-tensor hooks on transformers' MixtralSparseMoeBlock
    and Qwen2MoeSparseMoeBlock (eager experts, tests/test_moe.py); under EP what
    calibrate/moe_ep.py's torchtitan-style dispatch keeps (validation/records/moe_matrix_cpu.jsonl)."""
    t, h, E, k, f, c = x.tokens, x.h, model.num_experts, model.experts_per_token, expert_width(model), x.c
    # softmax(logits.float()) keeps its fp32 output, topk its int64 indices; the in-place
    # renormalisation (top / top.sum) keeps the fp32 sum and the result
    norm = 4 * t + 4 * t * k if model.normalize_top_k else 0
    weight = 4 if model.top_k_weights_fp32 else c
    saved = [
        Saved("router softmax (fp32)", "4·b·s·E", 4 * t * E),
        Saved("router top-k indices (+ renormalised weights)", "8·b·s·k (+ 4·b·s·(k + 1))", 8 * t * k + norm),
        # every routed copy: its input rows, gate_up output (2f), silu output, the product
        Saved("expert inputs (routed copies)", "c·k·b·s·h", c * rows * h),
        Saved("expert gate/up, silu, product", "4·c·k·b·s·f_e", 4 * c * rows * f),
    ]
    if ep == 1:
        # transformers' eager loop: the down output and the weighted output index_add_ keeps,
        # torch.where's int64 (position, token) pair (one storage) and the copy's weight
        saved += [
            Saved("expert outputs, weighted outputs", "2·c·k·b·s·h", 2 * c * rows * h),
            Saved("routing indices and weights", f"(16 + {weight})·k·b·s", (16 + weight) * rows),
        ]
    else:
        # the dispatcher: the rows back from the combine all-to-all (kept by the fp32 weighting),
        # their weights, and four int64 permutations (expert order, token of each copy,
        # regroup by local expert, its inverse)
        saved += [
            Saved("combined expert outputs", "c·k·b·s·h", c * rows * h),
            Saved("dispatch permutations and weights", "(32 + 4)·k·b·s", 36 * rows),
        ]
    if model.shared_ffn_hidden:
        fs = model.shared_ffn_hidden
        saved.append(Saved("shared expert gate, silu, up, product", "4·c·b·s·f_s", 4 * c * t * fs))
    if model.shared_expert_gate:
        # sigmoid(gate(x)) * shared(x) keeps the shared output and the sigmoid's
        saved.append(Saved("shared expert output, sigmoid gate", "c·b·s·(h + 1)", c * t * (h + 1)))
    return saved


def allows_ep(strategy, ep: int) -> bool:
    """EP composes with FSDP (torchtitan's): the experts' own mesh inside the data-parallel one."""
    return ep == 1 or strategy.framework == "fsdp"


def check_ep_step(job, strategy, shards: int) -> None:
    """Expert parallelism as torchtitan composes it: FSDP over the rest, ep dividing the GPUs,
    the experts and, where FSDP shards them too, the shard group."""
    model, ep = job.model, job.plan.ep
    check_ep(model, ep, job.cluster.gpus)
    if not allows_ep(strategy, ep):
        raise MemplanError(
            f"ep {ep} is modelled with FSDP over the non-expert parameters (torchtitan's composition), "
            f"not with {strategy.id}; use an fsdp strategy"
        )
    if strategy.shards_params and shards % ep:
        raise MemplanError(f"ep {ep} does not divide the FSDP shard group of {shards} GPUs; use a divisor of it")


def gathered_block_params(model: ModelSpec, ep: int, shards: int) -> int:
    """What FSDP all-gathers of a sparse block under EP: its non-expert parameters, plus its
    E/ep local experts where they are sharded over the shards/ep ranks that hold them
    (torchtitan's dp_mod_ep mesh); over one rank they stay whole and are not gathered."""
    local = local_block_params(model, ep)
    if shards // ep > 1:
        return local
    return local - (model.num_experts // ep) * expert_params(model)


def ep_kept(saved: list[Saved], model: ModelSpec, train, ep: int) -> list[Saved]:
    """A sparse block's kept (or backward) tensors under EP: the eager loop's replaced by the
    dispatcher's, the experts' gradients by the local experts' (a checkpointed block keeps
    its input only: nothing to replace)."""
    x = shapes(model, train)
    rows = routed_rows(x.tokens, model, ep)
    out = list(saved)
    for eager, parallel in (
        (moe_saved(model, x, rows), moe_saved(model, x, rows, ep)),
        (moe_backward_transient(model, x), moe_backward_transient(model, x, ep)),
    ):
        names = {s.name for s in eager}
        if names & {s.name for s in out}:
            out = [s for s in out if s.name not in names] + parallel
    return out


def moe_backward_transient(model: ModelSpec, x: Shapes, ep: int = 1) -> list[Saved]:
    """Live while a sparse block runs its backward, beyond what it kept: indexing one expert
    out of the 3-D ``gate_up_proj`` / ``down_proj`` (``self.gate_up_proj[e]``) has a backward
    that makes a zero gradient of the whole tensor, summed expert after expert, so the
    accumulated and the newest full-size expert gradients are live at once; plus the
    gradients flowing into the experts and the router (b·s·h each). Measured on CPU
    (MemTracker's Temp at the DDP backward peak, validation/records/moe_matrix_cpu.jsonl)."""
    g = 4 if x.autocast else x.c  # the experts' gradients are in their parameters' dtype
    local = model.num_experts // ep * expert_params(model)
    return [
        Saved("expert gradients: accumulated + newest (full size)", "2·g·E_local·3·h·f_e", 2 * g * local),
        Saved("gradients into the experts and the router", "2·c·b·s·h", 2 * x.c * x.tokens * x.h),
    ]


def a2a_buffers(model: ModelSpec, train, ep: int) -> list[Saved]:
    """The all-to-all's send and receive buffers of one sparse block (routed rows × h each),
    live while the block's dispatch or combine runs, forward and backward."""
    x = shapes(model, train)
    rows = routed_rows(x.tokens, model, ep)
    return [Saved("all-to-all send + receive buffers", "2·c·k·b·s·h", 2 * x.c * rows * x.h)]


def check_moe_loop(loop) -> None:
    """The loop conventions whose MoE blocks are not modelled (they would count a dense MLP)."""
    if loop.ac == "op" or loop.compile:
        what = "ac op (torchtitan's per-op SAC)" if loop.ac == "op" else "compile"
        raise MemplanError(f"{what} is not modelled for mixture-of-experts blocks; use ac none, selective or full")


def without_block_grads(terms: list) -> list:
    """FSDP's block moment without its unsharded block gradients and reduce-scatter input: those
    appear once a sparse block's backward is done, when the expert loop's full-size gradient
    accumulators (``moe_backward_transient``, the larger) are gone (measured: the FSDP cases
    of validation/records/moe_matrix_cpu.jsonl peak inside the loop)."""
    return [t for t in terms if t.key != "fsdp.block_grads"]
