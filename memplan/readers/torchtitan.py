"""A torchtitan job config (TOML, torchtitan 0.2.2's ``JobConfig``, config/job_config.py; the last
version with TOML job configs: 0.3 builds ``Trainer.Config`` in Python), as ``run_train.sh
--job.config_file FILE`` reads it. Fields before 0.2 that torchtitan's own shipped TOMLs still carry
(``training.batch_size``, ``training.compile``, ``[float8]``) are read too.

A field the file leaves out is JobConfig's default, as torchtitan runs it: a file without
``[activation_checkpoint]`` checkpoints every second block (``selective`` with option ``"2"``), one
without ``[training]`` runs 8 sequences of 2048 per rank, one without ``[model]`` the debug model.

The world size is torchrun's ``--nproc_per_node`` (run_train.sh ``NGPU``, 8 by default), not the
file's: where the degrees do not fix it (``data_parallel_shard_degree = -1``), ``--gpus`` does, or 8,
said as an assumption. The strategy follows from the degrees as torchtitan's ParallelDims and
parallelize_llama apply them: FSDP2 where the shard degree (or cp) is above 1, HSDP with replicas,
DDP with replicas alone, one rank's model otherwise; the precision as its apply_fsdp / maybe_enable_amp
set it; the loop as its 0.2.2 trainer runs it (train.py l.550: ``optimizers.zero_grad()``, torch's
set_to_none).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import tomllib

from ..catalog import read_table
from ..errors import InputError
from ..specs import ModelSpec
from .base import FileConfig, classify, refuse

NGPU = 8
"""run_train.sh: ``NGPU=${NGPU:-"8"}``, torchrun's --nproc_per_node."""
SCHEDULES = {
    "GPipe": "gpipe",
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved-1f1b",
    "InterleavedZeroBubble": "zero-bubble",
}
"""torch.distributed.pipelining's schedule names memplan models (schedules.py get_schedule_class)."""
LOOPED = ("interleaved-1f1b", "zero-bubble")
"""Multi-stage schedules: 2 stages per rank without pipeline_parallel_layers_per_stage
(distributed/pipeline_parallel.py: ``stages_per_rank = 1 if is_single_stage_schedule else 2``)."""
OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam"}
"""components/optimizer.py build_optimizers: ``optimizer_classes``."""
IMPLEMENTATIONS = {"fused": "fused", "foreach": "foreach", "for-loop": "single"}
SECTIONS = ("job", "model", "training", "parallelism", "activation_checkpoint", "optimizer")
"""Sections that tell a torchtitan TOML (format detection)."""


@cache
def flavors() -> dict[tuple[str, str], dict[str, str]]:
    """tables/torchtitan_models.csv rows by (name, flavor)."""
    return {(row["name"], row["flavor"]): row for row in read_table("torchtitan_models.csv")}


