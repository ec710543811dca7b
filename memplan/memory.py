"""The peak per-GPU bytes of a steady-state training step.

A step is walked through the instants where live memory can peak; each instant is a
``Moment`` made of named terms, and the estimate is the largest. Between these instants
memory moves monotonically (activations freed and gradients produced block by block), so
the maximum over the step is at one of them. Which instant wins, and by how much, was
checked against real DDP / FSDP2 steps (``calibrate/matrix.py``, README).
"""
from __future__ import annotations

import math
from functools import lru_cache

from .activations import Saved, block_backward_transient, block_kept, loss_saved, model_saved
from .breakdown import Component, Estimate, Moment, Term
from .catalog import deepspeed_defaults
from .overheads import overhead_terms
from .precision import ADAM8BIT_BYTES_PER_PARAM, DTYPE_BYTES, OPTIMIZER_STATES, POLICIES, Policy
from .specs import Job
from .strategies import STRATEGIES

P, G, O, A, B = (Component.PARAMS, Component.GRADIENTS, Component.OPTIMIZER,
                 Component.ACTIVATIONS, Component.BUFFERS)


def _t(component: Component, name: str, formula: str, num_bytes) -> Term:
    return Term(component, name, formula, int(num_bytes))


def _terms(component: Component, saved: list[Saved]) -> list[Term]:
    return [_t(component, s.name, s.formula, s.bytes) for s in saved]


