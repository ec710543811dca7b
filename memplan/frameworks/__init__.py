"""The frameworks a strategy runs under, one adapter module each; a new framework is a
new module and one entry here."""

from __future__ import annotations

from .base import Framework
from .ddp import DDP
from .deepspeed import DeepSpeed
from .fsdp import FSDP
from .single import Single

FRAMEWORKS: dict[str, Framework] = {f.id: f for f in (Single(), DDP(), FSDP(), DeepSpeed())}

__all__ = ["FRAMEWORKS", "Framework"]
