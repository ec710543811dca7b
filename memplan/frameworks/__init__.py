"""The frameworks a strategy runs under, one adapter module each; a new framework is a
new module and one entry here."""

from __future__ import annotations

from ..strategies import Strategy
from .base import Framework
from .ddp import DDP
from .deepspeed import DeepSpeed
from .fsdp import FSDP
from .single import Single

FRAMEWORKS: dict[str, Framework] = {f.id: f for f in (Single(), DDP(), FSDP(), DeepSpeed())}


def adapter(strategy: Strategy) -> Framework:
    """The adapter a strategy row (``memplan.strategies``: data, below the adapters) names."""
    return FRAMEWORKS[strategy.framework]


def runs_natively(strategy: Strategy, precision: str) -> bool:
    """Whether the strategy's framework has the precision policy built in (``Framework.native_precisions``)."""
    return precision in adapter(strategy).native_precisions


__all__ = ["FRAMEWORKS", "Framework", "adapter", "runs_natively"]