class _Step:
    """The quantities one job's moments are built from (per GPU, in bytes)."""

    def __init__(self, job: Job, policy: Policy | None = None):
        self.job = job
        model, train, cluster = job.model, job.train, job.cluster
        self.strategy = s = STRATEGIES[job.plan.strategy]
        self.policy = pol = policy or POLICIES[train.precision]
        self.n = s.shard_degree(cluster.gpus, cluster.gpus_per_node)
        # FSDP2 on an all-gather group of one (no-shard's N×1 mesh, one GPU) copies a unit's
        # parameters out only when the unit runs: a prefetch allocates nothing
        # (FSDPParamGroup.unshard / wait_for_unshard, torch 2.13; measured: noshard-fp32-w4)
        self.gather_group = self.n if s.shards_params else 1
        self.params = model.num_params
        self.block_params = model.block_params()
        self.root_params = self.params - model.num_layers * self.block_params
        self.framework = s.framework
        offload = job.plan.offload
        # FSDP's CPUOffloadPolicy moves parameters, gradients and the optimizer step together
        fsdp_offload = s.framework == "fsdp" and offload != "none"
        self.states_on_host = fsdp_offload or offload in ("optimizer", "all")
        self.params_on_host = fsdp_offload or offload in ("params", "all")
        # FSDP MixedPrecisionPolicy: the fp32 shard is the master copy; gathered in param_dtype
        self.fsdp_master = s.framework == "fsdp" and pol.master_bytes > 0
        self.casts_block_inputs = self.fsdp_master and pol.compute_bytes < 4
        self.gather_bytes = pol.compute_bytes if pol.master_bytes else pol.param_bytes
        reduce = train.reduce_dtype
        self.reduce_bytes = DTYPE_BYTES[reduce] if reduce else self.gather_bytes

    def local(self, count: int, sharded: bool) -> int:
        return math.ceil(count / self.n) if sharded else count

    def _div(self, sharded: bool) -> str:
        return f"/{self.n}" if sharded and self.n > 1 else ""

    # -- model states ----------------------------------------------------------------
    def param_terms(self) -> list[Term]:
        sharded = self.strategy.shards_params
        if self.params_on_host:
            return [_t(P, "parameters (in host RAM)", "offloaded", 0)]
        nbytes = 4 if self.fsdp_master else self.policy.param_bytes
        name = "fp32 parameter shards (the master copy)" if self.fsdp_master else "parameters"
        return [_t(P, name, f"{nbytes}·P{self._div(sharded)}", nbytes * self.local(self.params, sharded))]

    def grad_terms(self) -> list[Term]:
        sharded = self.strategy.shards_grads
        if self.framework == "fsdp" and self.params_on_host:
            return [_t(G, "gradients (in host RAM)", "offloaded", 0)]
        nbytes = 4 if self.fsdp_master else self.policy.grad_bytes
        return [_t(G, "gradients", f"{nbytes}·P{self._div(sharded)}", nbytes * self.local(self.params, sharded))]

    def optimizer_terms(self) -> list[Term]:
        train, pol, sharded = self.job.train, self.policy, self.strategy.shards_optimizer
        if self.states_on_host:
            return [_t(O, "optimizer states (in host RAM)", "offloaded", 0)]
        count, div = self.local(self.params, sharded), self._div(sharded)
        terms = []
        if train.optimizer == "adam8bit":
            terms.append(_t(O, "8-bit Adam states", f"2·(1 + 4/256)·P{div}", ADAM8BIT_BYTES_PER_PARAM * count))
        elif OPTIMIZER_STATES[train.optimizer]:
            k = OPTIMIZER_STATES[train.optimizer]
            terms.append(_t(O, f"{train.optimizer} states", f"{k:g}·{pol.state_bytes}·P{div}",
                            k * pol.state_bytes * count))
        if pol.master_bytes and not self.fsdp_master:
            terms.append(_t(O, "fp32 master weights", f"4·P{div}", 4 * count))
        return terms

    def step_transient(self) -> list[Term]:
        """Temporaries of optimizer.step() on the GPU."""
        train, pol, sharded = self.job.train, self.policy, self.strategy.shards_optimizer
        if self.states_on_host:
            return []
        terms = []
        if self.framework == "deepspeed" and pol.master_bytes:
            # stage_1_and_2.py: reduced bf16 gradients are copied into an fp32 partition for the step
            terms.append(_t(B, "fp32 gradient partition", f"4·P{self._div(sharded)}",
                            4 * self.local(self.params, sharded)))
        if train.optimizer not in ("adamw", "adam"):
            return terms
        count = self.local(self.params, sharded)
        if train.optimizer_impl == "foreach":
            # _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) over the whole group
            terms.append(_t(B, "foreach sqrt(v) temporaries", f"{pol.state_bytes}·P_local", pol.state_bytes * count))
        elif train.optimizer_impl == "single":
            # _single_tensor_adam: exp_avg_sq.sqrt() / bias_correction2_sqrt, two copies of one tensor
            largest = self.local(self.largest_param(), sharded)
            terms.append(_t(B, "single-tensor sqrt(v) temporaries", f"2·{pol.state_bytes}·largest tensor",
                            2 * pol.state_bytes * largest))
        return terms

    def largest_param(self) -> int:
        m = self.job.model
        embed = m.vocab_size * m.hidden if m.arch != "vit" else m.image_channels * m.patch_size**2 * m.hidden
        return max(embed, m.hidden * m.ffn_hidden, m.hidden * m.hidden)

    # -- framework buffers ------------------------------------------------------------
    def persistent_buffers(self) -> list[Term]:
        if self.framework == "ddp":
            # Reducer buckets: with gradient_as_bucket_view=False a second copy of every gradient
            nbytes = self.policy.grad_bytes
            return [_t(B, "DDP gradient buckets", f"{nbytes}·P", nbytes * self.params)]
        return []

    def _gathered(self, count: int, name: str) -> Term:
        return _t(B, name, f"{self.gather_bytes}·{count:,}", self.gather_bytes * count)

    def gathered(self, instant: str) -> list[Term]:
        """Unsharded parameters and gradient buffers held at ``instant``: forward,
        loss (start of backward) or block (inside a block's backward)."""
        if self.framework == "fsdp":
            return self._fsdp_gathered(instant)
        if self.framework == "deepspeed":
            return self._zero_buffers(instant)
        return []

    def _fsdp_gathered(self, instant: str) -> list[Term]:
        s, L = self.strategy, self.job.model.num_layers
        # FSDP2 does not reshard the root unit after forward: backward needs it at once
        terms = [self._gathered(self.root_params, "unsharded root unit (embeddings, head)")]
        if not s.reshard_after_forward:
            terms.append(self._gathered(L * self.block_params, f"unsharded {L} blocks (forward→backward)"))
        elif instant == "loss" and self.gather_group > 1:
            # the root's pre-backward hook prefetches the last block's all-gather (measured)
            terms.append(self._gathered(self.block_params, "unsharded last block (backward prefetch)"))
        elif instant == "block":
            both = self.gather_group > 1
            terms.append(self._gathered((2 if both else 1) * self.block_params,
                                        "unsharded block + prefetched block" if both else "unsharded block"))
        if instant == "block":
            terms.append(_t(B, "unsharded block gradients + reduce-scatter input",
                            f"({self.gather_bytes} + {self.reduce_bytes})·block params",
                            (self.gather_bytes + self.reduce_bytes) * self.block_params))
        return terms

    def _zero_buffers(self, instant: str) -> list[Term]:
        ds, s = deepspeed_defaults(), self.strategy
        terms = []
        if s.shards_params:
            prefetch = min(ds["stage3_prefetch_bucket_size"], self.block_params)
            live = self.block_params if instant != "loss" else max(self.block_params, self.root_params)
            terms.append(self._gathered(live + prefetch, "gathered unit + prefetch bucket (ZeRO-3)"))
        if instant != "forward":
            # backward() allocates an ipg bucket of reduce_bucket_size elements (contiguous_gradients)
            bucket = ds["reduce_bucket_size"]
            terms.append(_t(B, "ipg reduce bucket", f"{self.policy.grad_bytes}·reduce_bucket_size ({bucket:.0e})",
                            self.policy.grad_bytes * bucket))
        return terms

    # -- moments ----------------------------------------------------------------------
    def moments(self) -> list[Moment]:
        model, train = self.job.model, self.job.train
        L = model.num_layers
        states = self.param_terms() + self.optimizer_terms() + self.persistent_buffers()
        grads = self.grad_terms()
        # with accumulation, earlier micro-batches' gradients are live during forward
        carried = grads if train.grad_accum > 1 else []
        kept = block_kept(model, train, inputs_cast=self.casts_block_inputs)
        per_block = sum(s.bytes for s in kept)
        formula = " + ".join(s.formula for s in kept)
        all_blocks = [_t(A, f"kept activations of {L} blocks", f"{L} × ({formula})", L * per_block)]
        one_block = [_t(A, "kept activations of the first block", formula, per_block)]
        pre, post = model_saved(model, train)
        outside = _terms(A, pre + post)
        logits = [t for t in outside if t.name.startswith("logits")]
        loss_fwd, loss_bwd = loss_saved(model, train)
        transient = _terms(A, block_backward_transient(model, train, inputs_cast=self.casts_block_inputs))
        head_grads = self.grad_share(self.root_params, "embedding/head params")
        # the input embedding's gradient comes last, after the first block's backward (a tied
        # embedding already has it from the head)
        pending = model.embedding_params() - (model.vocab_size * model.hidden if model.tied_embeddings else 0)
        # and under FSDP the first block's sharded gradients exist only after its reduce-scatter:
        # inside its backward they are the unsharded block gradients of `gathered` (measured;
        # DDP's appear during the block's backward, so there the count stays whole)
        own = self.block_params if self.framework == "fsdp" else 0
        what = "params (all but the input embedding" + (" and the first block)" if own else ")")
        first_grads = grads if carried else self.grad_share(self.params - pending - own, what)
        return [
            Moment("forward", "end of forward (cross-entropy)",
                   tuple(states + carried + all_blocks + outside + self.gathered("forward") + _terms(A, loss_fwd))),
            Moment("backward", "start of backward (loss gradient)",
                   tuple(states + carried + all_blocks + outside + self.gathered("loss") + _terms(A, loss_bwd))),
            Moment("backward", "backward of the last block",
                   tuple(states + (grads if carried else head_grads) + all_blocks + logits +
                         self.gathered("block") + transient)),
            Moment("backward", "backward of the first block",
                   tuple(states + first_grads + one_block + logits + self.gathered("block") + transient)),
            Moment("optimizer", "optimizer step", tuple(states + grads + self.step_transient())),
        ]

    def grad_share(self, count: int, what: str) -> list[Term]:
        full = self.grad_terms()[0]
        return [_t(G, f"gradients of {count:,} {what}", f"{full.formula} × share",
                   full.bytes * count // max(self.params, 1))]

    def host_terms(self) -> list[Term]:
        """Host RAM per GPU for what is offloaded."""
        if self.job.plan.offload == "none":
            return []
        on_gpu = _Step(self.job.with_(offload="none"))
        terms = on_gpu.optimizer_terms() if self.states_on_host else []
        if self.params_on_host:
            terms += on_gpu.param_terms() + (on_gpu.grad_terms() if self.framework == "fsdp" else [])
        return terms


def model_states(job: Job, policy: Policy | None = None) -> dict[Component, int]:
    """Parameters, gradients and optimizer states per GPU, optionally under a policy
    other than the six named ones (to redo a document's arithmetic on its own terms)."""
    step = _Step(job, policy)
    out = dict.fromkeys((P, G, O), 0)
    for term in step.param_terms() + step.grad_terms() + step.optimizer_terms():
        out[term.component] += term.bytes
    return out


@lru_cache(maxsize=4096)
def estimate(job: Job) -> Estimate:
    """Peak per-GPU memory of one configuration: the largest of the step's moments."""
    step = _Step(job)
    moments = step.moments()
    peak = max(moments, key=lambda m: m.allocated_bytes)
    host = sum(t.bytes for t in step.host_terms())
    return Estimate(job=job, peak=peak, moments=tuple(moments), overhead=tuple(overhead_terms(job, peak)),
                    host_bytes=host)
