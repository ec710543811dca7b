"""What autograd saves for backward, read with saved-tensor hooks: each storage once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch


def saved_storages(
    forward: Callable[[], object],
    *,
    skip: Iterable[torch.Tensor] = (),
    autocast: contextlib.AbstractContextManager | None = None,
    scalars: bool = True,
) -> dict[int, int]:
    """{storage address: bytes} of the tensors ``forward()`` saves for backward, leaving out
    the storages of ``skip`` (parameters, inputs) and, with ``scalars=False``, 0-d tensors."""
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skipped and (scalars or t.dim() > 0):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast or contextlib.nullcontext():
        forward()
    return seen


def saved_bytes(forward: Callable[[], object], **options) -> int:
    """Bytes of the distinct storages ``forward()`` saves (``saved_storages``' options)."""
    return sum(saved_storages(forward, **options).values())
