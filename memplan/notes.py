"""What an estimate models without a measurement behind it, said beside its numbers: the
loop's conventions modelled from a framework's source, a fine-tune's counts under frameworks
not measured with it, and the paged optimizer states outside torch's counters."""

from __future__ import annotations

from .finetune import _paged_bytes, trained_tensors
from .specs import Job
from .step import Step
from .strategies import STRATEGIES

# what the loop's conventions add that is modelled from the framework's source but not measured
_UNMEASURED = (
    (
        lambda t: t.loss == "fused-linear-ce",
        "fused-linear-ce (Liger's) is modelled from its source, not measured (its Triton kernels do not run on CPU)",
    ),
    (
        lambda t: t.loss == "cce-compile",
        "cce-compile is cut-cross-entropy's torch_compile implementation, measured on CPU (inductor); "
        "its default Triton one (impl='cce', GPU only; no logits tensor) is not modelled",
    ),
    (
        lambda t: t.offload_activations,
        "activation offloading is measured on CPU through a replica of torchtune's pack/unpack decisions "
        "(its class needs CUDA); its streams' overlap and pinned host buffers are not measured",
    ),
    (
        lambda t: t.activation_checkpointing == "op" and t.attention == "sdpa" and t.device == "cuda",
        "op SAC saving the CUDA sdpa kernels' outputs is modelled, not measured (CPU's flash kernel is recomputed)",
    ),
    (lambda t: t.compile, "the compiled loss's backward is modelled, its saved tensors measured"),
    (
        lambda t: t.float8,
        "float8 keeps what bf16 keeps (measured on CPU, torchao Float8Linear); "
        "its fp8 casts are transient, not modelled",
    ),
)


def loop_notes(job: Job) -> tuple[str, ...]:
    """What the estimate models of the training loop without a measurement behind it."""
    return tuple(note for applies, note in _UNMEASURED if applies(job.train))


def paged_state_bytes(job) -> int:
    """Bytes of paged 8-bit states per GPU that live in CUDA unified memory, outside torch's counters."""
    step = Step(job)
    nbytes = sum(_paged_bytes(job.train.optimizer, job.train.device, t) for t in trained_tensors(step))
    return step.local(nbytes, step.strategy.shards_optimizer)


def finetune_notes(job) -> tuple[str, ...]:
    """What the estimate models of a fine-tune without a measurement behind it."""
    tuning, strategy = job.train.tuning, STRATEGIES[job.plan.strategy]
    notes = []
    if tuning.mode == "qlora" and strategy.framework != "ddp" and strategy.id != "single":
        notes.append(
            f"qlora under {strategy.id} is modelled with NF4 shards gathered in the compute dtype "
            "(FSDP-QLoRA's bnb_4bit_quant_storage gathers them packed): an upper bound, not measured"
        )
    if tuning.mode != "full" and strategy.framework == "deepspeed":
        notes.append(f"{tuning.mode} under DeepSpeed is modelled as under FSDP's counts, not measured")
    if job.train.optimizer == "paged-adamw8bit" and job.train.device == "cuda":
        notes.append(
            f"paged-adamw8bit: {paged_state_bytes(job) / 2**30:.2f} GiB of 8-bit states (tensors of ≥ 1e5 elements) "
            "live in CUDA unified memory (cudaMallocManaged), outside torch's allocator counters and this "
            "estimate; the driver pages them to host RAM under pressure"
        )
    if tuning.mode != "full" and job.train.device == "cuda":
        notes.append(
            "fine-tuning is measured on CPU (validation/records/finetune_matrix_cpu.md); CUDA's dropout mask is 1 byte"
        )
    return tuple(notes)
