"""The instants of a step where live memory can peak, declared as data: each ``MomentSpec``
names the groups of terms live at it. The step (``memplan.step``) declares the moments every
job has; a framework adapter (``memplan.frameworks``) or a parallel dimension
(``memplan.parallel``) inserts its own beside a moment it names, never at a position."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MomentSpec:
    """One instant of the step: the groups of terms live at it, in display order."""

    name: str
    """A stable name that other moments are inserted beside (``insert``)."""
    phase: str
    label: str
    groups: tuple[str, ...]


def _index(specs: tuple[MomentSpec, ...], name: str) -> int:
    for i, spec in enumerate(specs):
        if spec.name == name:
            return i
    raise KeyError(f"no moment named {name!r} among {', '.join(s.name for s in specs)}")


def insert(
    specs: tuple[MomentSpec, ...],
    *new: MomentSpec,
    before: str | None = None,
    after: str | None = None,
    instead: str | None = None,
) -> tuple[MomentSpec, ...]:
    """``specs`` with ``new`` placed before, after or instead of the moment of that name."""
    (anchor,) = (a for a in (before, after, instead) if a is not None)
    i = _index(specs, anchor)
    start = i + 1 if after is not None else i
    end = i + 1 if instead is not None else start
    return (*specs[:start], *new, *specs[end:])
