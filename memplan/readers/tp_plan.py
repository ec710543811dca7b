"""A user's ``parallelize_module`` plan as a JSON dict, module path → style name
(``{"layers.*.self_attn.q_proj": "ColwiseParallel", ...}``), mapped to one of ``layout.TP_PLANS``
(``memplan estimate --from tp-plan:plan.json``): the blocks' linears alone are ``blocks``; with
SequenceParallel norms, the embedding RowwiseParallel, the final norm SequenceParallel and the
head ColwiseParallel they are the TP tutorial's plan (``tutorial``: as pytorch/examples
fsdp_tp_example.py writes it, the head's output Replicate()). An entry that neither plan holds is
refused in one line, naming it. Module names: Hugging Face's llama (``self_attn.q_proj``,
``mlp.gate_proj``), torchtitan's / the tutorial's (``attention.wq``, ``feed_forward.w1``) and the
calibration harness's (``attn.q_proj``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import InputError
from .base import FieldUse, FileConfig

COLWISE, ROWWISE, SEQUENCE, PREPARE = "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput"
STYLES = (COLWISE, ROWWISE, SEQUENCE, PREPARE)
"""torch.distributed.tensor.parallel's style classes, by name."""
_ATTENTION = ("self_attn", "attention", "attn")
_MLP = ("mlp", "feed_forward")


def _in(parents: tuple[str, ...], *names: str) -> tuple[str, ...]:
    return tuple(f"{p}.{n}" for p in parents for n in names)


ROLES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    # (block or root, role, style, module names in Hugging Face's / torchtitan's / the harness's llama)
    ("block", "q", COLWISE, _in(_ATTENTION, "q_proj", "wq")),
    ("block", "k", COLWISE, _in(_ATTENTION, "k_proj", "wk")),
    ("block", "v", COLWISE, _in(_ATTENTION, "v_proj", "wv")),
    ("block", "o", ROWWISE, _in(_ATTENTION, "o_proj", "wo")),
    ("block", "gate", COLWISE, _in(_MLP, "gate_proj", "w1")),
    ("block", "up", COLWISE, _in(_MLP, "up_proj", "w3")),
    ("block", "down", ROWWISE, _in(_MLP, "down_proj", "w2")),
    # the tutorial's sequence-parallel entries
    ("block", "first norm", SEQUENCE, ("input_layernorm", "attention_norm", "input_norm")),
    ("block", "second norm", SEQUENCE, ("post_attention_layernorm", "ffn_norm", "post_attention_norm")),
    ("block", "attention input", PREPARE, _ATTENTION),
    ("block", "MLP input", PREPARE, _MLP),
    ("root", "embedding", ROWWISE, ("embed_tokens", "tok_embeddings")),
    ("root", "final norm", SEQUENCE, ("norm",)),
    ("root", "head", COLWISE, ("lm_head", "output")),
)
"""Every module a measured plan shards, by role: the first seven (the block's linears) are the
``blocks`` plan, all of them the ``tutorial`` plan."""
LINEARS = tuple(role for _, role, _, _ in ROLES[:7])
_BY_NAME = {(where, name): (role, style) for where, role, style, names in ROLES for name in names}
_BLOCK = re.compile(r"^(?:model\.)?layers\.(?:\*|\d+)\.(.+)$")


def _role(path: str) -> tuple[str, str]:
    """(``block`` or ``root``, the name within it)."""
    found = _BLOCK.match(path)
    if found:
        return "block", found.group(1)
    return "root", path.removeprefix("model.")


def _refuse(where: str, what: str, field: str, value, accepted: str) -> InputError:
    return InputError(f"{where}: {what}; accepted: {accepted}", field=field, value=value, accepted=accepted)


def plan_of(entries: dict, where: str) -> str:
    """The ``TP_PLANS`` name of a module path → style dict (one-line refusal naming an entry)."""
    if not isinstance(entries, dict) or not entries:
        raise _refuse(where, "not a TP plan", "tp_plan", entries, "a JSON object of module path → style name")
    roles = set()
    for path, style in entries.items():
        role, expected = _BY_NAME.get(_role(path), (None, None))
        if expected is None or style != expected:
            accepted = expected or "a block's linear, norm, attention or MLP, or the embedding, final norm or head"
            raise _refuse(
                where, f"entry {path!r}: {json.dumps(style)} is not in a measured TP plan", path, style, accepted
            )
        roles.add(role)
    missing = [r for r in LINEARS if r not in roles]
    if missing:
        accepted = "every block linear (q, k, v, gate, up ColwiseParallel; o, down RowwiseParallel)"
        raise _refuse(where, f"the block's {', '.join(missing)} left unsharded", "tp_plan", missing, accepted)
    if roles == set(LINEARS):
        return "blocks"
    absent = [role for _, role, _, _ in ROLES if role not in roles]
    if absent:
        accepted = "the blocks' linears alone, or the TP tutorial's whole plan"
        raise _refuse(where, f"sequence parallel without the {', '.join(absent)}", "tp_plan", absent, accepted)
    return "tutorial"


def read(path: Path) -> FileConfig:
    """``--from tp-plan:FILE``: the plan's name (and SP under the tutorial's plan) as inputs."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON ({exc})", field="from", value=str(path), accepted="a JSON file") from None
    name = plan_of(entries, str(path))
    note = "parallelize_module style (memplan.readers.tp_plan)"
    uses = tuple(FieldUse(field=k, value=v, status="modelled", input="tp_plan", note=note) for k, v in entries.items())
    return FileConfig(path=str(path), format="tp-plan", inputs={"tp_plan": name, "sp": name == "tutorial"}, fields=uses)


def is_tp_plan(data) -> bool:
    """A JSON object whose values are all torch's style names."""
    return isinstance(data, dict) and bool(data) and all(v in STYLES for v in data.values())
