"""Fine-tuning: which parameters a step trains, and what that changes in memory.

``--finetune`` names the mode: ``full`` (every parameter, the default), ``lora`` (peft's LoRA
adapters on frozen base weights), ``qlora`` (LoRA on 4-bit NF4 base weights) or ``frozen:N``
(the input embedding and the first N blocks frozen, the rest trained in full).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from .activations import Saved, shapes
from .breakdown import Component, Term
from .errors import InputError
from .frameworks.base import term
from .precision import Policy

P, O = Component.PARAMS, Component.OPTIMIZER

MODES = ("full", "lora", "qlora", "frozen:N")
TARGET_SETS = ("attention", "all-linear")
"""``attention``: every projection of the attention (q, k, v, o); ``all-linear``: every linear
layer of the blocks (peft's ``all-linear``, which leaves the output head out)."""


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """What one step trains (validated when built by ``tuning``)."""

    mode: str
    """full | lora | qlora | frozen."""
    frozen_blocks: int = 0
    """frozen:N: the first N blocks (and the input embedding) get no gradient."""
    rank: int = 8
    alpha: float = 16.0
    """LoRA's scaling numerator: it scales the adapter's output and changes no memory."""
    targets: tuple[str, ...] = ()
    """The block projections that carry an adapter (``LINEARS``' names)."""
    dropout: float = 0.0

    @property
    def adapters(self) -> bool:
        return self.mode in ("lora", "qlora")

    def describe(self) -> str:
        if self.mode == "frozen":
            return f"frozen:{self.frozen_blocks} (input embedding and first {self.frozen_blocks} blocks frozen)"
        if not self.adapters:
            return "full"
        drop = f", dropout {self.dropout:g}" if self.dropout else ""
        return f"{self.mode} rank {self.rank} on {','.join(self.targets)}{drop}"


LINEARS = {
    "llama": ("q", "k", "v", "o", "gate", "up", "down"),
    "gpt2": ("qkv", "o", "up", "down"),
    "neox": ("qkv", "o", "up", "down"),
    "vit": ("q", "k", "v", "o", "up", "down"),
}
"""The linear layers of one block per family, by the names ``--lora-targets`` takes."""
ATTENTION = ("q", "k", "v", "qkv", "o")


def _bad(field: str, value, accepted: str) -> InputError:
    return InputError(
        lambda n: f"{n.word(field)} {value!r} is not accepted; give {accepted}",
        field=field,
        value=value,
        accepted=accepted,
    )


def _targets(value: str) -> tuple[str, ...]:
    """The names a target list gives (``q,v``; peft's ``q_proj`` style too)."""
    if value in TARGET_SETS:
        return (value,)
    names = tuple(dict.fromkeys(n.strip().removesuffix("_proj") for n in value.split(",") if n.strip()))
    known = {n for names in LINEARS.values() for n in names}
    if not names or any(n not in known for n in names):
        raise _bad("lora_targets", value, f"attention, all-linear or a list of {', '.join(sorted(known))}")
    return names


@lru_cache(maxsize=256)
def tuning(mode: str, rank: int, alpha: float, targets: str, dropout: float) -> Tuning:
    """The ``Tuning`` of TrainSpec's fine-tuning fields, checked."""
    if mode.startswith("frozen:"):
        count = mode.removeprefix("frozen:")
        if not count.isdigit() or int(count) < 1:
            raise _bad("finetune", mode, "full, lora, qlora or frozen:N with N ≥ 1 blocks")
        return Tuning(mode="frozen", frozen_blocks=int(count))
    if mode not in MODES[:3]:
        raise _bad("finetune", mode, "full, lora, qlora or frozen:N")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad("lora_rank", rank, "a positive integer")
    if not 0.0 <= dropout < 1.0:
        raise _bad("lora_dropout", dropout, "a probability in [0, 1)")
    return Tuning(mode=mode, rank=rank, alpha=float(alpha), targets=_targets(targets), dropout=float(dropout))

