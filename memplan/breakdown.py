"""The one result shape every estimate returns: integer bytes by component at the
peak moment, with the terms that add up to them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from .specs import Job


class Component(str, Enum):
    PARAMS = "params"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    BUFFERS = "buffers"


@dataclass(frozen=True)
class Term:
    """One named quantity of bytes with the formula that produced it (for ``explain``)."""

    component: Component
    name: str
    formula: str
    bytes: int
    key: str = ""
    """A stable identifier ("logits", "fsdp.root_unit"): what moments and later axes
    select a term by; the name is for display only."""

    def __init__(self, component: Component, name: str, formula: str, bytes: int, key: str = ""):
        # the fields written into the instance's dict: a frozen dataclass's own __init__ sets each
        # through object.__setattr__, at twice the cost, and an estimate makes thousands of terms
        d = self.__dict__
        d["component"], d["name"], d["formula"], d["bytes"], d["key"] = component, name, formula, bytes, key


def term(component: Component, key: str, name: str, formula: str, num_bytes) -> Term:
    """A ``Term`` keyed first, as the producers of terms write them."""
    return Term(component, name, formula, int(num_bytes), key)


@dataclass(frozen=True)
class Moment:
    """Live bytes at one instant of the step (a candidate for the peak)."""

    phase: str
    """forward | backward | optimizer"""
    label: str
    terms: tuple[Term, ...]

    @property
    def by_component(self) -> dict[Component, int]:
        out = dict.fromkeys(Component, 0)
        for term in self.terms:
            out[term.component] += term.bytes
        return out

    @cached_property  # the searches ask each moment many times
    def allocated_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)


class Fit(ABC):
    """What fitting means, once: a total against the usable memory (capacity less the headroom
    fraction). ``Estimate``, ``calibration.Corrected`` and the decision's ``Option`` are ones."""

    @property
    @abstractmethod
    def total_bytes(self) -> int:
        """Bytes on the GPU at the peak, overheads included."""

    @property
    @abstractmethod
    def usable_bytes(self) -> int:
        """What the job's cluster may use per GPU."""

    @property
    def headroom_bytes(self) -> int:
        """Usable memory minus total; negative: does not fit."""
        return self.usable_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


@dataclass(frozen=True)
class Estimate(Fit):
    """Peak per-GPU memory of one configuration."""

    job: Job
    peak: Moment
    moments: tuple[Moment, ...]
    overhead: tuple[Term, ...]
    host_bytes: int
    notes: tuple[str, ...] = field(default=())

    @property
    def phase(self) -> str:
        return self.peak.phase

    @property
    def by_component(self) -> dict[Component, int]:
        return self.peak.by_component

    @property
    def allocated_bytes(self) -> int:
        return self.peak.allocated_bytes

    @property
    def overhead_bytes(self) -> int:
        return sum(t.bytes for t in self.overhead)

    @property
    def total_bytes(self) -> int:
        return self.allocated_bytes + self.overhead_bytes

    @property
    def usable_bytes(self) -> int:
        return self.job.cluster.usable_bytes

    @property
    def moment_headrooms(self) -> tuple[int, ...]:
        """Headroom at each moment, the peak's overhead charged to all: their minimum is
        ``headroom_bytes``; the searches follow each one's slope in the micro-batch."""
        room = self.job.cluster.usable_bytes - self.overhead_bytes
        return tuple(room - m.allocated_bytes for m in self.moments)
