"""The record every producer of saved tensors returns (activations, loss, checkpointing,
fine-tuning, MoE, MLA), and the symbols their formulas are written in (``Shapes``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Saved:
    name: str
    formula: str
    bytes: int
    key: str = ""
    """Stable identifier for the tensors a moment selects by itself (``step.MOMENTS``)."""

    def __init__(self, name: str, formula: str, bytes: int, key: str = ""):
        # as ``breakdown.Term``'s: the fields written into the instance's dict (the hot path)
        d = self.__dict__
        d["name"], d["formula"], d["bytes"], d["key"] = name, formula, bytes, key


@dataclass(frozen=True)
class Shapes:
    b: int
    s: int
    h: int
    q: int
    """a·d: the query and attention output width (``ModelSpec.q_hidden``)."""
    kv: int
    a: int
    d: int
    f: int
    V: int
    c: int
    r: int
    m: int
    p: float
    autocast: bool
    attention: str
    """flash (sdpa's fused kernels), eager, or math-fp32: CPU sdpa with dropout falls back
    to the math path (the CPU flash kernel has no dropout), which upcasts to fp32 (measured)."""
    kv_saved: int
    """Width of the k and v attention saves: kv under sdpa's own grouped-query path; q (a·d)
    where they are copied to every query head first (eager's repeat_kv; torchtune's attention,
    ``loop.kv_copies``)."""

    @property
    def tokens(self) -> int:
        return self.b * self.s


GRADIENT_TEMPORARIES = "block backward gradient temporaries"
"""The name of a block's backward gradient temporaries (``activations.block_backward_transient``),
which the fine-tune and recompute moments look up."""
