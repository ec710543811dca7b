"""The peak per-GPU bytes of a steady-state training step.

A step is walked through the instants where live memory can peak; each instant is a
``Moment`` made of named terms, and the estimate is the largest. Between these instants
memory moves monotonically (activations freed and gradients produced block by block), so
the maximum over the step is at one of them. Which instant wins, and by how much, was
checked against real DDP / FSDP2 steps (``calibrate/matrix.py``, README).

Which terms live at each instant is declared as data (``MOMENTS``): a moment lists groups
of terms by key; each framework adapter (``memplan.frameworks``) fills the groups it owns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .activations import Saved, block_backward_transient, block_kept, loss_saved, model_saved
from .breakdown import Component, Estimate, Moment, Term
from .frameworks.base import term
from .overheads import overhead_terms
from .precision import ADAM8BIT_BYTES_PER_PARAM, DTYPE_BYTES, OPTIMIZER_STATES, POLICIES, Policy
from .specs import Job
from .strategies import STRATEGIES

# one letter per component, as the paper's P/G/O notation (E741 dislikes the letter O)
P, G, O, A, B = (Component.PARAMS, Component.GRADIENTS, Component.OPTIMIZER,  # noqa: E741
                 Component.ACTIVATIONS, Component.BUFFERS)


def _terms(component: Component, saved: list[Saved], key: str) -> list[Term]:
    """Terms of saved tensors, keyed by their own key or else by the group's."""
    return [term(component, s.key or key, s.name, s.formula, s.bytes) for s in saved]


@dataclass(frozen=True, kw_only=True)
class MomentSpec:
    """One instant of the step: the groups of terms live at it, in display order."""

    phase: str
    label: str
    groups: tuple[str, ...]


MOMENTS = (
    MomentSpec(phase="forward", label="end of forward (cross-entropy)",
               groups=("states", "grads.carried", "activations.blocks", "activations.outside", "logits",
                       "gathered.forward", "loss.forward")),
    MomentSpec(phase="backward", label="start of backward (loss gradient)",
               groups=("states", "grads.carried", "activations.blocks", "activations.outside", "logits",
                       "gathered.loss", "loss.backward")),
    MomentSpec(phase="backward", label="backward of the last block",
               groups=("states", "grads.last_block", "activations.blocks", "logits", "gathered.block",
                       "block.backward")),
    MomentSpec(phase="backward", label="backward of the first block",
               groups=("states", "grads.first_block", "activations.first_block", "logits", "gathered.block",
                       "block.backward")),
    MomentSpec(phase="optimizer", label="optimizer step", groups=("states", "grads", "optimizer.step")),
)


