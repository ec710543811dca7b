"""What every report shares: numbers as a reader reads them (GiB to two decimals, tokens/s
to the unit) and the header that names the job."""

from __future__ import annotations

from typing import TypeVar

from ..finetune import finetune_line
from ..inputs import ModelChoice
from ..loop import in_force
from ..units import gib

_T = TypeVar("_T")


def num_gib(num_bytes: int) -> str:
    return f"{gib(num_bytes):.2f}"


def header(choice: ModelChoice, job, searched: tuple[str, ...] = ()) -> str:
    c, t = job.cluster, job.train
    model = ("assumed " if choice.assumed else "") + job.model.describe()
    layout = "" if job.layout.is_data_parallel else f"\nlayout   {job.layout.describe()} × dp {job.dp} (per rank below)"
    return (
        f"model    {model}\n"
        f"training seq {t.seq_len} × micro-batch {t.micro_batch} × accum {t.grad_accum}, {t.precision}, "
        f"{t.optimizer} ({t.optimizer_impl}), AC {t.activation_checkpointing}, {t.attention} attention\n"
        f"loop     {in_force(t, searched).describe()}\n"
        f"{finetune_line(job)}"
        f"cluster  {c.gpus} × {c.gpu_name} {num_gib(c.gpu_mem_bytes)} GiB ({c.num_nodes} node(s) of "
        f"{c.gpus_per_node}), headroom {c.headroom:.0%}: {num_gib(c.usable_bytes)} GiB usable"
        f"{layout}" + "".join(f"\nassumed  {line}" for line in choice.assumptions)
    )


def claim_text(rule) -> str:
    lo, hi = rule.claimed_rel_min, rule.claimed_rel_max
    return f"{lo:.2f}" if lo == hi else f"{lo:.2f}–{hi:.2f}"


def given(value: _T | None) -> _T:
    """A field of a decision record that its code sets (decide fills each code's own fields)."""
    assert value is not None, "decide sets this field for this record's code"
    return value


def gib_text(num_bytes: int) -> str:
    return f"{num_gib(num_bytes)} GiB"


def tokens_text(option) -> str:
    return f"{option.step.tokens_per_s:,.0f}"
