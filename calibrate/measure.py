"""Run a few real training steps of a memplan Job in this process and measure them.

The process group must already be initialised (``gloo``/``nccl`` for a real job,
``fake`` for an emulated rank of a larger one); see ``calibrate.launch``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memplan.loop import loss_in_model
from memplan.precision import POLICIES
from memplan.specs import Job
from memplan.strategies import STRATEGIES

from .workloads import blocks, build_model, make_batch
from .wrappers import DTYPES, Unsupported, wrap


@dataclass
class Measurement:
    peak_allocated_bytes: int
    phase: str
    categories: dict[str, int]
    step_time_s: float
    tokens_per_s: float
    device: str
    world_size: int
    emulated: bool
    torch_version: str = torch.__version__
    peak_reserved_bytes: int | None = None
    device_used_bytes: int | None = None
    num_alloc_retries: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)


def _optimizer(model: nn.Module, job: Job) -> torch.optim.Optimizer:
    name, impl = job.train.optimizer, job.train.optimizer_impl
    # keyword flags shared by torch's optimizers (each constructor types them apart)
    flags: dict[str, Any] = {"foreach": impl == "foreach", "fused": impl == "fused" or None}
    if impl == "fused":
        flags["foreach"] = None
    params = model.parameters()
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-4, **flags)
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd-momentum" else 0.0, **flags)
    if name == "adam8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-4)
    if name in ("lion", "lion8bit", "paged-adamw8bit"):
        import bitsandbytes as bnb

        # the HF Trainer's optim="lion_32bit" / "lion_8bit" / "paged_adamw_8bit"; on CPU a paged
        # optimizer falls back to ordinary tensors (Optimizer8bit.get_state_buffer)
        bnb_cls = {"lion": bnb.optim.Lion, "lion8bit": bnb.optim.Lion8bit, "paged-adamw8bit": bnb.optim.PagedAdamW8bit}
        return bnb_cls[name](params, lr=1e-4)
    if name == "torch-adafactor":
        return torch.optim.Adafactor(params, lr=1e-4, foreach=impl == "foreach")
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # the HF Trainer's optim="adafactor" (Trainer.get_optimizer_cls_and_kwargs): no first moment
        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False)
    raise Unsupported(f"optimizer {name} is not available in the calibration harness")


def chunked_ce(chunks: list[torch.Tensor], labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """torchtune's CEWithChunkedOutputLoss.forward (modules/loss/ce_chunked_output_loss.py),
    transcribed so that it runs where torchtune is not installed: each chunk upcast to fp32
    inside its own cross-entropy (reduction sum), over the count of labelled tokens."""
    total_elements = (labels != ignore_index).sum()
    total: Any = 0.0
    for logits, target in zip(chunks, labels.chunk(len(chunks), dim=1)):
        total = total + F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=ignore_index, reduction="sum"
        )
    return total / total_elements


def _micro_step(model: nn.Module, inputs, labels, train, autocast, on_forward_end) -> None:
    """One micro-batch's forward and backward as the job's loop writes it: the logits kept
    through backward or dropped before it (``logits``), or the chunked output and loss."""
    if train.loss == "chunked-ce":
        with autocast:
            _, chunks = model(inputs, labels, chunks=train.loss_chunks)
            loss = chunked_ce(chunks, labels)
        del chunks  # torchtune's recipe: del logits before backward
        on_forward_end()
        (loss / train.grad_accum).backward()
        return
    if train.loss != "ce":
        raise Unsupported(f"loss {train.loss} is not in the calibration harness (ce, chunked-ce)")
    with autocast:
        if loss_in_model(train.recipe):
            loss, logits = model(inputs, labels)
        else:
            # torchtitan's train_step (0.3.0 trainer.py forward_backward_step): pred = model(inputs),
            # then loss_fn(pred, labels) outside the model, after FSDP's root post-forward
            _, logits = model(inputs, None)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
    if train.logits == "freed":
        del logits
        logits = None
    on_forward_end()
    (loss / train.grad_accum).backward()
    del loss, logits


def _zero_grad(optimizer, zero_grad: str) -> None:
    """The recipe's clearing (``Loop.zero_grad``): torchtitan keeps its gradients allocated,
    zero-filled in place (``Optimizer.zero_grad(set_to_none=False)``), which DTensor refuses for
    a tensor-parallel norm's Partial gradient under torch 2.13 (``aten._foreach_zero_``: no
    strategy preserves the placement): each gradient's local tensor is zeroed instead, the same
    bytes. After-forward (Lightning's closure) clears them in the next forward's end instead."""
    if zero_grad == "after-forward":
        return
    if zero_grad == "none":
        optimizer.zero_grad(set_to_none=True)
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    getattr(p.grad, "_local_tensor", p.grad).zero_()


def _compile_blocks(model: nn.Module) -> None:
    """torch.compile (inductor) of each transformer block in place, before wrapping, as
    torchtitan's apply_compile and torchtune's compile_model do; the loss is not compiled."""
    for block in blocks(model):
        block.compile()


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        return None


def _frozen_aware_tracker():
    """torch's MemTracker, which registers a gradient hook on every parameter of a module and
    so fails on frozen ones (torch 2.13, mem_tracker.py _track_module_params_and_buffers):
    frozen parameters are marked as hooked already, with handles that remove nothing.

    Its ModTracker also keeps alive, after their backward, every module input that is a leaf
    requiring grad (the output of a frozen input embedding that ``enable_input_require_grads``
    marks, as peft does under gradient checkpointing) with the gradient accumulated into it:
    the multi-grad hook mod_tracker.py ``_fw_pre_hook`` registers on a module's inputs
    (autograd/graph.py register_multi_grad_hook, mode "all") closes over their grad_fns, and a
    grad_fn holds the hook (a cycle through C++ that gc cannot collect), and through its edges
    the graph below it down to the leaf's AccumulateGrad, which holds the leaf (measured: one
    leaf and its .grad kept per step, none without the tracker; a parameter is kept anyway).
    Those hooks are removed when the next step starts (``release_input_hooks``), their backward
    having run.
    """
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareMemTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._input_hooks: list = []

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _register_multi_grad_hook(self, tensors, fn, *, mode="all"):
            handle = self._register(tensors, fn, mode=mode)
            if mode == "all":
                self._input_hooks.append(handle)
            return handle

        def release_input_hooks(self) -> None:
            for handle in self._input_hooks:
                handle.remove()
            self._input_hooks = []

        def __enter__(self):
            self._register = mod_tracker.register_multi_grad_hook
            mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook
            return super().__enter__()

        def __exit__(self, *args):
            mod_tracker.register_multi_grad_hook = self._register
            self.release_input_hooks()
            return super().__exit__(*args)

    return FrozenAwareMemTracker()


class _CpuMeter:
    """Peak live tensor bytes by category from torch's MemTracker (CPU ground truth)."""

    def __init__(self):
        self.tracker = _frozen_aware_tracker()
        self.device = torch.device("cpu")

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)

    def new_step(self):
        self.tracker.release_input_hooks()
        self.tracker.reset_mod_stats()

    def after_setup(self):
        return None  # MemTracker counts live tensors: no cache to release

    def reset_peak(self):
        current = self.tracker.get_tracker_snapshot("current").get(self.device, {})
        self.tracker._peak_mem = {self.device: current.get("Total", 0)}
        self.tracker._peak_mem_snap = {self.device: dict(current)}

    def peak(self) -> int:
        return self.tracker._peak_mem.get(self.device, 0)

    def categories(self) -> dict[str, int]:
        snap = self.tracker.get_tracker_snapshot("peak").get(self.device, {})
        return {getattr(k, "value", str(k)): v for k, v in snap.items() if k != "Total"}

    def extra(self) -> dict:
        return {}


