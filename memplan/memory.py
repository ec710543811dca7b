"""The peak per-GPU bytes of a steady-state training step.

A step is walked through the instants where live memory can peak; each instant is a
``Moment`` made of named terms, and the estimate is the largest. Between these instants
memory moves linearly (activations freed, gradients produced block by block), so the
maximum over the step is at one of them.
"""
from __future__ import annotations

import math

from .activations import Saved, block_backward_transient, block_kept, loss_saved, model_saved
from .breakdown import Component, Estimate, Moment, Term
from .overheads import host_bytes, overhead_terms
from .precision import ADAM8BIT_BYTES_PER_PARAM, DTYPE_BYTES, OPTIMIZER_STATES, POLICIES
from .specs import Job
from .strategies import STRATEGIES

P, G, O, A, B = (Component.PARAMS, Component.GRADIENTS, Component.OPTIMIZER,
                 Component.ACTIVATIONS, Component.BUFFERS)


def _t(component, name, formula, num_bytes) -> Term:
    return Term(component, name, formula, int(num_bytes))


class _Step:
    """The quantities one job's moments are built from (all per GPU, in bytes)."""

    def __init__(self, job: Job):
        self.job = job
        model, train, cluster = job.model, job.train, job.cluster
        self.strategy = STRATEGIES[job.plan.strategy]
        self.policy = POLICIES[train.precision]
        self.n = self.strategy.shard_degree(cluster.gpus, cluster.gpus_per_node)
        self.params = model.num_params
        self.block_params = model.block_params()
        self.root_params = self.params - model.num_layers * self.block_params
        self.fsdp = self.strategy.framework == "fsdp"
        self.offload = job.plan.offload
        c = self.policy.compute_bytes
        # FSDP gathers parameters in MixedPrecisionPolicy.param_dtype, else in their own dtype
        self.c = c if self.policy.master_bytes else self.policy.param_bytes
        reduce = train.reduce_dtype
        self.reduce_bytes = DTYPE_BYTES[reduce] if reduce else (c if self.policy.low_precision_params else 4)

    def shard(self, count: int, sharded: bool) -> int:
        return math.ceil(count / self.n) if sharded else count

    # -- model states -------------------------------------------------------------
    def param_terms(self) -> list[Term]:
        s, pol = self.strategy, self.policy
        if self.fsdp and self.offload != "none":
            return [_t(P, "parameters", "offloaded to host RAM", 0)]
        if self.fsdp and pol.low_precision_params and pol.master_bytes:
            # FSDP MixedPrecision keeps the sharded parameter in fp32: it is the master copy
            count = self.shard(self.params, s.shards_params)
            return [_t(P, "sharded fp32 parameters (also the master copy)", f"4·P/{self.n}", 4 * count)]
        count = self.shard(self.params, s.shards_params)
        return [_t(P, "parameters", f"{pol.param_bytes}·P/{self.n if s.shards_params else 1}",
                   pol.param_bytes * count)]

    def grad_terms(self) -> list[Term]:
        s, pol = self.strategy, self.policy
        count = self.shard(self.params, s.shards_grads)
        if self.fsdp and self.offload != "none":
            return [_t(G, "gradients", "offloaded to host RAM", 0)]
        if self.fsdp and pol.low_precision_params and pol.master_bytes:
            return [_t(G, "sharded fp32 gradients", f"4·P/{self.n}", 4 * count)]
        return [_t(G, "gradients", f"{pol.grad_bytes}·P/{self.n if s.shards_grads else 1}",
                   pol.grad_bytes * count)]

    def optimizer_terms(self) -> list[Term]:
        s, pol, train = self.strategy, self.policy, self.job.train
        if self.offload in ("optimizer", "all") or (self.fsdp and self.offload != "none"):
            return [_t(O, "optimizer states", "offloaded to host RAM", 0)]
        count = self.shard(self.params, s.shards_optimizer)
        div = self.n if s.shards_optimizer else 1
        terms = []
        if train.optimizer == "adam8bit":
            terms.append(_t(O, "8-bit Adam states", f"2·(1 + 4/256)·P/{div}", ADAM8BIT_BYTES_PER_PARAM * count))
        elif OPTIMIZER_STATES[train.optimizer]:
            k = OPTIMIZER_STATES[train.optimizer]
            terms.append(_t(O, f"{train.optimizer} states", f"{k:g}·{pol.state_bytes}·P/{div}",
                            k * pol.state_bytes * count))
        if pol.master_bytes and not self.fsdp:
            terms.append(_t(O, "fp32 master weights", f"4·P/{div}", 4 * count))
        return terms

    def optimizer_step_transient(self) -> list[Term]:
        """Temporaries of optimizer.step() (torch/optim/adamw.py)."""
        train, pol = self.job.train, self.policy
        if train.optimizer not in ("adamw", "adam") or self.offload in ("optimizer", "all"):
            return []
        if self.fsdp and self.offload != "none":
            return []
        count = self.shard(self.params, self.strategy.shards_optimizer)
        if train.optimizer_impl == "foreach":
            # _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) for the whole group
            return [_t(B, "foreach sqrt(v) temporaries", f"{pol.state_bytes}·P_local", pol.state_bytes * count)]
        if train.optimizer_impl == "single":
            # _single_tensor_adam: exp_avg_sq.sqrt() / bias_correction2_sqrt: two live copies of the largest tensor
            largest = self.shard(self.largest_param(), self.strategy.shards_optimizer)
            return [_t(B, "single-tensor sqrt(v) temporaries", "2·state·largest param", 2 * pol.state_bytes * largest)]
        return []

    def largest_param(self) -> int:
        m = self.job.model
        embed = m.vocab_size * m.hidden if m.arch != "vit" else m.image_channels * m.patch_size**2 * m.hidden
        return max(embed, m.hidden * m.ffn_hidden, m.hidden * m.hidden)

    # -- framework buffers ------------------------------------------------------------
    def persistent_buffers(self) -> list[Term]:
        if self.strategy.framework == "ddp":
            # Reducer buckets: with gradient_as_bucket_view=False a second copy of every gradient
            return [_t(B, "DDP gradient buckets", f"{self.policy.grad_bytes}·P", self.policy.grad_bytes * self.params)]
        return []

    def unsharded(self, count: int, name: str) -> Term:
        return _t(B, name, f"{self.c}·{count:,} params", self.c * count)

    # -- moments -------------------------------------------------------------------------
    def moments(self) -> list[Moment]:
        job = self.job
        model, train = job.model, job.train
        L = model.num_layers
        states = self.param_terms() + self.optimizer_terms() + self.persistent_buffers()
        grads = self.grad_terms()
        carried_grads = grads if train.grad_accum > 1 else []
        blk = block_saved_total(job)
        saved_blocks = [_t(A, f"saved activations of {L} blocks", f"{L} × {blk.bytes:,} ({blk.formula})", L * blk.bytes)]
        pre, post = model_saved(model, train)
        loss_fwd, loss_bwd = loss_saved(model, train)
        fwd_live = [_t(A, s.name, s.formula, s.bytes) for s in (*pre, *post)]
        fsdp_fwd = self.fsdp_gathered(forward=True)
        fsdp_loss = self.fsdp_gathered(forward=True, loss_backward=True)
        out = [Moment("forward", "end of forward (cross-entropy)",
                      tuple(states + carried_grads + saved_blocks + fwd_live + fsdp_fwd +
                            [_t(A, s.name, s.formula, s.bytes) for s in loss_fwd]))]
        out.append(Moment("backward", "start of backward (loss gradient)",
                          tuple(states + carried_grads + saved_blocks + fwd_live + fsdp_loss +
                                [_t(A, s.name, s.formula, s.bytes) for s in loss_bwd])))
        transient = [_t(A, s.name, s.formula, s.bytes) for s in block_backward_transient(model, train)]
        head_grads = self.grad_share(self.root_params)
        logits_held = [t for t in fwd_live if t.name.startswith("logits")]
        out.append(Moment("backward", "backward of the last block",
                          tuple(states + (grads if train.grad_accum > 1 else head_grads) + saved_blocks +
                                logits_held + self.fsdp_gathered(forward=False, first=True) + transient)))
        one_block = [_t(A, "saved activations of block 1", blk.formula, blk.bytes)]
        out.append(Moment("backward", "backward of the first block",
                          tuple(states + grads + one_block + logits_held +
                                self.fsdp_gathered(forward=False, first=False) + transient)))
        out.append(Moment("optimizer", "optimizer step",
                          tuple(states + grads + self.optimizer_step_transient())))
        return out

    def grad_share(self, count: int) -> list[Term]:
        full = self.grad_terms()[0]
        return [_t(G, f"gradients of {count:,} params", "share of " + full.formula,
                   full.bytes * count // max(self.params, 1))]

    def fsdp_gathered(self, *, forward: bool, first: bool = False, loss_backward: bool = False) -> list[Term]:
        """Unsharded parameters (and gradients before reduce-scatter) that FSDP holds."""
        s = self.strategy
        if not self.fsdp:
            return []
        L = self.job.model.num_layers
        # the root unit (embeddings, final norm, head) is not resharded after forward (FSDP2 heuristic)
        terms = [self.unsharded(self.root_params, "unsharded root unit (embeddings, head)")]
        if not s.reshard_after_forward:
            terms.append(self.unsharded(L * self.block_params, f"unsharded {L} blocks (kept forward→backward)"))
        elif loss_backward:
            # the root's pre-backward hook prefetches the last block's all-gather
            terms.append(self.unsharded(self.block_params, "unsharded last block (backward prefetch)"))
        elif not forward:
            terms.append(self.unsharded(2 * self.block_params, "unsharded block + prefetched block"))
        if not forward:
            terms.append(_t(B, "unsharded block gradients + reduce-scatter input",
                            f"({self.c} + {self.reduce_bytes})·block params",
                            (self.c + self.reduce_bytes) * self.block_params))
        return terms


def block_saved_total(job: Job) -> Saved:
    saved = block_kept(job.model, job.train)
    return Saved("block", " + ".join(s.formula for s in saved), sum(s.bytes for s in saved))


def estimate(job: Job) -> Estimate:
    """Peak per-GPU memory of one configuration: the largest of the step's moments."""
    moments = _Step(job).moments()
    peak = max(moments, key=lambda m: m.allocated_bytes)
    return Estimate(job=job, peak=peak, moments=tuple(moments), overhead=tuple(overhead_terms(job, peak)),
                    host_bytes=host_bytes(job))
