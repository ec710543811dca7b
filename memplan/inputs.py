"""Turn a ``Request`` (what a user gives, as flags or keywords) into the four specs of a Job."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from . import catalog
from .errors import InputError
from .hfconfig import bnb_4bit_double_quant, load_config, model_from_config
from .infer import model_for_params, parse_params
from .moe import allows_ep
from .request import SHAPES, ModelRequest, Request
from .specs import ONE_UNIT_STRATEGIES, ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from .strategies import STRATEGIES, strategies_on
from .units import parse_bytes

ZERO_STRATEGIES = tuple(s.id for s in STRATEGIES.values() if s.framework == "deepspeed")


@dataclass(frozen=True)
class ModelChoice:
    spec: ModelSpec
    source: str
    """params | model | config | arch | module: how the architecture was obtained."""
    assumed: bool = False
    """True when memplan inferred the architecture from a parameter count."""
    assumptions: tuple[str, ...] = ()
    """What memplan read the request as where it did not say (a default changed for this model, a
    GPU's short name): stated under the header, one line each."""
    config_path: Path | None = None
    """The config.json the architecture was read from (source config, a file)."""
    double_quant: bool | None = None
    """Its bitsandbytes 4-bit ``bnb_4bit_use_double_quant`` (``hfconfig.bnb_4bit_double_quant``);
    None: the checkpoint is not 4-bit."""


def resolve_model(request: ModelRequest) -> ModelChoice:
    """The architecture the request names (it names exactly one: ``ModelRequest`` checks)."""
    if isinstance(request.model, ModelSpec):
        return ModelChoice(request.model, "spec")
    if request.params is not None:
        return ModelChoice(model_for_params(parse_params(request.params)), "params", assumed=True)
    if request.model is not None:
        return ModelChoice(catalog.model_preset(request.model), "model")
    if request.config is not None:
        cfg, path = load_config(request.config)  # read once: the architecture and its quantization
        quant = bnb_4bit_double_quant(cfg, path)
        return ModelChoice(model_from_config(cfg, path), "config", config_path=path, double_quant=quant)
    return ModelChoice(_explicit_model(request), "arch")


def _explicit_model(request: ModelRequest) -> ModelSpec:
    arch = request.arch or "llama"
    shape = {k: getattr(request, k) for k in SHAPES}  # ModelRequest checked all but kv_heads, head_dim
    gpt2 = arch == "gpt2"
    # gpt2: 1024 learned positions, a tied head; bert: BertConfig's 512 positions, 2 token types,
    # the MLM head (tied)
    positions = {"gpt2": (1024, 0), "bert": (512, 2)}.get(arch, (0, 0))
    return ModelSpec(
        name=f"{arch}-custom",
        arch=arch,
        num_layers=shape["layers"],
        hidden=shape["hidden"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"] or 0,
        head_dim=shape["head_dim"] or 0,
        ffn_hidden=shape["ffn"],
        vocab_size=shape["vocab"],
        tied_embeddings=gpt2 or arch == "bert",
        linear_bias=arch != "llama",
        max_positions=positions[0],
        type_vocab_size=positions[1],
    )


def resolve_cluster(
    *,
    gpus=1,
    gpus_per_node=0,
    gpu_mem=None,
    gpu=None,
    headroom=0.05,
    precision="mixed-bf16",
    float8=False,
    alloc_conf="",
) -> ClusterSpec:
    """The GPUs a ``ClusterRequest`` names, for a step at ``precision`` (with float8 training or not)."""
    name, mem = "custom", 80 * 2**30
    if gpu is not None:
        spec = catalog.gpu(gpu)
        spec.peak_flops(precision)  # refuses a precision the GPU has no matmuls for
        spec.check_float8(float8)
        name, mem = spec.name, spec.memory_bytes
    elif gpu_mem is not None:
        mem = parse_bytes(gpu_mem, what="gpu_mem")
    return ClusterSpec(
        gpus=gpus,
        gpus_per_node=gpus_per_node or 0,
        gpu_mem_bytes=mem,
        gpu_name=name,
        headroom=headroom,
        alloc_conf=alloc_conf,
    )


def _default_seq_len(model: ModelSpec, train: TrainSpec, *, given: bool) -> tuple[TrainSpec, tuple[str, ...]]:
    """The default sequence cut to a model's learned positions where they are fewer (gpt2's 1024,
    bert's 512), and the line saying so; a length given beyond them ``Job`` refuses."""
    positions = model.max_positions
    if given or model.arch == "vit" or not positions or train.seq_len <= positions:
        return train, ()
    note = f"seq-len {positions}: {model.name}'s learned positions (the default {train.seq_len} is beyond them)"
    return replace(train, seq_len=positions), (note,)


def _checkpoint_quantization(
    request: Request, choice: ModelChoice, train: TrainSpec
) -> tuple[TrainSpec, tuple[str, ...]]:
    """A config.json holding a bitsandbytes 4-bit ``quantization_config``: its weights train as
    qlora's (refused otherwise: 4-bit weights take no gradient), its double quantization where
    ``--qlora-double-quant`` is not given, and the line saying so."""
    double_quant, path = choice.double_quant, choice.config_path
    if double_quant is None:
        return train, ()
    if train.finetune != "qlora":
        raise InputError(
            lambda n: (
                f"{path or 'config.json'} quantization_config loads the weights in 4 bits (bitsandbytes): "
                f"they train adapters only, give {n('finetune')} qlora (got {train.finetune})"
            ),
            field="finetune",
            value=train.finetune,
            accepted="qlora with a 4-bit checkpoint",
        )
    field = "quantization_config.bnb_4bit_use_double_quant"
    if request.training.qlora_double_quant is None:
        train = replace(train, qlora_double_quant=double_quant)
        return train, (f"qlora-double-quant {'on' if double_quant else 'off'} (config.json {field})",)
    if train.qlora_double_quant != double_quant:  # the flag wins, said beside the file's value
        state, file_state = ("on", "false") if train.qlora_double_quant else ("off", "true")
        return train, (f"qlora-double-quant {state} as given (config.json {field}: {file_state})",)
    return train, ()


def _gpu_alias(name: str | None) -> tuple[str, ...]:
    """The line naming the GPU a short name (``h100``) was read as, and the table's others of its family."""
    if name is None or name.strip().lower() in catalog.gpus():
        return ()
    spec, family = catalog.gpu(name), name.strip().lower().split("-")[0]
    others = [g for g in catalog.gpus() if g != spec.name and g.split("-")[0] == family]
    also = f"; also in tables/gpus.csv: {', '.join(others)}" if others else ""
    return (f"gpu {name} read as {spec.name}{also}",)


def _lightning_units(recipe: str, strategies: list[str], wrap: str) -> tuple[str, ...]:
    """The line saying which FSDP units a Lightning job is estimated with where the user did not say:
    its FSDPStrategy wraps only what ``auto_wrap_policy`` names, nothing without one
    (validation.lightning_loop)."""
    if recipe != "lightning" or wrap != "blocks" or not any(s in ONE_UNIT_STRATEGIES for s in strategies):
        return ()
    return (
        "lightning's FSDP units are the blocks, FSDPStrategy(auto_wrap_policy={the decoder layer}); its default "
        "FSDPStrategy() wraps the whole model as one unit: --fsdp-wrap none",
    )


def strategies_for(strategy: str, offload: str, gpus: int) -> list[str]:
    """'all' means every strategy that can run with the requested offload on ``gpus`` GPUs."""
    if strategy != "all":
        return [strategy]
    return [s for s in strategies_on(gpus) if STRATEGIES[s].supports_offload(offload)]


def build_jobs(request: Request | None = None, /, **inputs) -> tuple[ModelChoice, list[Job]]:
    """The model once, then one Job per strategy asked for; the request as a ``Request``, inputs by
    keyword (``Request.of``), or both. A micro-batch of ``"max"`` is left at 1 here."""
    request = Request.of(request, **inputs)
    choice = resolve_model(request.model)
    train = request.training.spec()
    c, plan = request.cluster, request.plan
    cluster = resolve_cluster(
        gpus=c.gpus,
        gpus_per_node=c.gpus_per_node,
        gpu_mem=c.gpu_mem,
        gpu=c.gpu,
        headroom=c.headroom,
        precision=train.precision,
        float8=train.float8,
        alloc_conf=c.alloc_conf,
    )
    train, context = _default_seq_len(choice.spec, train, given=request.training.seq_len is not None)
    train, quantized = _checkpoint_quantization(request, choice, train)
    layout = request.layout.spec()
    ids = strategies_for(plan.strategy, plan.offload, layout.dp(cluster.gpus))
    if plan.strategy == "all":  # expert parallel composes with FSDP only
        ids = [s for s in ids if allows_ep(STRATEGIES[s], plan.ep)]
    lightning = _lightning_units(train.recipe, ids, plan.fsdp_wrap)
    choice = replace(choice, assumptions=context + quantized + _gpu_alias(c.gpu) + lightning)
    if not ids:
        raise InputError(
            f"no strategy supports offload {plan.offload!r}",
            field="offload",
            value=plan.offload,
            accepted="an offload some strategy supports on these GPUs",
        )
    return choice, [
        Job(
            model=choice.spec,
            train=train,
            cluster=cluster,
            # the zero_optimization settings are a DeepSpeed strategy's own; DDP's keywords are in
            # every plan (a search derives the ddp option from another), read by DDP's adapter alone
            plan=Plan(
                strategy=s,
                offload=plan.offload,
                ep=plan.ep,
                zero=plan.zero if s in ZERO_STRATEGIES else None,
                reshard_after_forward=plan.reshard_after_forward,
                fsdp_wrap=plan.fsdp_wrap,
                **plan.ddp_kwargs(),
            ),
            layout=layout,
        )
        for s in ids
    ]
