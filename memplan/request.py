"""What a user asks memplan about, as one typed value: the model, the training step, the cluster
and the strategy. The CLI builds it from flags, the Python API from keywords; each part checks
its own fields once, here (or in the spec it becomes). Defaults are the specs' own.

A new input is one field in its part (with its docstring, and its accepted values as
``settings.setting(choices=...)``) plus its check; the CLI's option, the API's keyword and their
help are built from that field. A training input is passed to the ``TrainSpec`` field of the same
name; a loop setting is declared once, on ``loop.Loop``, and appears here as ``LoopSettings``.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from .allocator import parse_alloc_conf
from .errors import InputError, UnknownKeywordError
from .infer import parse_params
from .layout import PP_SCHEDULES, TP_PLANS, Layout
from .loop import RECIPES, Loop, resolve
from .settings import optional, setting
from .specs import (
    ARCHS,
    ATTENTIONS,
    DDP_KEYWORDS,
    DEVICES,
    FSDP_WRAPS,
    OFFLOADS,
    ONE_UNIT_STRATEGIES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    REDUCE_DTYPES,
    ClusterSpec,
    ModelSpec,
    Plan,
    TrainSpec,
    ZeroConfig,
)
from .strategies import STRATEGIES

SHAPES = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "head_dim")
_OPTIONAL_SHAPES = ("kv_heads", "head_dim")


@dataclass(frozen=True, kw_only=True)
class ModelRequest:
    """The model, named exactly one way: a parameter count, a preset or ``ModelSpec``, a Hugging
    Face config, or an architecture with its shapes."""

    params: float | str | None = None
    """Parameter count (``13e9``, ``"13B"``, ``"7.2b"``): a llama-style model of about that size."""
    model: str | ModelSpec | None = None
    """A preset of tables/models.csv (``"llama-2-13b"``), or a ``ModelSpec``."""
    config: str | Path | dict | None = None
    """A Hugging Face config.json: its path, its folder, or the dict."""
    arch: str | None = setting(None, choices=ARCHS)
    """Family of a model given by its shapes (llama | gpt2 | neox | vit | bert); llama where only shapes are given."""
    layers: int | None = None
    """Transformer blocks (with ``arch``)."""
    hidden: int | None = None
    """Hidden size (with ``arch``)."""
    heads: int | None = None
    """Attention heads (with ``arch``)."""
    kv_heads: int | None = None
    """Key/value heads (with ``arch``); as many as ``heads`` where not given."""
    ffn: int | None = None
    """MLP hidden size (with ``arch``)."""
    vocab: int | None = None
    """Vocabulary size, or classes of a vit head (with ``arch``)."""
    head_dim: int | None = None
    """One attention head's width (with ``arch`` llama); hidden / heads where not given."""

    def __post_init__(self):
        given = self.sources()
        if len(given) != 1:
            raise InputError(
                lambda n: (
                    f"give exactly one model source: {n('params')} N, {n('model')} NAME, "
                    f"{n('config')} PATH or {n('arch')} with shapes"
                    + (f" (got {', '.join(n(k) for k in given)})" if given else "")
                ),
                field="model",
                value=given,
                accepted="one of params, model, config, arch with shapes",
            )
        if given == ["params"]:
            parse_params(self.params)
        missing = self.missing_shapes() if given == ["arch"] else []
        if missing:
            raise InputError(
                lambda n: f"{n('arch')} {self.arch or 'llama'} needs {', '.join(n(k) for k in missing)}",
                field=missing[0],
                value=None,
                accepted="a positive integer",
            )

    def sources(self) -> list[str]:
        """The ways the model was named: params, model, config, arch (shapes count as arch)."""
        given = [k for k in ("params", "model", "config") if getattr(self, k) is not None]
        if self.arch is not None or any(getattr(self, k) is not None for k in SHAPES):
            given.append("arch")
        return given

    def missing_shapes(self) -> list[str]:
        return [k for k in SHAPES if k not in _OPTIONAL_SHAPES and getattr(self, k) is None]


LoopSettings: Any = optional(
    Loop,
    "LoopSettings",
    exclude=("recipe",),
    default_help="the recipe's; plain: {default}",
    doc="The training loop's settings (``loop.Loop``), each None where the recipe sets it.",
)


