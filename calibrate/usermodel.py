"""A model built by its own code, traced (``--mode trace --module``, or ``--config`` of a family
memplan does not describe): what ``calibrate.measure.run`` needs of it.

- **Built** by the user's factory (``package.module:function``, imported with the current
  directory on ``sys.path`` as ``python -m`` has it) or by ``AutoModelForCausalLM.from_config``,
  inside the run's FakeTensorMode and ``torch.device``, as trace mode builds its own models.
- **Units**: the items of the module's largest ``nn.ModuleList`` (or of the one ``--units``
  names), as torchtitan shards ``model.layers``; they are the FSDP2 units and the AC units. The
  model is held in ``UserWrapper``, whose ``layers`` is that list, so calibrate's wrappers read
  it as they read their own models.
- **Input**: the factory module's ``example_input(batch, seq)`` where it defines one (a tensor,
  a tuple of positional arguments or a dict of keyword arguments), else token ids of (micro
  batch, seq len) below the vocabulary of the module's first ``nn.Embedding``, passed as
  ``labels`` too where the forward takes them (a transformers model then returns its loss).
- **Step**: the loss is the output's ``loss`` where it has one, else its (first) tensor's mean in
  fp32; the output is kept through backward or dropped before it as the loop's ``logits`` says
  (``measure._micro_step``'s rule); backward; the optimizer step and zero_grad are the harness's. ``--step`` names a
  ``train_step(model, batch, optimizer)`` that runs a whole step instead.

``python -m calibrate.usermodel USER_JSON`` builds the model under a FakeTensorMode and prints
what the parent checks before a sweep (``calibrate.preflight.check_user``): the units found, a
spec memplan describes where the module carries a Hugging Face config, or the one-line reason
it cannot be run.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memplan.errors import MemplanError
from memplan.specs import Job

from .records import UserModel
from .wrappers import Unsupported


class UserModelError(Unsupported):
    """A user model that cannot be run (one line)."""


def resolve(ref: str, what: str) -> Any:
    """The object ``package.module:name`` names, the current directory on ``sys.path``."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UserModelError(f"{what} {ref!r} is not package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserModelError(f"{what} {ref!r}: module {module_name!r} cannot be imported ({exc})") from None
    found: Any = module
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise UserModelError(f"{what} {ref!r}: module {module_name!r} has no {attr!r}")
    if not callable(found):
        raise UserModelError(f"{what} {ref!r} is not a function (a {type(found).__name__})")
    return found


def _factory_module(user: UserModel):
    """The module the factory is in (resolved already: ``build``), None for a config."""
    return importlib.import_module(user.factory.partition(":")[0]) if user.factory else None


def build(user: UserModel) -> nn.Module:
    """The user's module, built in the current modes and device."""
    if user.factory is None:
        from transformers import AutoConfig, AutoModelForCausalLM

        values = dict(user.config or {})
        model_type = values.pop("model_type", None)
        try:
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values))
        except (ValueError, KeyError, TypeError) as exc:
            raise UserModelError(
                f"--config model_type {model_type!r}: transformers builds no causal LM of it ({_first_line(exc)})"
            ) from None
    try:
        model = resolve(user.factory, "--module")()
    except UserModelError:
        raise
    except Exception as exc:
        raise UserModelError(f"--module {user.factory} raised {type(exc).__name__}: {_first_line(exc)}") from None
    if not isinstance(model, nn.Module):
        what = "tensor" if isinstance(model, torch.Tensor) else type(model).__name__
        raise UserModelError(f"--module {user.factory} returned a {what}, not a torch nn.Module")
    return model


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["no message"])[0]


def find_units(model: nn.Module, path: str | None) -> str:
    """The attribute path of the ``nn.ModuleList`` whose items are the units: ``path``, or the
    largest in the module (most items; the first found among equals)."""
    if path is not None:
        found = model.get_submodule(path) if _has_submodule(model, path) else None
        if not isinstance(found, nn.ModuleList):
            raise UserModelError(f"--units {path!r} is not an nn.ModuleList of {type(model).__name__}")
        return path
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise UserModelError(
            f"{type(model).__name__} has no nn.ModuleList of blocks to shard as FSDP2 units; name one with --units"
        )
    return max(lists, key=lambda item: len(item[1]))[0]


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


