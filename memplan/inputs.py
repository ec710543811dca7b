"""Turn what a user gives (flags, keyword arguments) into the four specs of a Job.

One source of defaults for the CLI and the Python API alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import catalog
from .errors import MemplanError
from .specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from .strategies import STRATEGIES, strategies_on
from .units import parse_bytes, parse_count

ARCH_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


@dataclass(frozen=True)
class ModelChoice:
    spec: ModelSpec
    source: str
    """params | model | config | arch | module: how the architecture was obtained."""
    assumed: bool = False
    """True when memplan inferred the architecture from a parameter count."""


def resolve_model(*, params=None, model=None, config=None, arch=None, **shape) -> ModelChoice:
    """Exactly one way of naming the model: a parameter count, a preset, a HF config or shapes."""
    if isinstance(model, ModelSpec):
        return ModelChoice(model, "spec")
    given = {k: v for k, v in (("params", params), ("model", model), ("config", config)) if v is not None}
    explicit = {k: v for k, v in shape.items() if v is not None}
    if arch is not None or explicit:
        given["arch"] = arch
    if len(given) != 1:
        raise MemplanError(
            "give exactly one model source: --params N, --model NAME, --config PATH or --arch with shapes"
            + (f" (got {', '.join('--' + k for k in given)})" if given else "")
        )
    if params is not None:
        from .infer import model_for_params

        return ModelChoice(model_for_params(parse_count(params, what="params")), "params", assumed=True)
    if model is not None:
        return ModelChoice(catalog.model_preset(model), "model")
    if config is not None:
        from .hfconfig import model_from_hf_config

        return ModelChoice(model_from_hf_config(config), "config")
    return ModelChoice(_explicit_model(arch or "llama", explicit), "arch")


def _explicit_model(arch: str, shape: dict) -> ModelSpec:
    missing = [f"--{k.replace('_', '-')}" for k in ARCH_FLAGS if k != "kv_heads" and k not in shape]
    if missing:
        raise MemplanError(f"--arch {arch} needs {', '.join(missing)}")
    gpt2 = arch == "gpt2"
    return ModelSpec(
        name=f"{arch}-custom", arch=arch, num_layers=shape["layers"], hidden=shape["hidden"],
        num_heads=shape["heads"], num_kv_heads=shape.get("kv_heads") or 0, ffn_hidden=shape["ffn"],
        vocab_size=shape["vocab"], tied_embeddings=gpt2, linear_bias=arch != "llama",
        max_positions=1024 if gpt2 else 0,
    )


def resolve_cluster(*, gpus=1, gpus_per_node=0, gpu_mem=None, gpu=None, headroom=0.05,
                    precision="mixed-bf16") -> ClusterSpec:
    if gpu is not None and gpu_mem is not None:
        raise MemplanError("give --gpu NAME or --gpu-mem SIZE, not both")
    name, mem = "custom", 80 * 2**30
    if gpu is not None:
        spec = catalog.gpu(gpu)
        spec.peak_flops(precision)  # refuses a precision the GPU has no matmuls for
        name, mem = spec.name, spec.memory_bytes
    elif gpu_mem is not None:
        mem = parse_bytes(gpu_mem, what="gpu-mem")
    return ClusterSpec(gpus=gpus, gpus_per_node=gpus_per_node or 0, gpu_mem_bytes=mem, gpu_name=name,
                       headroom=headroom)


def strategies_for(strategy: str, offload: str, gpus: int) -> list[str]:
    """'all' means every strategy that can run with the requested offload on ``gpus`` GPUs."""
    if strategy != "all":
        return [strategy]
    return [s for s in strategies_on(gpus) if STRATEGIES[s].supports_offload(offload)]


def build_jobs(*, strategy="all", offload="none", seq_len=2048, micro_batch=1, grad_accum=1,
               precision="mixed-bf16", reduce_dtype=None, optimizer="adamw", optimizer_impl=None, ac="none",
               attention="sdpa", device="cuda", gpus=1, gpus_per_node=0, gpu_mem=None, gpu=None, headroom=0.05,
               **model_args) -> tuple[ModelChoice, list[Job]]:
    """The model once, then one Job per strategy asked for."""
    if strategy != "all" and strategy not in STRATEGIES:
        raise MemplanError(f"strategy {strategy!r} is not one of: all, {', '.join(STRATEGIES)}")
    choice = resolve_model(**model_args)
    train = TrainSpec(seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision,
                      reduce_dtype=reduce_dtype, optimizer=optimizer, optimizer_impl=optimizer_impl,
                      activation_checkpointing=ac, attention=attention, device=device)
    cluster = resolve_cluster(gpus=gpus, gpus_per_node=gpus_per_node, gpu_mem=gpu_mem, gpu=gpu,
                              headroom=headroom, precision=precision)
    ids = strategies_for(strategy, offload, cluster.gpus)
    if not ids:
        raise MemplanError(f"no strategy supports offload {offload!r}")
    return choice, [Job(model=choice.spec, train=train, cluster=cluster, plan=Plan(strategy=s, offload=offload))
                    for s in ids]
