"""The training loop around the model: the conventions that decide what is live when.

A ``Loop`` holds the conventions a training loop follows (whether it holds the logits
during backward, which loss, which activation-checkpointing policy, ...). A recipe sets
them as a framework does by default (``tables/recipes.csv``, each row citing the
framework's source); ``resolve`` applies a recipe with the explicitly given flags winning
and says where each convention came from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cache
from typing import Protocol

from .csvtables import read_table
from .errors import InputError, MemplanError
from .settings import check_choice, check_choices, check_positive, setting, show

LOGITS = ("kept", "freed", "held")
LOSSES = ("ce", "chunked-ce", "fused-linear-ce", "cce-compile")
AC_POLICIES = ("none", "selective", "op", "full")
ZERO_GRADS = ("none", "zeros", "after-forward")
RECIPES = ("plain", "hf-trainer", "torchtitan", "torchtune", "lightning", "accelerate")


@dataclass(frozen=True, kw_only=True)
class Loop:
    """How the training step around the model is written (defaults: memplan's plain loop)."""

    logits: str = setting("kept", choices=LOGITS)
    """kept: the caller still holds the model output when backward starts
    (``out = model(x); out.loss.backward()``); freed: it was dropped before backward
    (HF Trainer's compute_loss, torchtitan's ``del pred``, torchtune's ``del logits``); held:
    kept, and still held through the optimizer step and the next step's forward (``for batch in
    data: outputs = model(**batch); ...; optimizer.step()``: the name is rebound when the next
    forward returns; accelerate's README loop, most tutorials)."""
    loss: str = setting("ce", choices=LOSSES)
    """ce: cross-entropy on logits upcast to fp32; chunked-ce: torchtune's
    CEWithChunkedOutputLoss (logits in chunks, each upcast inside the loss);
    fused-linear-ce: Liger's fused linear + cross-entropy (no logits tensor); cce-compile:
    cut-cross-entropy's ``linear_cross_entropy(..., impl="torch_compile")`` (one inductor
    graph of the head and the loss, which saves the logits)."""
    loss_chunks: int = 8
    """Chunks of chunked-ce (torchtune's num_output_chunks default)."""
    ac: str = setting("none", choices=AC_POLICIES)
    """Activation checkpointing of a block: none; selective (the attention core, Megatron's
    meaning); op (torchtitan's per-op SAC); full (the whole block)."""
    ac_every: int = 1
    """Checkpoint every N-th block only, the others none (torchtitan's layer SAC)."""
    compile: bool = False
    """torch.compile (inductor) of each block and of the loss, as torchtune's compile_model /
    compile_loss and torchtitan's compile.components ["model", "loss"] do."""
    float8: bool = False
    """torchao float8 training of the linear layers: it saves the high-precision inputs, so
    the kept activations are bf16's (measured); its fp8 casts are transient."""
    offload_activations: bool = False
    """torchtune's OffloadActivations: saved tensors moved to host memory in forward."""
    optimizer_in_backward: bool = False
    """The optimizer steps each parameter inside backward (torchtune's optimizer_in_bwd)."""
    zero_grad: str = setting("none", choices=ZERO_GRADS)
    """How gradients are cleared between steps: none frees them (``zero_grad(set_to_none=True)``,
    torch ≥ 2.0's default); zeros fills them with zeros (``set_to_none=False``, torch < 2.0's
    default and the 2022 HF Trainer's ``model.zero_grad()``), so they stay allocated through
    the next step's forward; after-forward frees them after the next step's forward, before its
    backward (Lightning's automatic optimization: its closure runs ``training_step``, then
    ``zero_grad``, then ``backward``), so the step before's live through the forward."""
    recipe: str = setting("plain", choices=RECIPES)
    """The framework whose defaults filled the flags not given explicitly."""

    def __post_init__(self):
        check_choices(self)
        check_positive(self, "loss_chunks", "ac_every")
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InputError(
                    lambda n, name=name, value=value: f"{n.word(name)} must be true or false, got {value!r}",
                    field=name,
                    value=value,
                    accepted="true or false",
                )
        if self.ac == "none" and self.ac_every != 1:
            raise MemplanError(f"ac-every {self.ac_every} needs an AC policy: one of {', '.join(AC_POLICIES[1:])}")


_SETTINGS = tuple(f.name for f in fields(Loop) if f.name != "recipe")
"""The loop's settings a recipe sets (every field but the recipe itself), in field order."""
_FLAGS = tuple(f.name for f in fields(Loop) if f.type == "bool")
_COUNTS = tuple(f.name for f in fields(Loop) if f.type == "int")


@dataclass(frozen=True, kw_only=True)
class Convention:
    """One setting in force and where it came from."""

    setting: str
    value: str
    origin: str
    """``recipe <name>``; ``given``: a flag or the user's file (``--from``) set it, and it differs
    from the recipe's; ``searched``: a search chose it."""
    source: str
    """The framework file and line the recipe's value was read from; "" when given."""


@dataclass(frozen=True, kw_only=True)
class Resolved:
    loop: Loop
    conventions: tuple[Convention, ...]
    """Every Loop setting, in field order."""
    elsewhere: tuple[Convention, ...]
    """Recipe settings that live outside the loop (optimizer implementation, FSDP reshard policy)."""

    def describe(self) -> str:
        """``recipe torchtitan: logits freed, loss ce, ac op, ...; given: ac full``."""
        by_origin: dict[str, list[str]] = {}
        for c in self.conventions + self.elsewhere:
            by_origin.setdefault(c.origin, []).append(f"{c.setting.replace('_', '-')} {c.value}")
        return "; ".join(f"{origin}: {', '.join(items)}" for origin, items in by_origin.items())


def _parse(setting: str, text: str):
    if setting in _FLAGS:
        if text not in ("true", "false"):
            raise MemplanError(f"recipes.csv: {setting} {text!r} is not true or false")
        return text == "true"
    return int(text) if setting in _COUNTS else text


@cache
def recipe_rows() -> dict[str, dict[str, tuple[str, str]]]:
    """recipe -> setting -> (value text, source), every recipe carrying every Loop setting."""
    rows: dict[str, dict[str, tuple[str, str]]] = {}
    for row in read_table("recipes.csv"):
        rows.setdefault(row["recipe"], {})[row["setting"]] = (row["value"], row["source"])
    for recipe in RECIPES:
        missing = [s for s in _SETTINGS if s not in rows.get(recipe, {})]
        if missing:
            raise MemplanError(f"recipes.csv: recipe {recipe!r} lacks {', '.join(missing)}")
    return rows


FSDP_UNITS = ("root-kept", "blocks", "all")
"""What reshards after forward under FSDP2 full-shard (recipes.csv reshard_after_forward):
root-kept: every block, not the root (``fully_shard(model)``'s default, memplan's emitted
snippet); blocks: every block and the input embedding as its own unit, not the [final norm,
lm head] unit (torchtitan, accelerate); all: every unit, the root too (torchtune)."""


def loss_in_model(recipe: str) -> bool:
    """Whether the recipe's model computes the loss inside its forward (Hugging Face's
    ``model(input_ids, labels=...)``, recipes.csv loss_in_model) rather than after it returns."""
    return recipe_rows()[recipe].get("loss_in_model", ("false", ""))[0] == "true"


LOGITS_UPCAST = ("loss", "model")
"""Where the logits become fp32 under the standard cross-entropy (recipes.csv logits_upcast):
loss: inside the loss (transformers' ForCausalLMLoss, torchtitan's cross_entropy_loss: memplan's
default); model: the model returns them in fp32 (torchtune's TransformerDecoder), so the loss,
compiled or not, receives fp32 logits."""


def logits_upcast_in_model(recipe: str) -> bool:
    """Whether the recipe's model returns fp32 logits for the standard cross-entropy (``LOGITS_UPCAST``)."""
    where = recipe_rows()[recipe].get("logits_upcast", ("loss", ""))[0]
    check_choice(where, LOGITS_UPCAST, "recipes.csv logits_upcast")
    return where == "model"


def kv_copies(recipe: str) -> bool:
    """Whether the recipe's model copies k and v to every query head before attention
    (recipes.csv kv_copies: torchtune's MultiHeadAttention), so a grouped-query block saves
    b·s·h-wide k and v where sdpa's own grouped-query path keeps them kv wide."""
    return recipe_rows()[recipe].get("kv_copies", ("false", ""))[0] == "true"


def fsdp_units(recipe: str) -> str:
    """The recipe's FSDP2 unit layout (``FSDP_UNITS``)."""
    units = recipe_rows()[recipe].get("reshard_after_forward", ("root-kept", ""))[0]
    check_choice(units, FSDP_UNITS, "recipes.csv reshard_after_forward")
    return units


def resolve(recipe: str = "plain", **explicit) -> Resolved:
    """The Loop a recipe sets, with every explicitly given setting (not None) winning."""
    check_choice(recipe, RECIPES, "recipe")
    unknown = sorted(set(explicit) - set(_SETTINGS))
    if unknown:
        raise MemplanError(f"loop setting {unknown[0]!r} is not one of: {', '.join(_SETTINGS)}")
    table = recipe_rows()[recipe]
    values, conventions = {}, []
    for name in _SETTINGS:
        if explicit.get(name) is not None:
            values[name] = explicit[name]
            origin, source = "given", ""
        else:
            text, source = table[name]
            values[name], origin = _parse(name, text), f"recipe {recipe}"
        conventions.append(Convention(setting=name, value=show(values[name]), origin=origin, source=source))
    elsewhere = tuple(
        Convention(setting=s, value=v, origin=f"recipe {recipe}", source=src)
        for s, (v, src) in table.items()
        if s not in _SETTINGS
    )
    return Resolved(loop=Loop(recipe=recipe, **values), conventions=tuple(conventions), elsewhere=elsewhere)


class Step(Protocol):
    """What ``in_force`` reads of a step: a ``specs.TrainSpec`` (its loop, and the recipe settings
    it carries outside the loop, read by name)."""

    @property
    def loop(self) -> Loop: ...

    @property
    def recipe(self) -> str: ...


def in_force(train: Step, searched: tuple[str, ...] = ()) -> Resolved:
    """The conventions of a step's loop and where each came from: its recipe's, or given (by a
    flag or the user's file) where the value differs from the recipe's, or ``searched`` (settings a search chose)."""
    loop, table = train.loop, recipe_rows()[train.recipe]
    explicit = {s: getattr(loop, s) for s in _SETTINGS if getattr(loop, s) != _parse(s, table[s][0])}
    resolved = resolve(train.recipe, **explicit)
    resolved = replace(
        resolved,
        conventions=tuple(
            replace(c, origin="searched") if c.setting in searched and c.origin == "given" else c
            for c in resolved.conventions
        ),
    )

    # a recipe setting the step also carries (the optimizer implementation, k/v copies) is given
    # where it is given (not None) and differs
    def given(setting: str):
        value = getattr(train, setting, None)
        return None if value is None else show(value)

    elsewhere = tuple(
        Convention(setting=c.setting, value=str(given(c.setting)), origin="given", source="")
        if given(c.setting) not in (None, c.value)
        else c
        for c in resolved.elsewhere
    )
    return replace(resolved, elsewhere=elsewhere)
