"""How one job's GPUs are arranged beyond data parallel: the device mesh dp × tp × cp × pp
(× ep where it folds, issue 14), with the pipeline's schedule.

``Layout`` checks its own fields; ``check_layout`` checks it against the model, the step and
the cluster once the job is put together. The default layout (every degree 1) is the
data-parallel job memplan always planned.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
"""torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble (torchtitan's pipeline_parallel_schedule names them)."""
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")
"""The schedules that run several (virtual) stages per rank."""


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
        if self.pp_schedule not in PP_SCHEDULES:
            raise _refuse("pp_schedule", self.pp_schedule, ", ".join(PP_SCHEDULES))
        if self.pp_virtual > 1 and self.pp_schedule not in MULTI_STAGE:
            raise _refuse(
                "pp_virtual", self.pp_virtual, f"1 with {self.pp_schedule}", f"needs one of {', '.join(MULTI_STAGE)}"
            )

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
            [f"TP {self.tp}" + (" + SP" if self.sp else "") + (" (async)" if self.async_tp else "")]
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