def ffn_hidden(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan models/llama3/model/model.py FeedForward: 4·dim, two thirds of it, times the
    multiplier, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def flavor_spec(row: dict[str, str]) -> ModelSpec:
    """A flavor's shapes (TransformerModelArgs) as memplan's llama spec."""
    multiplier = float(row["ffn_dim_multiplier"]) if row["ffn_dim_multiplier"] else None
    return ModelSpec(
        name=f"torchtitan-{row['name']}-{row['flavor']}",
        arch="llama",
        num_layers=int(row["n_layers"]),
        hidden=int(row["dim"]),
        num_heads=int(row["n_heads"]),
        num_kv_heads=int(row["n_kv_heads"]),
        ffn_hidden=ffn_hidden(int(row["dim"]), multiplier, int(row["multiple_of"])),
        vocab_size=int(row["vocab_size"]),
    )


def model_of(row: dict[str, str]) -> str | ModelSpec:
    """A flavor as memplan's preset of the same shapes where one exists, its spec otherwise."""
    return row["preset"] or flavor_spec(row)


def _load(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not TOML ({exc})", field="from", value=str(path), accepted="a TOML file") from None


def is_torchtitan(data: Any) -> bool:
    return isinstance(data, dict) and any(isinstance(data.get(s), dict) for s in SECTIONS)


def read(path: Path, gpus: int | None = None) -> FileConfig:
    return parse(_load(path), path, gpus=gpus)


class _File:
    """The loaded TOML with JobConfig's defaults: ``get("training", "seq_len", 2048)``."""

    def __init__(self, data: dict, path: str):
        self.data, self.path = data, path

    def get(self, section: str, key: str, default: Any) -> Any:
        return (self.data.get(section) or {}).get(key, default)

    def count(self, section: str, key: str, default: int, least: int = 1) -> int:
        value = self.get(section, key, default)
        if isinstance(value, bool) or not isinstance(value, int) or (value < least and value != default):
            raise refuse(self.path, f"{section}.{key}", value, f"an integer ≥ {least}")
        return value

    def choice(self, section: str, key: str, default: Any, accepted) -> Any:
        value = self.get(section, key, default)
        if value not in accepted:
            raise refuse(self.path, f"{section}.{key}", value, ", ".join(str(a) for a in accepted))
        return value


def parse(data: dict, path: Path | str = "<config>", gpus: int | None = None) -> FileConfig:
    """A torchtitan TOML already loaded; ``gpus`` is the world size where the launch says it."""
    f = _File(data, str(path))
    uses = classify(f.path, "torchtitan", data)
    inputs: dict[str, Any] = {"recipe": "torchtitan", "model": _model(f)}
    mesh = _mesh(f, gpus)
    inputs |= mesh.inputs
    inputs |= _batch(f, mesh)
    inputs |= _precision(f, mesh)
    inputs |= _loop(f, mesh)
    assumed = (("gpus", "run_train.sh's NGPU default; the degrees leave it open: give --gpus"),) * mesh.assumed
    return FileConfig(path=f.path, format="torchtitan", inputs=inputs, fields=tuple(uses), assumed=assumed)


def _model(f: _File) -> str | ModelSpec:
    name, flavor = f.get("model", "name", "llama3"), f.get("model", "flavor", "debugmodel")
    row = flavors().get((name, flavor))
    if row is None:
        accepted = ", ".join(f"{n} {fl}" for n, fl in flavors())
        field = "model.name" if all(n != name for n, _ in flavors()) else "model.flavor"
        raise refuse(f.path, field, name if field == "model.name" else flavor, accepted)
    return model_of(row)


class _Mesh:
    """torchtitan's ParallelDims of the file at a world size, and memplan's strategy and layout."""

    def __init__(self, f: _File, gpus: int | None):
        self.replicate = f.count("parallelism", "data_parallel_replicate_degree", 1)
        shard = f.count("parallelism", "data_parallel_shard_degree", -1)
        self.tp = f.count("parallelism", "tensor_parallel_degree", 1)
        self.cp = f.count("parallelism", "context_parallel_degree", 1)
        self.pp = f.count("parallelism", "pipeline_parallel_degree", 1)
        others = self.replicate * self.tp * self.cp * self.pp
        self.assumed = shard == -1 and gpus is None
        world = gpus if gpus is not None else (others * shard if shard != -1 else NGPU)
        if shard == -1:  # distributed/parallel_dims.py _validate: the ranks left over
            shard = world // others
        if shard < 1 or others * shard != world:
            raise refuse(
                f.path,
                "parallelism.data_parallel_shard_degree",
                shard,
                f"replicate × shard × cp × tp × pp = the world size ({world}; replicate × cp × tp × pp = {others})",
            )
        self.shard, self.world = shard, world
        self.fsdp = shard > 1 or self.cp > 1  # ParallelDims.fsdp_enabled
        self.dp = self.replicate * shard
        self.inputs: dict[str, Any] = {"strategy": self._strategy(f)} | ({} if gpus else {"gpus": world})
        self.inputs |= {"tp": self.tp, "cp": self.cp, "pp": self.pp}
        if self.tp > 1:
            self.inputs["sp"] = True  # parallelize.py apply_tp: norms always sequence-parallel
        if self.inputs["strategy"] == "fsdp-hybrid-shard":
            # memplan's HSDP shards over a node's ranks (gpus-per-node ÷ (tp · cp)): the file's shard degree
            self.inputs["gpus_per_node"] = shard * self.tp * self.cp

    def _strategy(self, f: _File) -> str:
        reshard = f.choice("parallelism", "fsdp_reshard_after_forward", "default", ("default", "never"))
        if self.fsdp:
            kept = reshard == "never" or self.pp > 1  # parallelize.py apply_fsdp: default is not pp_enabled
            if self.replicate > 1:
                if kept:
                    raise refuse(
                        f.path, "parallelism.fsdp_reshard_after_forward", reshard, "default without PP under HSDP"
                    )
                return "fsdp-hybrid-shard"
            return "fsdp-shard-grad-op" if kept else "fsdp-full-shard"
        if self.replicate > 1:
            if self.replicate != self.world:  # parallelize.py: "DDP has not supported > 1D parallelism"
                raise refuse(
                    f.path, "parallelism.data_parallel_replicate_degree", self.replicate, "the world size alone"
                )
            return "ddp"
        return "single"


def _mesh(f: _File, gpus: int | None) -> _Mesh:
    mesh = _Mesh(f, gpus)
    if f.get("training", "enable_cpu_offload", False) is True:
        if not mesh.fsdp:
            raise refuse(f.path, "training.enable_cpu_offload", True, "false without FSDP (shard degree or cp > 1)")
        mesh.inputs["offload"] = "all"
    if f.get("parallelism", "disable_loss_parallel", False) is True and mesh.tp > 1:
        # apply_tp with loss_parallel False: the head's output_layouts=Replicate(), the TP tutorial's plan
        if mesh.cp > 1 or mesh.pp > 1 or f.get("parallelism", "enable_async_tensor_parallel", False) is True:
            raise refuse(f.path, "parallelism.disable_loss_parallel", True, "false with CP, PP or async TP")
        mesh.inputs["tp_plan"] = "tutorial"
    if mesh.pp > 1:
        schedule = f.choice("parallelism", "pipeline_parallel_schedule", "1F1B", tuple(SCHEDULES))
        mesh.inputs["pp_schedule"] = SCHEDULES[schedule]
        if SCHEDULES[schedule] in LOOPED:
            mesh.inputs["pp_virtual"] = 2
    return mesh


def _batch(f: _File, mesh: _Mesh) -> dict[str, Any]:
    key = "local_batch_size" if "local_batch_size" in (f.data.get("training") or {}) else "batch_size"
    local = f.count("training", key, 8)
    inputs: dict[str, Any] = {"seq_len": f.count("training", "seq_len", 2048)}
    if mesh.pp > 1:  # distributed/pipeline_parallel.py: n_microbatches = local_batch_size // microbatch size
        size = f.count("parallelism", "pipeline_parallel_microbatch_size", 1)
        if local % size or local // size < 2:
            raise refuse(
                f.path, f"training.{key}", local, f"a multiple (≥ 2) of pipeline_parallel_microbatch_size ({size})"
            )
        inputs |= {"micro_batch": size, "pp_microbatches": local // size}
    else:
        inputs["micro_batch"] = local
    total = f.count("training", "global_batch_size", -1)
    if total == -1:
        inputs["grad_accum"] = 1
    elif total % (local * mesh.dp):  # train.py: global must be a multiple of local × the dp degree
        raise refuse(f.path, "training.global_batch_size", total, f"a multiple of local × dp ({local * mesh.dp})")
    else:
        inputs["grad_accum"] = total // (local * mesh.dp)
    return inputs


def _precision(f: _File, mesh: _Mesh) -> dict[str, Any]:
    dtype = f.choice("training", "dtype", "float32", ("float32", "bfloat16"))
    param = f.choice("training", "mixed_precision_param", "bfloat16", ("bfloat16", "float32"))
    f.choice("training", "mixed_precision_reduce", "float32", ("float32",))
    inputs: dict[str, Any] = {}
    if mesh.fsdp:
        inputs["reduce_dtype"] = "fp32"  # apply_fsdp's MixedPrecisionPolicy reduce_dtype
    if dtype == "bfloat16":  # train.py set_default_dtype: bf16 parameters, no fp32 copy
        return inputs | {"precision": "bf16"}
    if param == "float32":
        return inputs | {"precision": "fp32"}
    if mesh.fsdp:  # FSDP's MixedPrecisionPolicy param_dtype over fp32 sharded parameters
        return inputs | {"precision": "mixed-bf16"}
    # distributed/utils.py maybe_enable_amp: autocast under DDP or one rank; none under TP or PP alone
    return inputs | {"precision": "fp32" if mesh.tp > 1 or mesh.pp > 1 else "amp-bf16"}


def _converters(f: _File) -> list[str]:
    value = f.get("model", "converters", [])
    names = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    if not isinstance(names, list) or any(n != "float8" for n in names):
        raise refuse(f.path, "model.converters", value, 'none or ["float8"]')
    return names


def _loop(f: _File, mesh: _Mesh) -> dict[str, Any]:
    inputs: dict[str, Any] = dict(zero_grad="none")  # train.py l.550: optimizers.zero_grad(), set_to_none
    inputs["float8"] = "float8" in _converters(f)
    name = f.choice("optimizer", "name", "AdamW", tuple(OPTIMIZERS))
    impl = f.choice("optimizer", "implementation", "fused", tuple(IMPLEMENTATIONS))
    inputs |= {"optimizer": OPTIMIZERS[name], "optimizer_impl": IMPLEMENTATIONS[impl]}
    inputs["optimizer_in_backward"] = f.choice("optimizer", "early_step_in_backward", False, (False, True))
    inputs |= _ac(f)
    compiled = _compile(f)
    inputs["compile"] = compiled
    if f.get("parallelism", "enable_async_tensor_parallel", False) is True:
        if not compiled:  # distributed/tensor_parallel.py maybe_enable_async_tp raises without it
            raise refuse(f.path, "parallelism.enable_async_tensor_parallel", True, "false unless compile.enable")
        inputs["async_tp"] = mesh.tp > 1
    return inputs


def _ac(f: _File) -> dict[str, Any]:
    """distributed/activation_checkpoint.py apply_ac: full wraps every block; selective "op" is the
    per-op policy, an integer N the layer SAC (every N-th block; 0: every block)."""
    mode = f.choice("activation_checkpoint", "mode", "selective", ("none", "full", "selective"))
    if mode != "selective":
        return {"ac": mode, "ac_every": 1}
    option = str(f.get("activation_checkpoint", "selective_ac_option", "2"))
    if option == "op":
        return {"ac": "op", "ac_every": 1}
    if not option.isdigit():
        raise refuse(f.path, "activation_checkpoint.selective_ac_option", option, '"op" or a non-negative integer')
    return {"ac": "full", "ac_every": max(1, int(option))}


def _compile(f: _File) -> bool:
    """compile.enable over ["model", "loss"] (memplan compiles each block and the loss); before 0.2,
    training.compile."""
    if "compile" in (f.data.get("training") or {}):
        return f.choice("training", "compile", False, (False, True))
    enabled = f.choice("compile", "enable", False, (False, True))
    components = f.get("compile", "components", ["model", "loss"])
    if enabled and sorted(components) != ["loss", "model"]:
        raise refuse(f.path, "compile.components", components, '["model", "loss"] (memplan compiles both)')
    return enabled