@dataclass(frozen=True, kw_only=True)
class _Step:
    """What each GPU processes per step and how, and the recipe whose loop conventions apply."""

    seq_len: int | None = setting(None, default_help="2048; a model's learned positions where fewer: gpt2 1024")
    """Tokens per sequence; None: 2048, or a model's learned positions where fewer (gpt2's 1024)."""
    micro_batch: int | Literal["max"] = TrainSpec.micro_batch
    """Sequences per GPU per forward, or ``"max"``: the largest that fits (per strategy)."""
    grad_accum: int = TrainSpec.grad_accum
    """Micro-batches per optimizer step."""
    precision: str = setting(TrainSpec.precision, choices=PRECISIONS)
    """fp32 | amp-bf16 | amp-fp16 | mixed-bf16 | mixed-fp16 | bf16."""
    reduce_dtype: str | None = setting(None, choices=REDUCE_DTYPES)
    """Gradient reduction dtype (fp32 | bf16 | fp16); None: the precision's compute dtype."""
    optimizer: str = setting(TrainSpec.optimizer, choices=OPTIMIZERS)
    """adamw | adam | sgd | sgd-momentum | adam8bit | adafactor | torch-adafactor | lion | lion8bit |
    paged-adamw8bit (``specs.OPTIMIZERS`` says whose each is)."""
    optimizer_impl: str | None = setting(
        None, choices=OPTIMIZER_IMPLS, default_help="foreach on cuda, single on cpu, as torch"
    )
    """foreach | fused | single; None: torch's default (foreach on cuda, single on cpu)."""
    attention: str = setting(TrainSpec.attention, choices=ATTENTIONS)
    """sdpa | eager."""
    device: str = setting(TrainSpec.device, choices=DEVICES)
    """cuda, or cpu: what the same job allocates on CPU (no CUDA-side overhead)."""
    recipe: str = setting(TrainSpec.recipe, choices=RECIPES)
    """plain | hf-trainer | torchtitan | torchtune | lightning | accelerate: the loop's conventions as that
    framework sets them by default (tables/recipes.csv); the loop settings given win."""