class _StorageMeter:
    """Peak live tensor bytes from a dispatch mode alone (``alloctrace.LiveBytes``): every storage
    an operator makes, freed when its last reference dies, as MemTracker counts them, without
    MemTracker's module hooks (no categories)."""

    def __init__(self):
        from .alloctrace import LiveBytes

        self.probe = LiveBytes()
        self.device = torch.device("cpu")

    def __enter__(self):
        self.probe.__enter__()
        return self

    def __exit__(self, *exc):
        self.probe.__exit__(*exc)

    def new_step(self):
        return None

    def after_setup(self):
        return None

    def reset_peak(self):
        self.probe.reset_peak()

    def peak(self) -> int:
        return self.probe.peak_bytes

    def categories(self) -> dict[str, int]:
        return {}

    def extra(self) -> dict:
        return {}


METERS: dict[str, type[_CpuMeter] | type[_StorageMeter]] = {"memtracker": _CpuMeter, "storages": _StorageMeter}
"""The CPU meters: torch's MemTracker (the harness's), or the dispatch mode's storages alone (DoRA's)."""


class _CudaMeter:
    """torch.cuda's allocator statistics (GPU ground truth)."""

    def __init__(self):
        self.device = torch.device("cuda", torch.cuda.current_device())

    def __enter__(self):
        # start from an empty cache: what an earlier run in this process left cached (the
        # shallow copies of a layer-scaled run) would count in this run's reserved and used bytes
        gc.collect()
        torch.cuda.empty_cache()
        return self

    def __exit__(self, *exc):
        return None

    def new_step(self):
        return None

    def after_setup(self):
        # the harness builds the model whole on the device, then shards it; torchtitan builds it
        # on the meta device and materializes it sharded (train.py: fully_shard, then
        # to_empty + init_weights). Releasing the whole model's cached blocks gives the step the
        # pool torchtitan's run meets, as trace mode's replay does (calibrate.trace.after_setup)
        gc.collect()
        torch.cuda.empty_cache()

    def reset_peak(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def categories(self) -> dict[str, int]:
        return {}

    def extra(self) -> dict:
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        return {
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "device_used_bytes": total - free,
            "num_alloc_retries": stats.get("num_alloc_retries", 0),
        }


def _builds_on_meta(job: Job, *, on_cuda: bool, emulated: bool, user, workload: str) -> bool:
    """Whether an emulated FSDP2 rank on CUDA builds its model on the meta device, as torchtitan
    does: a rank of a 70B or 405B job then holds its shards alone, where the whole model would
    not fit one GPU. (On CPU MemTracker's categories follow the storages the build makes, so the
    CPU harness keeps building the model whole.)"""
    return (
        on_cuda
        and emulated
        and user is None
        and workload == "native"
        and STRATEGIES[job.plan.strategy].framework == "fsdp"
        and job.train.finetune == "full"
        and not job.train.compile
    )


def run(
    job: Job, *, steps: int = 3, warmup: int = 2, emulated: bool = False, workload: str = "native", user=None
) -> Measurement:
    """Build, wrap and train the job's model; measure the last of ``steps`` steps. ``user``: a
    model built by its own code (``calibrate.usermodel.UserWorkload``), not the spec's."""
    if steps <= warmup:
        raise ValueError("steps must exceed warmup: the measured step needs optimizer states")
    torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    on_cuda = torch.cuda.is_available() and job.train.device == "cuda"
    # DoRA on CPU: MemTracker's module hooks keep its per-forward weight graphs (``METERS``)
    meter = _CudaMeter() if on_cuda else METERS["storages" if job.train.dora else "memtracker"]()
    train = job.train
    if user is None:
        batch = make_batch(job.model, micro_batch=train.micro_batch, seq_len=train.seq_len, device=meter.device)
    policy = POLICIES[train.precision]
    autocast = (
        torch.autocast(meter.device.type, dtype=DTYPES[policy.compute_dtype])
        if policy.autocast
        else contextlib.nullcontext()
    )
    meta = _builds_on_meta(job, on_cuda=on_cuda, emulated=emulated, user=user, workload=workload)
    with meter:
        with torch.device("meta" if meta else meter.device):
            if user is None:
                model = build_model(
                    job.model, attention=train.attention, ac=train.activation_checkpointing, workload=workload
                )
            else:
                model = user.build(job)
                batch = user.batch(model, micro_batch=train.micro_batch, seq_len=train.seq_len, device=meter.device)
        if train.finetune != "full" and user is None:
            if workload != "hf":
                raise Unsupported(f"finetune {train.finetune} adapts a transformers model: use workload hf")
            from .finetune import adapt

            adapt(job, model)  # cast, quantize, freeze and add adapters as peft does (calibrate.finetune)
        if train.compile:
            _compile_blocks(model)
        model = wrap(model, job, emulated)
        if meta:
            # torchtitan's order (train.py): the model on the meta device, parallelized, then
            # to_empty on the device: only the rank's shards are ever allocated (its values are
            # left uninitialized: memory does not depend on them)
            model.to_empty(device=meter.device)
        optimizer = _optimizer(model, job)
        meter.after_setup()
        phase_peaks: dict[str, int] = {}
        times = []
        for step in range(steps):
            measured = step == steps - 1
            if measured:
                meter.reset_peak()
            start = time.perf_counter()
            if user is not None and user.own_step:
                meter.new_step()
                user.own_step(model, batch, optimizer)  # the user's whole step: no phases told apart
            else:
                for micro in range(train.grad_accum):
                    meter.new_step()

                    def forward_end(measured=measured, first=micro == 0):
                        if measured:
                            phase_peaks["forward"] = max(phase_peaks.get("forward", 0), meter.peak())
                        if first and train.zero_grad == "after-forward":
                            optimizer.zero_grad(set_to_none=True)  # Lightning's closure: after training_step

                    if user is None:
                        _micro_step(model, *batch, train, autocast, forward_end)
                    else:
                        user.micro_step(model, batch, train, autocast, forward_end)
                    if measured:
                        phase_peaks["backward"] = max(phase_peaks.get("backward", 0), meter.peak())
                optimizer.step()
                _zero_grad(optimizer, train.zero_grad)
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if measured:
                phase_peaks["step" if "backward" not in phase_peaks else "optimizer"] = meter.peak()
        peak = meter.peak()
        categories = meter.categories()
        extra = meter.extra()
    phase = next(p for p in ("forward", "backward", "optimizer", "step") if phase_peaks.get(p) == peak)
    step_s = times[-1]
    return Measurement(
        peak_allocated_bytes=peak,
        phase=phase,
        categories=categories,
        step_time_s=step_s,
        tokens_per_s=train.tokens_per_micro_batch * train.grad_accum / step_s,
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        emulated=emulated,
        phase_peaks=phase_peaks,
        **extra,
    )
