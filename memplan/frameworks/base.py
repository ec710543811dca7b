"""What every framework adapter says, and the text helpers their emitters share.

An adapter is one module per framework (``single``, ``ddp``, ``fsdp``, ``deepspeed``) that
says which buffers the framework holds at each instant of the step, which precision
policies it runs natively, and how a recommended job is written for it (``--emit``). The
calibration harness wraps a model with the same framework ids (``calibrate/wrappers.py``),
since memplan never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

from ..breakdown import Term
from ..errors import MemplanError
from ..moments import MomentSpec
from ..precision import POLICIES
from ..specs import Job
from ..strategies import Strategy


class Step(Protocol):
    """What the base adapter reads of a step. The step (``memplan.step.Step``) sits above the
    adapters and hands itself to them; an adapter reads its quantities (``gather_bytes``,
    ``block_params``, ``block_terms`` …) and returns terms and moments."""

    params_on_host: bool


Emitter = Callable[[Job, Strategy], str]
"""Writes one ``--emit`` kind for a job under one of the framework's strategies."""

TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


class Framework:
    """One framework as the memory model, the emitters and the harness see it."""

    id: ClassVar[str]
    """The id ``Strategy.framework`` names."""
    label: ClassVar[str]
    native_precisions: ClassVar[tuple[str, ...]]
    """Precision policies the framework runs without hand-written code (``memplan.frameworks.runs_natively``)."""
    distributed: ClassVar[bool] = True
    """Launched one process per GPU (torchrun); False: a plain ``python`` run."""
    offload_moves_states: ClassVar[bool] = False
    """Offloading parameters moves gradients and the optimizer step to the host with them."""
    shard_is_master: ClassVar[bool] = False
    """Under a mixed policy the fp32 parameter shard is the master copy (no separate one)."""
    block_grads_after_reduce: ClassVar[bool] = False
    """A block's sharded gradients exist only after its reduce-scatter (inside its backward
    they are the unsharded gradients of ``gathered``)."""
    steps_flat_partition: ClassVar[bool] = False
    """The optimizer steps one flat tensor of the local partition, not the model's tensors."""
    emitters: ClassVar[dict[str, Emitter]] = {}
    """``--emit`` kinds this framework writes, beyond accelerate and torchrun."""
    has_first_block_end: ClassVar[bool] = False
    """The step has ``step.FIRST_BLOCK_END`` where its job allows it (one GPU, DDP: measured)."""
    sums_tied_grads: ClassVar[bool] = True
    """A trained tied embedding's two gradients are summed out of place (``step.TIED_SUM``); FSDP's
    root unit holds them at its own moment, DeepSpeed's buckets are not measured so."""
    unsharded_head_grads: ClassVar[bool] = False
    """The head weight's gradient is made unsharded, in the gathered parameters' dtype."""

    def persistent_buffers(self, step: Step) -> list[Term]:
        """Buffers held for the whole step."""
        return []

    def grads_on_host(self, step: Step) -> bool:
        """The gradients live in host RAM (with the states that offloading moves there)."""
        return self.offload_moves_states and step.params_on_host

    def host_buffers(self, step: Step) -> list[Term]:
        """The framework's own buffers in host RAM when it offloads."""
        return []

    def grads_held(self, step: Step) -> bool:
        """The gradients' storage is allocated before the step and held through it."""
        return False

    def grads_at_step(self, step: Step) -> bool:
        """The gradients are still allocated while the optimizer steps."""
        return True

    def gathered(self, step: Step, instant: str) -> list[Term]:
        """Unsharded parameters and gradient buffers held at ``instant``: forward, loss
        (start of backward) or block (inside a block's backward)."""
        return []

    def first_block_gathered(self, step: Step, block: list[Term]) -> list[Term]:
        """What ``gathered(step, "block")`` holds at the first block's backward instead."""
        return block

    def step_buffers(self, step: Step) -> list[Term]:
        """Buffers of optimizer.step() beyond the optimizer's own temporaries."""
        return []

    def holds_root_grads(self, step: Step) -> bool:
        """A root unit holds its gradients unsharded after the input embedding's backward."""
        return False

    def applies_head_once(self, step: Step) -> bool:
        """The step has the framework's moment of the LM head's backward, the head applied once."""
        return False

    def moment_groups(self, step: Step, groups: dict[str, list[Term]]) -> dict[str, list[Term]]:
        """The groups of terms the framework's own moments add to (or replace in) ``groups``."""
        return {}

    def schedule(self, step: Step, specs: tuple[MomentSpec, ...]) -> tuple[MomentSpec, ...]:
        """The step's moments with the framework's own inserted, each by the name of a moment
        (``moments.insert``)."""
        return specs

    def accelerate(self, job: Job, strategy: Strategy) -> dict:
        """accelerate's ``distributed_type`` and this framework's section of its config."""
        raise NotImplementedError

    def accelerate_mixed_precision(self, job: Job) -> str:
        """accelerate's ``mixed_precision`` for the job's policy."""
        compute = POLICIES[job.train.precision].compute_dtype
        return compute if compute != "fp32" else "no"

    def accelerate_note(self, job: Job) -> str:
        """A comment line the accelerate config needs beside it."""
        return ""


def header(job: Job) -> str:
    t, c, p = job.train, job.cluster, job.plan
    return (
        f"memplan: {p.strategy}, {t.precision}, AC {t.activation_checkpointing}, offload {p.offload}, "
        f"micro-batch {t.micro_batch} x accum {t.grad_accum}, seq {t.seq_len}, {c.gpus} GPUs "
        f"({c.num_nodes} x {c.gpus_per_node})"
    )


def needs(job: Job, kind: str, allowed) -> None:
    if job.plan.strategy not in allowed:
        raise MemplanError(
            lambda n: (
                f"{n('emit')} {kind} does not apply to strategy {job.plan.strategy}; it needs one of: "
                f"{', '.join(allowed)} (pass {n('strategy')}, or pick another {n('emit')})"
            )
        )
