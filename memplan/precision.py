"""Bytes per element of each tensor family under the six precision policies."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class Policy:
    id: str
    compute_dtype: str
    """fp32 | bf16 | fp16: the dtype the matmuls run in (under autocast, the cast-to dtype)."""
    param_bytes: int
    """The model's own parameters (the replicated copy under DDP, the shard under FSDP)."""
    compute_bytes: int
    """Matmul inputs and outputs: the activation dtype."""
    stream_bytes: int
    """The residual stream between blocks (fp32 under autocast: fp32 + bf16 adds up to fp32)."""
    grad_bytes: int
    master_bytes: int
    """fp32 master copy kept by the optimizer when the parameters are low precision."""
    state_bytes: int
    autocast: bool = False
    """torch.autocast around the forward: fp32 parameters, matmuls in ``compute_dtype``."""

    @property
    def low_precision_params(self) -> bool:
        return self.param_bytes < 4

    @property
    def master(self) -> bool:
        """An fp32 master copy sits behind low-precision parameters (mixed-*)."""
        return self.master_bytes > 0

    @property
    def param_dtype(self) -> str:
        return self.compute_dtype if self.low_precision_params else "fp32"


POLICIES = {
    p.id: p
    for p in (
        Policy(
            id="fp32",
            compute_dtype="fp32",
            param_bytes=4,
            compute_bytes=4,
            stream_bytes=4,
            grad_bytes=4,
            master_bytes=0,
            state_bytes=4,
        ),
        Policy(
            id="amp-bf16",
            compute_dtype="bf16",
            param_bytes=4,
            compute_bytes=2,
            stream_bytes=4,
            grad_bytes=4,
            master_bytes=0,
            state_bytes=4,
            autocast=True,
        ),
        Policy(
            id="amp-fp16",
            compute_dtype="fp16",
            param_bytes=4,
            compute_bytes=2,
            stream_bytes=4,
            grad_bytes=4,
            master_bytes=0,
            state_bytes=4,
            autocast=True,
        ),
        Policy(
            id="mixed-bf16",
            compute_dtype="bf16",
            param_bytes=2,
            compute_bytes=2,
            stream_bytes=2,
            grad_bytes=2,
            master_bytes=4,
            state_bytes=4,
        ),
        Policy(
            id="mixed-fp16",
            compute_dtype="fp16",
            param_bytes=2,
            compute_bytes=2,
            stream_bytes=2,
            grad_bytes=2,
            master_bytes=4,
            state_bytes=4,
        ),
        Policy(
            id="bf16",
            compute_dtype="bf16",
            param_bytes=2,
            compute_bytes=2,
            stream_bytes=2,
            grad_bytes=2,
            master_bytes=0,
            state_bytes=2,
        ),
    )
}

# Optimizer states per parameter, in units of the policy's state dtype; adam8bit keeps
# two 1-byte states plus one fp32 absmax per 256-element block (bitsandbytes blockwise).
OPTIMIZER_STATES = {"adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd-momentum": 1.0}
ADAM8BIT_BYTES_PER_PARAM = 2 * (1 + 4 / 256)
