"""DistributedDataParallel: replicated states plus the Reducer's gradient buckets.

The buckets (torch/csrc/distributed/c10d/reducer.cpp ``initialize_buckets``) are flat tensors that
together hold every trained parameter's gradient, whatever ``bucket_cap_mb`` splits them into;
``static_graph`` changes only the first step's bucketing. With ``gradient_as_bucket_view`` each
gradient, once made, is copied into its bucket and becomes a view of it
(``Reducer::mark_variable_ready_dense``: ``grad = bucket_view``), so no second copy outlives
the backward op that made it (measured: validation/records/ddp_kwargs_cpu.md).
"""

from __future__ import annotations

from ..breakdown import Component, Term, term
from .base import Framework
from .single import Single

BACKWARD_GRADS = ("grads.last_block", "grads.first_block", "grads.first_block_end", "grads.last_checkpointed")
"""The groups of the gradients live inside the backward (``step.Step._grad_groups``)."""


class DDP(Framework):
    id = "ddp"
    label = "DistributedDataParallel"
    native_precisions = Single.native_precisions
    has_first_block_end = True  # measured: the tuned DDP full-AC eager record

    def persistent_buffers(self, step) -> list:
        # Reducer buckets: with gradient_as_bucket_view=False a second copy of every gradient
        nbytes = step.train_policy.grad_bytes  # the trained parameters' gradients only
        count = step.trained_local(sharded=False)
        symbol = step.trained_symbol(sharded=False)
        what = "DDP gradient buckets" + (" (the gradients are views of them)" if _views(step) else "")
        return [term(Component.BUFFERS, "ddp.buckets", what, f"{nbytes}·{symbol}", nbytes * count)]

    def grads_at_step(self, step) -> bool:
        # with bucket views the optimizer steps the buckets: no gradient of its own is left
        return not _views(step)

    def moment_groups(self, step, groups: dict[str, list[Term]]) -> dict[str, list[Term]]:
        """With bucket views and the gradients made in this backward alone (or zero-filled, then
        views from one step to the next), the backward holds one gradient beyond the buckets: the
        one just made, before it is copied in, at most the largest parameter's (measured: the head's
        at the optimizer-step shape's backward peak). Under accumulation, the micro-batches run in
        ``no_sync`` make gradients of their own (set to None between steps), live until the last
        micro-batch's backward copies them in (measured: the same peak as without views)."""
        train = step.job.train
        if not _views(step) or train.optimizer_in_backward:
            return {}
        if train.grad_accum > 1 and not step.zero_filled():
            return {}
        one = step.one_gradient("gradient just made, before its bucket takes it (the largest)")

        def in_flight(held: list[Term]) -> list[Term]:  # never more than the copies hold then
            return held if sum(t.bytes for t in held) <= sum(t.bytes for t in one) else one

        return {"grads.carried": [], **{key: in_flight(groups[key]) for key in BACKWARD_GRADS if key in groups}}

    def accelerate(self, job, strategy) -> dict:
        return {"distributed_type": "MULTI_GPU"}


def _views(step) -> bool:
    """``DistributedDataParallel(gradient_as_bucket_view=True)``."""
    return step.job.plan.gradient_as_bucket_view
