"""DistributedDataParallel: replicated states plus the Reducer's gradient buckets."""

from __future__ import annotations

from ..breakdown import Component, term
from .base import Framework
from .single import Single


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
        return [term(Component.BUFFERS, "ddp.buckets", "DDP gradient buckets", f"{nbytes}·{symbol}", nbytes * count)]

    def accelerate(self, job, strategy) -> dict:
        return {"distributed_type": "MULTI_GPU"}
