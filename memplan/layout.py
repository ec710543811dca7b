"""How one job's GPUs are arranged beyond data parallel: the device mesh dp × tp × cp × pp
(× ep where it folds, issue 14), with the pipeline's schedule.

``Layout`` checks its own fields; ``check_layout`` checks it against the model, the step and
the cluster once the job is put together. The default layout (every degree 1) is the
data-parallel job memplan always planned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import InputError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
"""torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble (torchtitan's pipeline_parallel_schedule names them)."""
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")
"""The schedules that run several (virtual) stages per rank."""
TP_PLANS = ("torchtitan", "tutorial", "blocks")
"""Which modules ``parallelize_module`` shards under ``tp`` > 1, and how the loss runs (every plan
shards the blocks alike: q, k, v, gate, up ColwiseParallel, o, down RowwiseParallel):

- torchtitan: torchtitan's ``apply_tp`` (torchtitan/models/llama3/parallelize.py): the embedding
  RowwiseParallel and the head ColwiseParallel over the vocabulary, the logits kept sharded for
  ``loss_parallel``; SequenceParallel norms with ``sp``.
- tutorial: PyTorch's TP tutorial's sequence-parallel plan (pytorch/examples
  distributed/tensor_parallelism/fsdp_tp_example.py): the embedding and head vocabulary-parallel
  as torchtitan's and SequenceParallel norms (``sp`` only), but the head's output all-gathered
  (``output_layouts=Replicate()``): full-vocabulary logits and loss on every rank.
- blocks: the tutorial's first plan (its ``layer_tp_plan`` alone, as Hugging Face's
  ``base_model_tp_plan`` shards a llama's blocks): the embedding, final norm and head replicated,
  full-vocabulary logits and loss on every rank, no sequence parallel (``sp`` is False under it).

Measured: validation/records/tp_plan_cpu.md (``python -m validation.tp_plan``)."""


def _refuse(name: str, value, accepted: str, why: str = "") -> InputError:
    return InputError(
        lambda n: f"{n.word(name)} {value!r} {why or 'is not accepted'}; accepted: {accepted}",
        field=name,
        value=value,
        accepted=accepted,
    )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The parallel degrees of one job; every GPU runs one rank of the mesh."""

    tp: int = 1
    """Tensor parallel degree: Megatron column/row-parallel linears (``parallelize_module``)."""
    sp: bool = True
    """Sequence parallel with tp > 1: norms and dropout sharded over the sequence (torchtitan's
    default); False keeps them replicated."""
    cp: int = 1
    """Context parallel degree: the sequence split over ranks, ring attention."""
    pp: int = 1
    """Pipeline parallel degree: the layers split into stages."""
    pp_schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved-1f1b | zero-bubble."""
    pp_microbatches: int = 1
    """Micro-batches (each of ``micro_batch`` sequences) per pipeline step; 1: as many as stages."""
    pp_virtual: int = 1
    """Stages per rank (interleaved-1f1b, zero-bubble)."""
    tp_plan: str = "torchtitan"
    """torchtitan | tutorial | blocks: which modules the TP plan shards (``TP_PLANS``)."""
    async_tp: bool = False
    """Async TP (torchtitan's ``compile.enable_async_tensor_parallel``: inductor's micro-pipelined
    all-gather-matmul and matmul-reduce-scatter over CUDA symmetric memory); needs tp > 1 with SP."""

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "pp_microbatches", "pp_virtual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _refuse(name, value, "a positive integer")
        if not isinstance(self.sp, bool):
            raise _refuse("sp", self.sp, "true or false")
        if not isinstance(self.async_tp, bool):
            raise _refuse("async_tp", self.async_tp, "true or false")
        if self.async_tp and (self.tp == 1 or not self.sp):
            # the fused ops replace SP's all-gathers and reduce-scatters
            # (torch/_inductor/fx_passes/micro_pipeline_tp.py)
            raise _refuse(
                "async_tp", self.async_tp, "with tp > 1 and sp", "needs tensor parallel with sequence parallel"
            )
        self._check_tp_plan()
        if self.pp_schedule not in PP_SCHEDULES:
            raise _refuse("pp_schedule", self.pp_schedule, ", ".join(PP_SCHEDULES))
        if self.pp_virtual > 1 and self.pp_schedule not in MULTI_STAGE:
            raise _refuse(
                "pp_virtual", self.pp_virtual, f"1 with {self.pp_schedule}", f"needs one of {', '.join(MULTI_STAGE)}"
            )

    def _check_tp_plan(self) -> None:
        if self.tp_plan not in TP_PLANS:
            raise _refuse("tp_plan", self.tp_plan, ", ".join(TP_PLANS))
        if self.tp_plan == "torchtitan":
            return
        if self.tp == 1:
            raise _refuse("tp_plan", self.tp_plan, "torchtitan with tp 1", "needs tensor parallel (tp > 1)")
        if self.tp_plan == "blocks":
            object.__setattr__(self, "sp", False)  # the plan has no SequenceParallel norms
        elif not self.sp:
            raise _refuse("tp_plan", self.tp_plan, "tutorial with sp, or blocks", "is measured with sp only")
        # measured with TP alone and FSDP2 × TP (validation/records/tp_plan_cpu.md), not beside these
        beside = (("cp", self.cp, 1), ("pp", self.pp, 1), ("async_tp", self.async_tp, False))
        unmeasured = next(((k, v, p) for k, v, p in beside if v != p), None)
        if unmeasured:
            name, value, plain = unmeasured
            raise InputError(
                lambda n: (
                    f"{n.word(name)} {value!r} is not measured with {n.word('tp_plan')} {self.tp_plan}; "
                    f"accepted: {plain!r}, or {n.word('tp_plan')} torchtitan"
                ),
                field=name,
                value=value,
                accepted=f"{plain!r} with tp_plan {self.tp_plan}",
            )

    @property
    def vocab_tp(self) -> int:
        """The TP ranks the embedding and head are split over (1: replicated, ``TP_PLANS``); the
        parameters, gradients and optimizer states of a replicated one are whole on each TP rank,
        sharded over dp only under FSDP2 (measured: validation/records/tp_plan_cpu.md, TP alone to
        the byte)."""
        return 1 if self.tp_plan == "blocks" else self.tp

    @property
    def loss_parallel(self) -> bool:
        """Whether the logits stay sharded over the vocabulary into the loss (torchtitan's plan)."""
        return self.tp > 1 and self.tp_plan == "torchtitan"

    @property
    def logits_tp(self) -> int:
        """The TP ranks the logits and the loss's tensors are split over: loss parallel's tp, else
        1 (the tutorial's ``output_layouts=Replicate()`` all-gathers them, a replicated head makes
        them whole; measured: validation/records/tp_plan_cpu.md)."""
        return self.tp if self.loss_parallel else 1

    def as_dict(self) -> dict:
        """The fields as a JSON report states them: ``tp_plan`` where it is not torchtitan's
        (added later: reports of torchtitan's plan read as before it)."""
        out = asdict(self)
        if self.tp_plan == "torchtitan":
            del out["tp_plan"]
        return out

    @property
    def model_parallel(self) -> int:
        """GPUs one model replica spans: tp × cp × pp."""
        return self.tp * self.cp * self.pp

    @property
    def is_data_parallel(self) -> bool:
        """Every degree 1: the job memplan plans without a layout."""
        return self == DATA_PARALLEL

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline step (1 without a pipeline; as many as stages where unset)."""
        if self.pp == 1:
            return 1
        return self.pp_microbatches if self.pp_microbatches > 1 else self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp × virtual stages per rank."""
        return self.pp * self.pp_virtual

    def dp(self, gpus: int) -> int:
        """The data-parallel degree over what the model-parallel dimensions leave."""
        return gpus // self.model_parallel

    def describe(self) -> str:
        parts = (
            [
                f"TP {self.tp}"
                + (" + SP" if self.sp else "")
                + (" (async)" if self.async_tp else "")
                + (f" ({self.tp_plan} plan)" if self.tp_plan != "torchtitan" else "")
            ]
            if self.tp > 1
            else []
        )
        parts += [f"CP {self.cp}"] if self.cp > 1 else []
        if self.pp > 1:
            virtual = f" × {self.pp_virtual} virtual" if self.pp_virtual > 1 else ""
            parts.append(f"PP {self.pp}{virtual} ({self.pp_schedule}, {self.microbatches} micro-batches)")
        return " × ".join(parts) or "data parallel"


DATA_PARALLEL = Layout()


def check_layout(
    layout: Layout, *, gpus: int, heads: int, kv_heads: int, ffn: int, vocab: int, layers: int, seq_len: int
):
    """The layout against the job: the mesh divides the GPUs, TP the heads, kv-heads, MLP and
    vocabulary, the pipeline's stages the layers, CP the sequence (one-line errors naming the value)."""
    if gpus % layout.model_parallel:
        raise _refuse(
            "gpus",
            gpus,
            f"a multiple of tp × cp × pp = {layout.model_parallel}",
            f"is not dp × tp {layout.tp} × cp {layout.cp} × pp {layout.pp}",
        )
    for what, count in (("heads", heads), ("kv_heads", kv_heads), ("ffn", ffn), ("vocab", vocab)):
        if count % layout.tp:
            raise _refuse(
                "tp", layout.tp, f"a divisor of {what.replace('_', '-')} {count}", f"does not divide {what} {count}"
            )
    if layers < layout.stages:
        raise _refuse(
            "pp",
            layout.pp,
            f"pp × pp-virtual ≤ layers {layers}",
            f"× pp-virtual {layout.pp_virtual} leaves a stage without layers",
        )
    if layout.pp > 1 and layout.pp_schedule != "gpipe" and layout.microbatches < layout.pp:
        # Schedule1F1B and the interleaved ones refuse fewer micro-batches than ranks (schedules.py)
        raise _refuse(
            "pp_microbatches", layout.pp_microbatches, f"at least pp {layout.pp}", f"is fewer than pp {layout.pp}"
        )
    if layout.pp_virtual > 1 and layout.microbatches % max(1, layout.microbatches // layout.pp):
        # ScheduleInterleaved1F1B: rounds = max(1, M // pp) must divide M
        raise _refuse(
            "pp_microbatches", layout.pp_microbatches, f"a multiple of pp {layout.pp}", "does not split into rounds"
        )
    if seq_len % (2 * layout.cp) and layout.cp > 1:
        # context_parallel's load balancing cuts the sequence into 2·cp chunks (_attention.py)
        raise _refuse(
            "cp", layout.cp, f"a degree with seq-len {seq_len} divisible by 2 × cp", "does not split the sequence"
        )
