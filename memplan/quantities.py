"""The quantities one job's step is built from, per GPU: the counts its strategy shards,
the policies it runs under, the model states (parameters, gradients, optimizer states) and the
optimizer step's temporaries. ``step.Step`` builds the moments from them; a framework adapter
reads them to size its buffers; ``parallel.step.RankStep`` counts them on one rank of a mesh."""

from __future__ import annotations

import math

from . import moe
from .breakdown import Component, Term, term
from .finetune import (
    PER_TENSOR,
    adafactor_step_elements,
    adapter_policy,
    finetune_param_terms,
    optimizer_state_terms,
    trained,
)
from .frameworks import adapter
from .loop import fsdp_units, loss_in_model
from .precision import ADAM8BIT_BYTES_PER_PARAM, DTYPE_BYTES, OPTIMIZER_STATES, POLICIES, Policy
from .saved import Saved
from .specs import Job
from .strategies import STRATEGIES

# one letter per component, as the paper's P/G/O notation (E741 dislikes the letter O)
P, G, O, B = (  # noqa: E741
    Component.PARAMS,
    Component.GRADIENTS,
    Component.OPTIMIZER,
    Component.BUFFERS,
)


class Quantities:
    """The quantities one job's moments are built from (per GPU, in bytes); what a framework
    adapter reads to size its buffers."""

    def __init__(self, job: Job, policy: Policy | None = None):
        self.job = job
        model, train, cluster = job.model, job.train, job.cluster
        self.strategy = s = STRATEGIES[job.plan.strategy]
        self.framework = fw = adapter(s)
        self.policy = pol = policy or POLICIES[train.precision]
        self.n = s.shard_degree(cluster.gpus, cluster.gpus_per_node)
        # FSDP2 on an all-gather group of one (no-shard's N×1 mesh, one GPU) copies a unit's
        # parameters out only when the unit runs: a prefetch allocates nothing
        # (FSDPParamGroup.unshard / wait_for_unshard, torch 2.13; measured: noshard-fp32-w4)
        self.gather_group = self.n if s.shards_params else 1
        self.params = model.num_params
        self.block_params = model.block_params()
        self.root_params = self.params - model.blocks_params()
        self.ep = job.plan.ep
        if model.num_experts:
            moe.check_moe_loop(train.loop)
        if self.ep > 1:  # expert parallel (memplan.moe): experts on their EP rank, FSDP over the rest
            moe.check_ep_step(job, s, self.n)
            self.block_params = moe.gathered_block_params(model, self.ep, self.n)
        # what the step trains (finetune.py): the gradient, optimizer and bucket terms count these
        self.trained = trained(model, train.tuning)
        self.train_policy = adapter_policy(pol) if self.trained.adapters else pol
        self.P = "P" if train.tuning.mode == "full" else "P_trained"
        offload = job.plan.offload
        moves_states = fw.offload_moves_states and offload != "none"
        self.states_on_host = moves_states or offload in ("optimizer", "all")
        self.params_on_host = moves_states or offload in ("params", "all")
        self.grads_on_host = fw.grads_on_host(self)
        self.shard_master = fw.shard_is_master and pol.master
        self.casts_block_inputs = self.shard_master and pol.compute_bytes < 4
        self.gather_bytes = pol.compute_bytes if pol.master else pol.param_bytes
        self.fsdp_units = fsdp_units(train.recipe)
        self.loss_in_model = loss_in_model(train.recipe)
        self._kept: dict[tuple[bool, bool, str], list[Saved]] = {}
        self._transient: dict[tuple[bool, bool, str], list[Term]] = {}
        reduce = train.reduce_dtype
        self.reduce_bytes = DTYPE_BYTES[reduce] if reduce else self.gather_bytes

    def local(self, count: int, sharded: bool) -> int:
        return math.ceil(count / self.n) if sharded else count

    def div(self, sharded: bool) -> str:
        return f"/{self.n}" if sharded and self.n > 1 else ""

    def local_params(self, sharded: bool) -> int:
        """This rank's parameters (or their shard); under EP its own experts' (``moe.local_params``)."""
        if self.ep == 1:
            return self.local(self.params, sharded)
        return moe.local_params(self.job.model, self.ep, self.n, sharded=sharded)

    def p_local(self, sharded: bool) -> str:
        """The formula's symbol for ``local_params``: P/n, or P_ep (the rest over n, experts over ep)."""
        return f"P{self.div(sharded)}" if self.ep == 1 else "P_ep"

    def trained_local(self, sharded: bool) -> int:
        """This rank's trained parameters: ``local_params`` in a full fine-tune, else the trained ones'."""
        return self.local_params(sharded) if self.P == "P" else self.local(self.trained.trainable, sharded)

    def trained_symbol(self, sharded: bool) -> str:
        return self.p_local(sharded) if self.P == "P" else f"{self.P}{self.div(sharded)}"

    # -- model states ----------------------------------------------------------------
    def param_terms(self) -> list[Term]:
        sharded = self.strategy.shards_params
        if self.params_on_host:
            return [term(P, "params", "parameters (in host RAM)", "offloaded", 0)]
        if self.job.train.tuning.mode != "full":
            return finetune_param_terms(self)
        nbytes = 4 if self.shard_master else self.policy.param_bytes
        name = "fp32 parameter shards (the master copy)" if self.shard_master else "parameters"
        return [term(P, "params", name, f"{nbytes}·{self.p_local(sharded)}", nbytes * self.local_params(sharded))]

    def grad_terms(self) -> list[Term]:
        sharded = self.strategy.shards_grads
        if self.grads_on_host:
            return [term(G, "grads", "gradients (in host RAM)", "offloaded", 0)]
        nbytes = 4 if self.shard_master else self.train_policy.grad_bytes
        return [
            term(
                G,
                "grads",
                "gradients",
                f"{nbytes}·{self.trained_symbol(sharded)}",
                nbytes * self.trained_local(sharded),
            )
        ]

    def optimizer_terms(self) -> list[Term]:
        train, pol, sharded = self.job.train, self.train_policy, self.strategy.shards_optimizer
        if self.states_on_host:
            return [term(O, "optimizer.states", "optimizer states (in host RAM)", "offloaded", 0)]
        count, div = self.trained_local(sharded), self.trained_symbol(sharded)
        terms = []
        if train.optimizer in PER_TENSOR and (train.optimizer != "adam8bit" or self.P != "P"):
            terms += optimizer_state_terms(self)
        elif train.optimizer == "adam8bit":
            terms.append(
                term(
                    O,
                    "optimizer.states",
                    "8-bit Adam states",
                    f"2·(1 + 4/256)·{div}",
                    ADAM8BIT_BYTES_PER_PARAM * count,
                )
            )
        elif OPTIMIZER_STATES[train.optimizer]:
            k = OPTIMIZER_STATES[train.optimizer]
            terms.append(
                term(
                    O,
                    "optimizer.states",
                    f"{train.optimizer} states",
                    f"{k:g}·{pol.state_bytes}·{div}",
                    k * pol.state_bytes * count,
                )
            )
        if pol.master and not self.shard_master:
            terms.append(term(O, "optimizer.master", "fp32 master weights", f"4·{div}", 4 * count))
        return terms

    def step_transient(self) -> list[Term]:
        """Temporaries of optimizer.step() on the GPU."""
        if self.states_on_host:
            return []
        return self.framework.step_buffers(self) + self.optimizer_temporaries()

    def optimizer_temporaries(self) -> list[Term]:
        train, pol, sharded = self.job.train, self.train_policy, self.strategy.shards_optimizer
        if train.optimizer == "torch-adafactor":
            foreach = train.optimizer_impl == "foreach"
            n = adafactor_step_elements(self, foreach=foreach)
            what = "Σ every trained tensor (foreach)" if foreach else "two consecutive tensors (for-loop)"
            return [
                term(
                    B,
                    "optimizer.adafactor_update",
                    "torch Adafactor var_estimate / update",
                    f"{pol.state_bytes}·{what}",
                    pol.state_bytes * self.local(n, sharded),
                )
            ]
        if train.optimizer == "adafactor":
            # transformers' Adafactor._approx_sq_grad: grad² and the factored estimate of the
            # largest tensor live at once, in fp32 (optimization.py Adafactor.step)
            largest = self.local(self.largest_trained(), sharded)
            return [
                term(B, "optimizer.adafactor_update", "Adafactor update temporaries", "2·4·largest tensor", 8 * largest)
            ]
        if train.optimizer not in ("adamw", "adam"):
            return []
        if train.optimizer_impl == "foreach":
            # _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) over the whole group
            return [
                term(
                    B,
                    "optimizer.sqrt_temporaries",
                    "foreach sqrt(v) temporaries",
                    f"{pol.state_bytes}·P_local",
                    pol.state_bytes * self.trained_local(sharded),
                )
            ]
        if train.optimizer_impl == "single":
            # _single_tensor_adam: exp_avg_sq.sqrt() / bias_correction2_sqrt, two copies of one tensor
            flat = self.framework.steps_flat_partition
            whole, one = (
                (self.params, self.largest_param())
                if self.P == "P"
                else (self.trained.trainable, self.largest_trained())
            )
            largest = self.local(whole if flat else one, sharded)
            what = f"{self.trained_symbol(sharded)} (one flat partition)" if flat else "largest tensor"
            return [
                term(
                    B,
                    "optimizer.sqrt_temporaries",
                    "single-tensor sqrt(v) temporaries",
                    f"2·{pol.state_bytes}·{what}",
                    2 * pol.state_bytes * largest,
                )
            ]
        return []

    def largest_trained(self) -> int:
        return self.largest_param() if self.P == "P" else self.trained.largest

    def largest_param(self) -> int:
        m = self.job.model
        embed = m.vocab_size * m.hidden if m.arch != "vit" else m.image_channels * m.patch_size**2 * m.hidden
        experts = moe.largest_expert_tensor(m, self.ep) if m.num_experts else 0
        return max(embed, m.hidden * m.ffn_hidden, m.hidden * m.hidden, experts)

    def zero_filled(self) -> bool:
        """Whether the loop clears gradients with zeros (``zero_grad(set_to_none=False)``): they
        stay allocated from one step's optimizer step through the next forward."""
        return self.job.train.zero_grad == "zeros"

    def first_weight_grad(self) -> int:
        """Parameters of the first weight gradient a block's backward makes: its MLP output
        projection's (and bias), the last linear of its forward (measured: the FSDP2 and the
        single / DDP full-AC peaks inside the first block's backward hold it alone of the block's)."""
        model = self.job.model
        return model.hidden * model.ffn_hidden + (model.hidden if model.linear_bias else 0)

    def own_block_grads(self) -> int:
        """Parameters of the first block whose gradients are not yet counted inside its backward."""
        return self.block_params if self.framework.block_grads_after_reduce else 0

    def pending_params(self) -> int:
        """The input embedding's parameters, whose gradient comes last (none apart when tied)."""
        model = self.job.model
        return model.embedding_params() - (model.vocab_size * model.hidden if model.tied_embeddings else 0)

    # -- the vocabulary side as this rank holds it (RankStep: a TP rank's slices, a stage's share) --
    def vocab_params(self) -> int:
        """One V·h vocabulary matrix (the token embedding's or the head's weight)."""
        m = self.job.model
        return m.vocab_size * m.hidden

    def embedding_unit_params(self) -> int:
        """torchtitan's / accelerate's input embedding unit: an untied token embedding (a tied one
        is the head unit's)."""
        return 0 if self.job.model.tied_embeddings else self.vocab_params()

    def head_unit_params(self) -> int:
        """torchtitan's / accelerate's [final norm, lm head] unit, a tied embedding in it."""
        m = self.job.model
        return m.head_params() + (self.vocab_params() if m.tied_embeddings else 0)

    def head_weight_params(self) -> int:
        """The final norm and the head's V·h weight, tied or not."""
        return self.job.model.norm_params + self.vocab_params()

    def grad_share(self, count: int, what: str) -> list[Term]:
        full = self.grad_terms()[0]
        return [
            term(
                G,
                "grads",
                f"gradients of {count:,} {what}",
                f"{full.formula} × share",
                full.bytes * count // max(self.trained.trainable, 1),
            )
        ]
