"""Ground truth for tensor, sequence, context and pipeline parallel on CPU (issue 14).

Each case is a memplan Job with a ``Layout``, run on real gloo ranks: the reference llama of
``calibrate.workloads`` under torchtitan's TP plan (``apply_tp`` of
torchtitan/models/llama3/parallelize.py: ColwiseParallel q/k/v/gate/up, RowwiseParallel
o/down, SequenceParallel norms, vocabulary-parallel embedding and head, loss parallel),
split into ``torch.distributed.pipelining`` stages (Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleGPipe), with FSDP2 over the data-parallel mesh dimension. MemTracker reads each
rank's peak live bytes over the last of three steps.

Context parallel runs torch's own ring attention: ``_templated_ring_attention`` and
``_templated_ring_attention_backward`` of torch/distributed/tensor/experimental/_context_parallel/
_attention.py (the ``_AllGatherRotater`` for K/V, the all-to-all rotater for dK/dV, the
``_SDPAMerger``'s fp32 out/LSE, the head-tail load balancing), with the inputs, labels and rotary
tables sharded by ``_context_parallel_shard`` and its ``_HeadTailLoadBalancer`` as torchtitan's
``cp_shard`` does. One step differs from CUDA: ``context_parallel``'s DTensor dispatch maps only
the CUDA kernels (``_scaled_dot_product_flash_attention`` and the efficient / cuDNN ones) to the
ring, and CPU SDPA lowers to ``_scaled_dot_product_flash_attention_for_cpu``, which has no
DTensor sharding rule; so an ``autograd.Function`` (``_RingSDPA``) calls the ring functions with
the CPU flash kernel and saves what SDPA's autograd node saves (q, k, v, out, logsumexp).

    python -m validation.parallel_matrix            # measure every case not yet recorded
    python -m validation.parallel_matrix --report   # validation/records/parallel_matrix_cpu.md from the records
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from calibrate.launch import _free_port
from calibrate.measure import _CpuMeter, _optimizer
from calibrate.workloads import Attention, CausalLM, rotary_tables
from calibrate.wrappers import apply_tp
from memplan.loop import fsdp_units
from memplan.parallel.pipeline import split_layers
from memplan.specs import Job

from .parallel_cases import CASES, OUT

STEPS = 3


class _NoModules:
    """MemTracker's module tracker, switched off: a pipeline runs each stage once per
    micro-batch, which MemTracker's per-module statistics refuse; the device totals remain."""

    is_bw = False
    parents: frozenset = frozenset()

    def register_user_hooks(self, *hooks):
        return None

    def clear_user_hooks(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _meter() -> _CpuMeter:
    meter = _CpuMeter()
    meter.tracker._mod_tracker = _NoModules()
    return meter


# -- the model on one rank ---------------------------------------------------------------


class StageModel(nn.Module):
    """A pipeline stage of the reference llama: the embedding on the first, the final norm and
    head on the last (torchtitan's pipeline_llm splits the same modules); returns logits or the stream."""

    def __init__(self, full: CausalLM, layers: list[int], *, first: bool, last: bool):
        super().__init__()
        self.spec = full.spec
        self.embed_tokens = full.embed_tokens if first else None
        self.layers = nn.ModuleList(full.layers[i] for i in layers)
        self.norm = full.norm if last else None
        self.lm_head = full.lm_head if last else None

    seq_factor = 1
    """A received stream holds 1/tp of the sequence under SP (the rotary tables are the whole's)."""
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    """Context parallel: this rank's rows of the rotary tables (``_context_parallel_shard``)."""

    def forward(self, x):
        s = x.shape[1] * (1 if self.embed_tokens is not None else self.seq_factor)
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cos, sin = self.rope if self.rope is not None else rotary_tables(s, self.spec.head_size, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            return self.lm_head(self.norm(x))
        return x


def _loss(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def _mesh(job: Job):
    from torch.distributed.device_mesh import init_device_mesh

    layout = job.layout
    shape, names = (layout.pp, job.dp, layout.cp, layout.tp), ("pp", "dp", "cp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _dp_mesh(job: Job, mesh):
    """The mesh the data-parallel strategy runs over: dp, with CP's ranks folded in (the CP ranks
    hold the same parameters; torchtitan's dp_shard_cp)."""
    return mesh["dp", "cp"]._flatten("dp_cp") if job.layout.cp > 1 else mesh["dp"]


def _data_parallel(module: StageModel, blocks, job: Job, mesh) -> nn.Module:
    if job.dp * job.layout.cp == 1:
        return module
    dp_mesh = _dp_mesh(job, mesh)
    if job.plan.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, process_group=dp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    if fsdp_units(job.train.recipe) == "blocks":
        # torchtitan's apply_fsdp (distributed/fsdp.py): tok_embeddings its own unit, resharded
        # after forward; [norm, output] one unit that is not
        if module.embed_tokens is not None:
            fully_shard(module.embed_tokens, mesh=dp_mesh)
        if module.norm is not None and module.lm_head is not None:
            fully_shard([module.norm, module.lm_head], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(module, mesh=dp_mesh)
    return module


class _RingSDPA(torch.autograd.Function):
    """Causal SDPA over the CP group by torch's ring attention, on the CPU flash kernel (the
    module docstring says why not through ``context_parallel``'s dispatch)."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        out, lse = _templated_ring_attention(group, 2, kernel, q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        q, k, v, out, lse = ctx.saved_tensors
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        dq, dk, dv = _templated_ring_attention_backward(
            ctx.group, 2, kernel, grad_out, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0
        )
        return dq, dk, dv, None


def _ring_attention(stage: StageModel, group) -> None:
    """Every block's attention core runs the ring over ``group``."""
    for block in stage.layers:
        attention = cast(Attention, block.attn)
        attention.core = lambda q, k, v: _RingSDPA.apply(q, k, v, group)  # type: ignore[method-assign]


def _cp_shard(job: Job, mesh, stage: StageModel, ids):
    """This rank's share of the batch (inputs and labels) and of the rotary tables, head-tail
    balanced as torchtitan's ``cp_shard`` does (``_context_parallel_shard``, ``_HeadTailLoadBalancer``)."""
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer

    s = ids.shape[1]
    balancer = _HeadTailLoadBalancer(s, job.layout.cp, torch.device("cpu"))
    tables = rotary_tables(s, job.model.head_size, ids.device)
    local, cos, sin = _context_parallel_shard(mesh["cp"], (ids, *tables), (1, 0, 0), load_balancer=balancer)
    stage.rope = (cast(torch.Tensor, cos), cast(torch.Tensor, sin))
    return local


def run_rank(job: Job) -> dict:
    """Build this rank's share, train ``STEPS`` steps, and return the last step's peak."""
    from torch.distributed.tensor.parallel import loss_parallel

    layout, train = job.layout, job.train
    mesh = _mesh(job)
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    meter = _meter()
    m = layout.microbatches
    batch = train.micro_batch * m
    ids = torch.randint(0, job.model.vocab_size, (batch, train.seq_len))
    loss_ctx = loss_parallel if layout.tp > 1 else contextlib.nullcontext
    with meter:
        full = CausalLM(job.model, attention=train.attention)
        counts = split_layers(job.model.num_layers, layout.stages)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        local = [pp_rank + k * layout.pp for k in range(layout.pp_virtual)]
        modules, stages = [], []
        for index in local:
            stage = StageModel(
                full,
                list(range(starts[index], starts[index] + counts[index])),
                first=index == 0,
                last=index == layout.stages - 1,
            )
            if layout.tp > 1:
                apply_tp(stage, mesh["tp"], sp=layout.sp)
                stage.seq_factor = layout.tp if layout.sp else 1
            if layout.cp > 1:
                _ring_attention(stage, mesh["cp"].get_group())
            stages.append(stage)
            modules.append(_data_parallel(stage, list(stage.layers), job, mesh))
        del full
        optimizer = _optimizer(nn.ModuleList(modules), job)
        step = _pipeline(job, modules, local, mesh) if layout.pp > 1 else None
        for i in range(STEPS):
            if i == STEPS - 1:
                meter.reset_peak()
            with loss_ctx():
                if step is None:
                    local_ids = _cp_shard(job, mesh, stages[0], ids) if layout.cp > 1 else ids
                    logits = modules[0](local_ids)
                    loss = _loss(logits, local_ids)
                    loss.backward()
                    del loss, logits, local_ids
                else:
                    step(ids)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = meter.peak()
    return {"rank": dist.get_rank(), "pp_rank": pp_rank, "peak_allocated_bytes": peak}


def _pipeline(job: Job, modules, local: list[int], mesh):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.pipelining.stage import _PipelineStageBase

    layout = job.layout
    group = mesh["pp"].get_group()
    stages: list[_PipelineStageBase] = [
        PipelineStage(mod, index, layout.stages, torch.device("cpu"), group=group)
        for mod, index in zip(modules, local, strict=True)
    ]
    m = layout.microbatches
    schedule: PipelineScheduleMulti | PipelineScheduleSingle
    if layout.pp_schedule == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=_loss)
    else:
        cls = ScheduleGPipe if layout.pp_schedule == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], m, loss_fn=_loss)
    first = 0 in local
    last = layout.stages - 1 in local

    def step(ids):
        args = (ids,) if first else ()
        kwargs = {"target": ids, "losses": []} if last else {}
        schedule.step(*args, return_outputs=False, **kwargs)

    return step


# -- processes ---------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, job: Job, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, run_rank(job), None))
    except BaseException as exc:  # reported to the parent
        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    finally:
        dist.destroy_process_group()


def measure(job: Job, worker=_worker) -> list[dict]:
    """One dict per rank (its peak live bytes), from ``job.cluster.gpus`` gloo processes
    (``worker``: another module's, e.g. ``validation.pipeline_probe``'s, to meter more)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port, world = _free_port(), job.cluster.gpus
    procs = [ctx.Process(target=worker, args=(r, world, port, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    out, errors = {}, []
    while not results.empty():
        rank, record, error = results.get()
        if error:
            errors.append(f"rank {rank}: {error}")
        else:
            out[rank] = record
    if errors or len(out) != world:
        raise RuntimeError("; ".join(errors) or f"ranks {sorted(set(range(world)) - set(out))} did not report")
    return [out[r] for r in range(world)]


def record(case: str, job: Job, ranks: list[dict]) -> dict:
    worst = max(ranks, key=lambda r: r["peak_allocated_bytes"])
    return {
        "case": case,
        "layout": dataclasses.asdict(job.layout),
        "strategy": job.plan.strategy,
        "gpus": job.cluster.gpus,
        "model": dataclasses.asdict(job.model),
        "seq_len": job.train.seq_len,
        "micro_batch": job.train.micro_batch,
        "recipe": job.train.recipe,
        "ranks": ranks,
        "worst_rank": worst["rank"],
        "worst_pp_rank": worst["pp_rank"],
        "measured_bytes": worst["peak_allocated_bytes"],
        "torch": torch.__version__,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m validation.parallel_matrix")
    parser.add_argument("--case", action="append", help="measure only these cases")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report:
        from .parallel_report import write_report

        write_report(out)
        return
    done = {json.loads(line)["case"] for line in out.read_text().splitlines()} if out.exists() else set()
    for name in args.case or list(CASES):
        if name in done:
            continue
        print(name, file=sys.stderr, flush=True)
        try:
            rec = record(name, CASES[name], measure(CASES[name]))
        except RuntimeError as exc:  # a case this torch cannot run: said, not recorded
            print(f"{name} failed: {str(exc)[:2000]}", file=sys.stderr, flush=True)
            continue
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
