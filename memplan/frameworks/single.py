"""A plain training loop on one GPU: no wrapper, so no buckets or gather buffers
(torchtune's single-device recipes, a bare Hugging Face Trainer)."""

from __future__ import annotations

from .base import Framework


class Single(Framework):
    id = "none"
    label = "no wrapper"
    # autocast (torch.amp) and a model cast to bf16, but no fp32 master copy behind
    # low-precision weights: that needs FSDP's MixedPrecisionPolicy or DeepSpeed's optimizer
    native_precisions = ("fp32", "amp-bf16", "amp-fp16", "bf16")
    distributed = False
    has_first_block_end = True  # measured: the head-dim matrix's qwen3 single full-AC case

    def accelerate(self, job, strategy) -> dict:
        return {"distributed_type": "NO"}