class UserWrapper(nn.Module):
    """The user's module with its units as ``layers`` (and, for a transformers model, as ``hf``:
    the recipes that shard its embedding and head read it as calibrate's own)."""

    def __init__(self, inner: nn.Module, units: str | None):
        super().__init__()
        self.inner = inner
        try:
            self.units: str | None = find_units(inner, units)
            self.no_units = ""
        except UserModelError as exc:
            if units is not None:
                raise
            self.units, self.no_units = None, str(exc)  # refused only where something needs units

    @property
    def layers(self) -> nn.ModuleList:
        if self.units is None:
            raise UserModelError(self.no_units)
        return self.inner.get_submodule(self.units)  # type: ignore[return-value]

    @property
    def hf(self) -> nn.Module:
        if not hasattr(self.inner, "get_input_embeddings"):
            raise UserModelError(
                f"the recipe shards the input embedding and the head as units of their own: "
                f"{type(self.inner).__name__} has no get_input_embeddings(); use --recipe plain"
            )
        return self.inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def apply_ac(model: UserWrapper, ac: str) -> None:
    """The job's AC on each unit, as calibrate's own models take it (``workloads.build_model``)."""
    if ac == "none":
        return
    if ac == "selective":
        raise UserModelError(
            "--ac selective checkpoints calibrate's own attention; a user model takes none, full or op"
        )
    from .workloads import checkpoint_layers

    checkpoint_layers(model.layers, ac)


def _vocab(model: nn.Module, user: UserModel) -> int:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise UserModelError(
            f"--module {user.factory}: {type(model).__name__} has no nn.Embedding to draw token ids for: "
            "define example_input(batch, seq) beside the factory"
        )
    return embedding.num_embeddings


def _takes(model: nn.Module, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class UserWorkload:
    """What ``measure.run`` builds, feeds and steps for a user model."""

    def __init__(self, user: UserModel):
        self.user = user
        self.own_step = resolve(user.step, "--step") if user.step else None
        self.no_cache = False

    def build(self, job: Job) -> nn.Module:
        if job.train.finetune != "full":
            raise UserModelError(f"--finetune {job.train.finetune} adapts calibrate's models; a user model trains full")
        model = UserWrapper(build(self.user), self.user.units)
        apply_ac(model, job.train.activation_checkpointing)
        # a transformers model's KV cache would grow again as a checkpointed block recomputes:
        # off under AC, as transformers' own gradient checkpointing turns it off in training
        self.no_cache = job.train.activation_checkpointing != "none" and _takes(model.inner, "use_cache")
        return model

    def batch(self, model: UserWrapper, *, micro_batch: int, seq_len: int, device) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of the forward."""
        inner = model.inner
        module = _factory_module(self.user)
        example = getattr(module, "example_input", None)
        if example is not None:
            with torch.device(device):
                made = example(micro_batch, seq_len)
            if isinstance(made, dict):
                return (), made
            return (made if isinstance(made, tuple) else (made,)), {}
        with torch.device(device):
            ids = torch.randint(0, _vocab(inner, self.user), (micro_batch, seq_len))
        return ((), {"input_ids": ids, "labels": ids}) if _takes(inner, "labels") else ((ids,), {})

    def micro_step(self, model: nn.Module, batch: tuple[tuple, dict], train, autocast, on_forward_end) -> None:
        args, kwargs = batch
        if self.no_cache:
            kwargs = {**kwargs, "use_cache": False}
        with autocast:
            out = model(*args, **kwargs)
            loss = _loss(out)
        if train.logits == "freed":  # the output (logits) dropped before backward, as the loop says
            out = None
        on_forward_end()
        (loss / train.grad_accum).backward()
        del loss, out


def _loss(out) -> torch.Tensor:
    """The output's ``loss`` (a transformers ModelOutput's), else its first tensor's mean in fp32."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is not None:
        return loss
    if isinstance(out, (tuple, list)):
        out = next((t for t in out if isinstance(t, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor):
        raise UserModelError(f"the model's output ({type(out).__name__}) has no loss and no tensor; pass --step")
    return out.float().mean()


@contextlib.contextmanager
def _fake() -> Iterator[None]:
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
        yield


def probe(user: UserModel) -> dict:
    """Build the model under a FakeTensorMode: its units (or why none), its input, and the spec
    memplan describes where it carries a Hugging Face config memplan reads; or the error."""
    try:
        if user.step:
            resolve(user.step, "--step")
        with _fake():
            model = build(user)
            wrapped = UserWrapper(model, user.units)  # a wrong --units: refused whatever the strategy
            found: dict[str, Any] = {"model": type(model).__name__}
            # no list: refused where the strategy shards (FSDP2)
            found |= {"units": wrapped.units} if wrapped.units else {"no_units": wrapped.no_units}
            UserWorkload(user).batch(wrapped, micro_batch=1, seq_len=2, device="cpu")
        found["spec"] = _described(model)
        return found
    except UserModelError as exc:
        return {"error": str(exc)}


def _described(model: nn.Module) -> dict | None:
    """The ModelSpec memplan reads from the module's Hugging Face config, as a dict (None: none)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    from dataclasses import asdict

    from memplan.hfconfig import model_from_hf_config

    try:
        return asdict(model_from_hf_config(config.to_dict()))
    except MemplanError:
        return None


if __name__ == "__main__":
    print(json.dumps(probe(UserModel.from_dict(json.loads(sys.argv[1])))))