class Step:
    """The quantities one job's moments are built from (per GPU, in bytes); what a framework
    adapter reads to size its buffers."""

    def __init__(self, job: Job, policy: Policy | None = None):
        self.job = job
        model, train, cluster = job.model, job.train, job.cluster
        self.strategy = s = STRATEGIES[job.plan.strategy]
        self.framework = fw = s.adapter
        self.policy = pol = policy or POLICIES[train.precision]
        self.n = s.shard_degree(cluster.gpus, cluster.gpus_per_node)
        # FSDP2 on an all-gather group of one (no-shard's N×1 mesh, one GPU) copies a unit's
        # parameters out only when the unit runs: a prefetch allocates nothing
        # (FSDPParamGroup.unshard / wait_for_unshard, torch 2.13; measured: noshard-fp32-w4)
        self.gather_group = self.n if s.shards_params else 1
        self.params = model.num_params
        self.block_params = model.block_params()
        self.root_params = self.params - model.num_layers * self.block_params
        offload = job.plan.offload
        moves_states = fw.offload_moves_states and offload != "none"
        self.states_on_host = moves_states or offload in ("optimizer", "all")
        self.params_on_host = moves_states or offload in ("params", "all")
        self.grads_on_host = fw.offload_moves_states and self.params_on_host
        self.shard_master = fw.shard_is_master and pol.master
        self.casts_block_inputs = self.shard_master and pol.compute_bytes < 4
        self.gather_bytes = pol.compute_bytes if pol.master else pol.param_bytes
        reduce = train.reduce_dtype
        self.reduce_bytes = DTYPE_BYTES[reduce] if reduce else self.gather_bytes

    def local(self, count: int, sharded: bool) -> int:
        return math.ceil(count / self.n) if sharded else count

    def div(self, sharded: bool) -> str:
        return f"/{self.n}" if sharded and self.n > 1 else ""

    # -- model states ----------------------------------------------------------------
    def param_terms(self) -> list[Term]:
        sharded = self.strategy.shards_params
        if self.params_on_host:
            return [term(P, "params", "parameters (in host RAM)", "offloaded", 0)]
        nbytes = 4 if self.shard_master else self.policy.param_bytes
        name = "fp32 parameter shards (the master copy)" if self.shard_master else "parameters"
        return [term(P, "params", name, f"{nbytes}·P{self.div(sharded)}", nbytes * self.local(self.params, sharded))]

    def grad_terms(self) -> list[Term]:
        sharded = self.strategy.shards_grads
        if self.grads_on_host:
            return [term(G, "grads", "gradients (in host RAM)", "offloaded", 0)]
        nbytes = 4 if self.shard_master else self.policy.grad_bytes
        return [term(G, "grads", "gradients", f"{nbytes}·P{self.div(sharded)}",
                     nbytes * self.local(self.params, sharded))]

    def optimizer_terms(self) -> list[Term]:
        train, pol, sharded = self.job.train, self.policy, self.strategy.shards_optimizer
        if self.states_on_host:
            return [term(O, "optimizer.states", "optimizer states (in host RAM)", "offloaded", 0)]
        count, div = self.local(self.params, sharded), self.div(sharded)
        terms = []
        if train.optimizer == "adam8bit":
            terms.append(term(O, "optimizer.states", "8-bit Adam states", f"2·(1 + 4/256)·P{div}",
                              ADAM8BIT_BYTES_PER_PARAM * count))
        elif OPTIMIZER_STATES[train.optimizer]:
            k = OPTIMIZER_STATES[train.optimizer]
            terms.append(term(O, "optimizer.states", f"{train.optimizer} states", f"{k:g}·{pol.state_bytes}·P{div}",
                              k * pol.state_bytes * count))
        if pol.master and not self.shard_master:
            terms.append(term(O, "optimizer.master", "fp32 master weights", f"4·P{div}", 4 * count))
        return terms

    def step_transient(self) -> list[Term]:
        """Temporaries of optimizer.step() on the GPU."""
        if self.states_on_host:
            return []
        return self.framework.step_buffers(self) + self.optimizer_temporaries()

    def optimizer_temporaries(self) -> list[Term]:
        train, pol, sharded = self.job.train, self.policy, self.strategy.shards_optimizer
        if train.optimizer not in ("adamw", "adam"):
            return []
        if train.optimizer_impl == "foreach":
            # _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) over the whole group
            return [term(B, "optimizer.sqrt_temporaries", "foreach sqrt(v) temporaries", f"{pol.state_bytes}·P_local",
                         pol.state_bytes * self.local(self.params, sharded))]
        if train.optimizer_impl == "single":
            # _single_tensor_adam: exp_avg_sq.sqrt() / bias_correction2_sqrt, two copies of one tensor
            largest = self.local(self.largest_param(), sharded)
            return [term(B, "optimizer.sqrt_temporaries", "single-tensor sqrt(v) temporaries",
                         f"2·{pol.state_bytes}·largest tensor", 2 * pol.state_bytes * largest)]
        return []

    def largest_param(self) -> int:
        m = self.job.model
        embed = m.vocab_size * m.hidden if m.arch != "vit" else m.image_channels * m.patch_size**2 * m.hidden
        return max(embed, m.hidden * m.ffn_hidden, m.hidden * m.hidden)

    # -- the groups of terms the moments are declared from ------------------------------
    def groups(self) -> dict[str, list[Term]]:
        states = self.param_terms() + self.optimizer_terms() + self.framework.persistent_buffers(self)
        gathered = {f"gathered.{i}": self.framework.gathered(self, i) for i in ("forward", "loss", "block")}
        return {"states": states, **self.grad_groups(), **self.activation_groups(), **gathered,
                "optimizer.step": self.step_transient()}

    def grad_groups(self) -> dict[str, list[Term]]:
        model, grads = self.job.model, self.grad_terms()
        if self.job.train.grad_accum > 1:
            # with accumulation, earlier micro-batches' gradients are live all through the step
            return {"grads": grads, "grads.carried": grads, "grads.last_block": grads, "grads.first_block": grads}
        # the input embedding's gradient comes last, after the first block's backward (a tied
        # embedding already has it from the head)
        pending = model.embedding_params() - (model.vocab_size * model.hidden if model.tied_embeddings else 0)
        own = self.block_params if self.framework.block_grads_after_reduce else 0
        what = "params (all but the input embedding" + (" and the first block)" if own else ")")
        return {"grads": grads, "grads.carried": [],
                "grads.last_block": self.grad_share(self.root_params, "embedding/head params"),
                "grads.first_block": self.grad_share(self.params - pending - own, what)}

    def activation_groups(self) -> dict[str, list[Term]]:
        model, train, L = self.job.model, self.job.train, self.job.model.num_layers
        kept = block_kept(model, train, inputs_cast=self.casts_block_inputs)
        per_block, formula = sum(s.bytes for s in kept), " + ".join(s.formula for s in kept)
        pre, post = model_saved(model, train)
        outside = _terms(A, pre + post, "activations.outside")
        loss_fwd, loss_bwd = loss_saved(model, train)
        transient = block_backward_transient(model, train, inputs_cast=self.casts_block_inputs)
        return {
            "activations.blocks": [term(A, "activations.blocks", f"kept activations of {L} blocks",
                                        f"{L} × ({formula})", L * per_block)],
            "activations.first_block": [term(A, "activations.first_block", "kept activations of the first block",
                                             formula, per_block)],
            "activations.outside": [t for t in outside if t.key != "logits"],
            "logits": [t for t in outside if t.key == "logits"],
            "loss.forward": _terms(A, loss_fwd, "loss.forward"),
            "loss.backward": _terms(A, loss_bwd, "loss.backward"),
            "block.backward": _terms(A, transient, "block.backward"),
        }

    def moments(self) -> list[Moment]:
        groups = self.groups()
        return [Moment(m.phase, m.label, tuple(t for g in m.groups for t in groups[g])) for m in MOMENTS]

    def grad_share(self, count: int, what: str) -> list[Term]:
        full = self.grad_terms()[0]
        return [term(G, "grads", f"gradients of {count:,} {what}", f"{full.formula} × share",
                     full.bytes * count // max(self.params, 1))]

    def host_terms(self) -> list[Term]:
        """Host RAM per GPU for what is offloaded."""
        if self.job.plan.offload == "none":
            return []
        on_gpu = Step(self.job.with_(offload="none"))
        terms = on_gpu.optimizer_terms() if self.states_on_host else []
        if self.params_on_host:
            terms += on_gpu.param_terms() + (on_gpu.grad_terms() if self.grads_on_host else [])
        return terms


def model_states(job: Job, policy: Policy | None = None) -> dict[Component, int]:
    """Parameters, gradients and optimizer states per GPU, optionally under a policy
    other than the six named ones (to redo a document's arithmetic on its own terms)."""
    step = Step(job, policy)
    out = dict.fromkeys((P, G, O), 0)
    for t in step.param_terms() + step.grad_terms() + step.optimizer_terms():
        out[t.component] += t.bytes
    return out


@lru_cache(maxsize=4096)
def estimate(job: Job) -> Estimate:
    """Peak per-GPU memory of one configuration: the largest of the step's moments."""
    step = Step(job)
    moments = step.moments()
    peak = max(moments, key=lambda m: m.allocated_bytes)
    host = sum(t.bytes for t in step.host_terms())
    return Estimate(job=job, peak=peak, moments=tuple(moments), overhead=tuple(overhead_terms(job, peak)),
                    host_bytes=host)