@dataclass(frozen=True, kw_only=True)
class TrainingRequest(LoopSettings, _Step):
    """One optimizer step: what each GPU processes and how, the loop around it (``LoopSettings``,
    None where the recipe sets them) and what is trained (``TrainSpec`` checks the values)."""

    # what is trained (memplan.finetune)
    finetune: str = TrainSpec.finetune
    """full | lora | qlora (LoRA on 4-bit NF4 base weights) | frozen:N (the input embedding and
    the first N blocks frozen)."""
    # the adapters (lora, qlora only); None: TrainSpec's default
    lora_rank: int | None = setting(None, default_help="8")
    """The adapters' rank r (8 where not given)."""
    lora_alpha: float | None = setting(None, default_help="16")
    """LoRA's scaling numerator (16 where not given): accepted, it changes no memory."""
    lora_targets: str | None = setting(None, default_help="attention")
    """attention (a block's q, k, v, o or fused qkv; where not given) | all-linear | a list of a block's
    linears: q,k,v,o,gate,up,down; phi3's fused qkv,gate_up; gpt2's qkv,o,up,down (or c_attn,c_proj,c_fc)."""
    lora_dropout: float | None = setting(None, default_help="0")
    """Dropout on each adapter's input (its output and mask are kept for backward; 0 where not given)."""
    qlora_double_quant: bool | None = setting(None, default_help="on")
    """qlora: bitsandbytes' double quantization of the 4-bit weights' absmax statistics
    (``bnb_4bit_use_double_quant``; off: one fp32 absmax per 64 weights, 0.047 bytes a weight more).
    A config.json's ``quantization_config`` sets it where not given."""
    dora: bool | None = setting(None, default_help="off")
    """peft's DoRA (``LoraConfig(use_dora=True)``) on the adapters: a trained magnitude per output
    feature rescaling each adapted linear (finetune lora only)."""
    use_cache: bool | None = setting(None, default_help="off")
    """Hugging Face's ``use_cache=True`` (its configs' default; off under full AC, which transformers
    turns it off for) in a loop that holds its outputs (logits held): the outputs also hold every
    layer's keys and values until the next forward returns."""

    def __post_init__(self):
        given = [k for k in _LORA if getattr(self, k) is not None]
        if given and self.finetune not in ("lora", "qlora"):
            raise InputError(
                lambda n: (
                    f"{', '.join(n(k) for k in given)} applies to {n('finetune')} lora or qlora only, "
                    f"got {n('finetune')} {self.finetune}"
                ),
                field=given[0],
                value=getattr(self, given[0]),
                accepted="finetune lora or qlora",
            )
        if self.qlora_double_quant is not None and self.finetune != "qlora":
            raise InputError(
                lambda n: (
                    f"{n('qlora_double_quant')} applies to {n('finetune')} qlora only (4-bit base weights), "
                    f"got {n('finetune')} {self.finetune}"
                ),
                field="qlora_double_quant",
                value=self.qlora_double_quant,
                accepted="finetune qlora",
            )
        self.spec()

    def resolved(self):
        """The loop's conventions: the recipe's, with those given here winning (``loop.Resolved``)."""
        return resolve(self.recipe, **{s: getattr(self, s) for s in _LOOP})

    def spec(self) -> TrainSpec:
        """The step at this micro-batch (1 for ``"max"``: searched later)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _LOOP}
        values = {k: v for k, v in values.items() if not (k in _UNSET and v is None)}
        resolved = self.resolved()
        loop = {s: getattr(resolved.loop, s) for s in _LOOP}
        values["activation_checkpointing"] = loop.pop("ac")
        if values["micro_batch"] == "max":
            values["micro_batch"] = 1
        if values["optimizer_impl"] is None:
            values["optimizer_impl"] = next(
                (c.value for c in resolved.elsewhere if c.setting == "optimizer_impl"), None
            )
        return TrainSpec(**values, **loop)


_LOOP = tuple(f.name for f in fields(LoopSettings))
"""The TrainingRequest fields that are loop settings (``loop.Loop``), None where the recipe sets them."""
_LORA = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")
"""The TrainingRequest fields of the adapters, None where not given (TrainSpec's defaults); dora
and qlora_double_quant are each one mode's (``specs.tuning`` and ``__post_init__`` check them)."""
_UNSET = ("seq_len", *_LORA, "dora", "qlora_double_quant", "use_cache")
"""The TrainingRequest fields None where not given: TrainSpec's defaults (seq_len: see ``inputs``)."""


@dataclass(frozen=True, kw_only=True)
class ClusterRequest:
    """The GPUs: how many, how grouped into nodes, which (or how much memory each has)."""

    gpus: int = ClusterSpec.gpus
    """GPUs in all."""
    gpus_per_node: int | None = setting(None, default_help="min(gpus, 8)")
    """GPUs in one node; None: min(gpus, 8)."""
    gpu_mem: float | str | None = None
    """Memory per GPU: GiB (``80``) or with a unit (``"80GB"``, ``"81559MiB"``); 80 GiB where neither
    this nor ``gpu``."""
    gpu: str | None = None
    """A GPU of tables/gpus.csv (``"h100-sxm"``): its memory, speed and links."""
    headroom: float = ClusterSpec.headroom
    """Fraction of each GPU's memory kept free."""
    alloc_conf: str = ""
    """The ``PYTORCH_CUDA_ALLOC_CONF`` the job runs with (``"expandable_segments:True"``): what the
    caching allocator's replay follows for ``reserved``."""

    def __post_init__(self):
        parse_alloc_conf(self.alloc_conf)
        if self.gpu is not None and self.gpu_mem is not None:
            raise InputError(
                lambda n: f"give {n('gpu')} NAME or {n('gpu_mem')} SIZE, not both",
                field="gpu_mem",
                value=self.gpu_mem,
                accepted="gpu or gpu_mem, not both",
            )
        if self.gpus_per_node is not None and (
            not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 1
        ):
            raise InputError(
                lambda n: f"{n.word('gpus_per_node')} must be a positive integer, got {self.gpus_per_node!r}",
                field="gpus_per_node",
                value=self.gpus_per_node,
                accepted="a positive integer (or none given: min(gpus, 8))",
            )
        ClusterSpec(gpus=self.gpus, gpus_per_node=self.gpus_per_node or 0, headroom=self.headroom)


@dataclass(frozen=True, kw_only=True)
class StrategyRequest:
    """How the step is distributed: one strategy or all of them, and what is offloaded."""

    strategy: str = setting("all", choices=("all", *STRATEGIES))
    """A strategy id of memplan.STRATEGIES, or all: every one that runs on the cluster with this offload."""
    offload: str = setting(Plan.offload, choices=OFFLOADS)
    """none | optimizer | params | all: what lives in host RAM."""
    ep: int = Plan.ep
    """Expert-parallel degree of an MoE model (moves into the Layout at merge)."""
    zero: ZeroConfig | None = None
    """DeepSpeed's ``zero_optimization`` settings (a ZeRO strategy's buckets and thresholds); None:
    those ``--emit deepspeed`` writes. ``--from ds_config.json`` reads them from the user's file."""
    # DistributedDataParallel's keywords of the same names (the ddp strategy's; specs.Plan)
    gradient_as_bucket_view: bool = Plan.gradient_as_bucket_view
    """DDP: gradients as views into the all-reduce buckets, not a second copy of them (the ddp
    strategy's; the others have no such keyword)."""
    bucket_cap_mb: float | None = setting(None, default_help="DDP's 25, the first bucket 1")
    """DDP: all-reduce bucket size in MiB: accepted, it changes no memory (the buckets hold every
    gradient whatever their size; measured, validation/records/ddp_kwargs_cpu.md)."""
    static_graph: bool = Plan.static_graph
    """DDP: the graph declared static: accepted, it changes no memory after the first step (measured)."""
    reshard_after_forward: int | None = setting(None, default_help="full shard's: all the shard group")
    """FSDP2 full shard: ``fully_shard(reshard_after_forward=N)``, each unit resharded after forward to
    a group of N ranks (a factor of the shard group, e.g. the GPUs of a node): its 1/N copy kept until
    its backward, which gathers from those N ranks."""
    fsdp_wrap: str = setting(Plan.fsdp_wrap, choices=FSDP_WRAPS)
    """FSDP's units: blocks (each decoder block a unit: fully_shard per block, auto_wrap_policy={the
    decoder layer}); none (no wrapping policy: the whole model one FSDP1 unit, as Lightning's
    FSDPStrategy() and accelerate's NO_WRAP wrap it), for the sharded FSDP strategies."""

    def __post_init__(self):
        if self.zero is not None and not isinstance(self.zero, ZeroConfig):
            raise InputError(
                f"zero must be a memplan.specs.ZeroConfig, got {type(self.zero).__name__}",
                field="zero",
                value=self.zero,
                accepted="a ZeroConfig",
            )

        # DDP's keywords and the reshard group checked (each strategy's plan holds them)
        Plan(strategy="ddp", reshard_after_forward=self.reshard_after_forward, **self.ddp_kwargs())
        for name, value, accepted in (
            ("strategy", self.strategy, ("all", *STRATEGIES)),
            ("offload", self.offload, OFFLOADS),
        ):
            if value not in accepted:
                raise InputError(
                    f"{name} {value!r} is not one of: {', '.join(accepted)}",
                    field=name,
                    value=value,
                    accepted=", ".join(accepted),
                )
        if self.gradient_as_bucket_view and self.strategy != "all" and STRATEGIES[self.strategy].framework != "ddp":
            # the one DDP keyword that changes memory; the other two change none under any strategy
            raise InputError(
                lambda n: (
                    f"{n('gradient_as_bucket_view')} is DistributedDataParallel's keyword; strategy {self.strategy} "
                    "has no such keyword (it applies to strategy ddp, or all: the search's DDP options)"
                ),
                field="gradient_as_bucket_view",
                value=True,
                accepted="strategy ddp or all",
            )

        if self.fsdp_wrap == "none" and self.strategy not in ("all", *ONE_UNIT_STRATEGIES):
            raise InputError(
                lambda n: (
                    f"{n('fsdp_wrap')} none wraps a sharded FSDP strategy's model as one unit; strategy "
                    f"{self.strategy} has no FSDP units (use {', '.join(ONE_UNIT_STRATEGIES)}, or all)"
                ),
                field="fsdp_wrap",
                value=self.fsdp_wrap,
                accepted=f"strategy {', '.join(ONE_UNIT_STRATEGIES)} or all",
            )
        if self.reshard_after_forward is not None and self.strategy not in ("all", "fsdp-full-shard"):
            raise InputError(
                lambda n: (
                    f"{n('reshard_after_forward')} {self.reshard_after_forward} is FSDP2 full shard's; strategy "
                    f"{self.strategy} has no post-forward reshard group (use fsdp-full-shard, or all)"
                ),
                field="reshard_after_forward",
                value=self.reshard_after_forward,
                accepted="strategy fsdp-full-shard or all",
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        """DistributedDataParallel's keywords as ``Plan`` takes them."""
        return {k: getattr(self, k) for k in DDP_KEYWORDS}


@dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    """The mesh beyond data parallel (``layout.Layout`` checks the values, ``Job`` them against the model)."""

    tp: int = Layout.tp
    """Tensor parallel degree (column/row-parallel linears, vocabulary-parallel embedding and head)."""
    sp: bool | None = setting(None, default_help="on; off under tp-plan blocks")
    """Sequence parallel with tp > 1 (norms and dropout sharded over the sequence)."""
    tp_plan: str = setting(Layout.tp_plan, choices=TP_PLANS)
    """torchtitan (vocabulary-parallel embedding and head, loss parallel) | tutorial (PyTorch's TP
    tutorial with SP: full-vocabulary logits on every rank) | blocks (the blocks alone: embedding
    and head replicated, no SP); see ``layout.TP_PLANS``."""
    cp: int = Layout.cp
    """Context parallel degree (ring attention over the sequence)."""
    pp: int = Layout.pp
    """Pipeline parallel degree (stages of layers)."""
    pp_schedule: str = setting(Layout.pp_schedule, choices=PP_SCHEDULES)
    """gpipe | 1f1b | interleaved-1f1b | zero-bubble."""
    pp_microbatches: int = setting(Layout.pp_microbatches, default_help="pp")
    """Micro-batches per pipeline step; 1: as many as stages."""
    pp_virtual: int = Layout.pp_virtual
    """Stages per rank (interleaved-1f1b, zero-bubble)."""
    async_tp: bool = Layout.async_tp
    """Async TP: micro-pipelined TP collectives over CUDA symmetric memory (modelled, not measured)."""

    def __post_init__(self):
        self.spec()

    def spec(self) -> Layout:
        if self.sp and self.tp_plan == "blocks":
            raise InputError(
                lambda n: (
                    f"{n('sp')} does not apply to {n('tp_plan')} blocks (the blocks alone: no SequenceParallel "
                    f"norms); drop it, or take {n('tp_plan')} tutorial"
                ),
                field="sp",
                value=True,
                accepted="no sp with tp_plan blocks",
            )
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return Layout(**{k: v for k, v in given.items() if v is not None})  # sp None: the plan's


PARTS = {
    "model": ModelRequest,
    "training": TrainingRequest,
    "cluster": ClusterRequest,
    "plan": StrategyRequest,
    "layout": LayoutRequest,
}


def _fields() -> dict[str, tuple[str, Field]]:
    return {f.name: (part, f) for part, cls in PARTS.items() for f in fields(cls)}


FIELDS = _fields()
"""Every input by its keyword: (the part of a Request holding it, its dataclass field)."""


def default(keyword: str) -> Any:
    """An input's default (every input has a plain one)."""
    return FIELDS[keyword][1].default


def unknown_keyword(keyword: str, where: str, accepted: tuple[str, ...] = tuple(FIELDS)) -> UnknownKeywordError:
    """Python's message for a keyword a function does not take, with the nearest accepted one."""
    import difflib

    close = difflib.get_close_matches(keyword, accepted, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]!r}?" if close else f"accepted: {', '.join(sorted(accepted))}"
    return UnknownKeywordError(
        f"{where} got an unexpected keyword argument {keyword!r}; {hint}", keyword=keyword, accepted=accepted
    )


@dataclass(frozen=True, kw_only=True)
class Request:
    """Everything one question to memplan needs: ``Request.of(params=13e9, gpus=8, gpu_mem=80)``."""

    model: ModelRequest
    training: TrainingRequest = field(default_factory=TrainingRequest)
    cluster: ClusterRequest = field(default_factory=ClusterRequest)
    plan: StrategyRequest = field(default_factory=StrategyRequest)
    layout: LayoutRequest = field(default_factory=LayoutRequest)

    def __post_init__(self):
        for name, cls in PARTS.items():
            if not isinstance(getattr(self, name), cls):
                raise InputError(
                    f"Request {name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}",
                    field=name,
                    value=getattr(self, name),
                    accepted=cls.__name__,
                )

    @classmethod
    def of(cls, base: Request | None = None, /, **inputs) -> Request:
        """A request from inputs by keyword (``micro_batch=4``), over ``base`` where given. Any
        model keyword names the model anew (``model="gpt2"`` replaces the base's ``params``)."""
        for keyword in inputs:
            if keyword not in FIELDS:
                raise unknown_keyword(keyword, "Request.of()")
        if base is not None and not isinstance(base, Request):
            raise InputError(
                f"request must be a Request, got {type(base).__name__}",
                field="request",
                value=base,
                accepted="a memplan.Request",
            )
        parts = {}
        for name, part in PARTS.items():
            mine = {k: v for k, v in inputs.items() if FIELDS[k][0] == name}
            if base is None or (name == "model" and mine):
                parts[name] = part(**mine)
            else:
                parts[name] = replace(getattr(base, name), **mine) if mine else getattr(base, name)
        return cls(**parts)

    def inputs(self) -> dict[str, Any]:
        """Every input by its keyword, as ``Request.of`` takes them."""
        return {k: getattr(getattr(self, part), k) for k, (part, _) in FIELDS.items()}

    def with_(self, **inputs) -> Request:
        """A copy with inputs changed by keyword; model keywords replace the model."""
        return Request.of(self, **inputs)
