"""Launch configuration for a recommended job: an FSDP2 or FSDP1 wrapping snippet, an
Accelerate config, a DeepSpeed config, a torchrun / srun command line. Text only; nothing
here imports torch. Each framework's own kinds are written by its adapter
(``memplan.frameworks``); bucket sizes come from tables/deepspeed.csv, the same numbers the
memory model charges.
"""

from __future__ import annotations

import os

import yaml

from .errors import MemplanError
from .frameworks import FRAMEWORKS, adapter
from .frameworks import deepspeed as _deepspeed
from .frameworks import fsdp as _fsdp
from .frameworks.base import header
from .precision import POLICIES
from .specs import Job
from .strategies import STRATEGIES

KINDS = ("fsdp2", "fsdp1", "accelerate", "deepspeed", "torchrun", "torchtitan")
_OWN_KINDS = {kind: write for f in FRAMEWORKS.values() for kind, write in f.emitters.items()}
WRITES = {
    "fsdp2": _fsdp.FSDP2_STRATEGIES,
    "fsdp1": tuple(_fsdp.FSDP1_SHARDING),
    "deepspeed": tuple(_deepspeed.ZERO_STAGE),
    "torchtitan": ("fsdp-full-shard", "fsdp-hybrid-shard", "ddp"),
}
"""The strategies each framework's own form writes (accelerate and torchrun launch any)."""


def fsdp2_snippet(job: Job) -> str:
    """``fully_shard`` per block, then the root (torchtitan's parallelize order: AC first)."""
    return emit(job, "fsdp2")


def fsdp1_snippet(job: Job) -> str:
    """``FullyShardedDataParallel`` with a transformer auto-wrap policy per block."""
    return emit(job, "fsdp1")


def deepspeed_config(job: Job) -> dict:
    """A DeepSpeed config whose bucket sizes are the ones the memory model charges."""
    return _deepspeed.config(job, STRATEGIES[job.plan.strategy])


def accelerate_config(job: Job) -> dict:
    """``accelerate launch --config_file`` contents (accelerate's own key names)."""
    c, s = job.cluster, STRATEGIES[job.plan.strategy]
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": adapter(s).accelerate_mixed_precision(job),
        "num_machines": c.num_nodes,
        "num_processes": c.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    return {**config, **adapter(s).accelerate(job, s)}


def launch_command(job: Job, script: str = "train.py") -> str:
    """torchrun on one node; srun + torchrun (one task per node, c10d rendezvous) on several."""
    c = job.cluster
    args = f"{script} --micro-batch {job.train.micro_batch} --grad-accum {job.train.grad_accum}"
    if not adapter(STRATEGIES[job.plan.strategy]).distributed:
        return f"# {header(job)}\npython {args}\n"
    if c.num_nodes == 1:
        return f"# {header(job)}\ntorchrun --standalone --nproc_per_node={c.gpus_per_node} {args}\n"
    return (
        f"# {header(job)}\n"
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"srun --nodes={c.num_nodes} --ntasks-per-node=1 --gpus-per-node={c.gpus_per_node} \\\n"
        f"  torchrun --nnodes={c.num_nodes} --nproc_per_node={c.gpus_per_node} --rdzv_id=$SLURM_JOB_ID \\\n"
        f"  --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 {args}\n"
    )


TORCHTITAN_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zero-bubble": "InterleavedZeroBubble",
}
"""torch.distributed.pipelining's schedule names (schedules.py get_schedule_class), as torchtitan's
pipeline_parallel_schedule takes them."""
TORCHTITAN_AC = {"none": "none", "selective": "selective", "op": "selective", "full": "full"}
"""memplan's AC policies as torchtitan's: none, SelectiveAC (per-op) or FullAC."""


def torchtitan_sections(job: Job) -> dict[str, dict]:
    """The [training], [parallelism] and [activation_checkpoint] sections of a torchtitan job
    config (TrainingConfig and ParallelismConfig field names, torchtitan/config/configs.py)."""
    layout, strategy, t = job.layout, STRATEGIES[job.plan.strategy], job.train
    if job.plan.strategy not in WRITES["torchtitan"]:
        raise MemplanError(
            lambda n: f"{n('emit')} torchtitan writes FSDP2, HSDP or DDP over dp, not strategy {job.plan.strategy}"
        )
    # HSDP shards within the node's dp ranks and replicates across; FSDP shards over every dp rank
    shard = {"ddp": 1, "fsdp-hybrid-shard": max(1, job.cluster.gpus_per_node // (layout.tp * layout.cp))}.get(
        strategy.id, job.dp
    )
    local = t.micro_batch * layout.microbatches
    training: dict[str, int | str] = {
        "local_batch_size": local,
        "global_batch_size": local * job.dp * t.grad_accum,
        "seq_len": t.seq_len,
    }
    if POLICIES[t.precision].master:
        training["mixed_precision_param"] = {"bf16": "bfloat16", "fp16": "float16"}[POLICIES[t.precision].compute_dtype]
    parallelism = {
        "data_parallel_replicate_degree": job.dp // shard,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": layout.tp,
        "enable_sequence_parallel": layout.sp,
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
        "pipeline_parallel_schedule": TORCHTITAN_SCHEDULES[layout.pp_schedule],
        "pipeline_parallel_microbatch_size": t.micro_batch,
        "expert_parallel_degree": job.plan.ep,
    }
    sections: dict[str, dict] = {
        "training": training,
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": TORCHTITAN_AC[t.activation_checkpointing]},
    }
    if layout.async_tp:
        # CompileConfig: async TP is an inductor pass, so it needs the model compiled
        sections["compile"] = {"enable": True, "enable_async_tensor_parallel": True}
    return sections


def torchtitan_toml(job: Job) -> str:
    """``torchtitan_sections`` as TOML text (flat tables of scalars: written here, no dependency)."""
    lines = [f"# {header(job)}", f"# layout: {job.layout.describe()} × dp {job.dp}"]
    for section, values in torchtitan_sections(job).items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def emit(job: Job, kind: str) -> str:
    """The launch configuration of ``kind`` for ``job`` as text."""
    if kind in _OWN_KINDS:
        return _OWN_KINDS[kind](job, STRATEGIES[job.plan.strategy])
    if kind == "accelerate":
        note = adapter(STRATEGIES[job.plan.strategy]).accelerate_note(job)
        return f"# {header(job)}\n{note}" + yaml.safe_dump(accelerate_config(job), sort_keys=False)
    if kind == "torchrun":
        return launch_command(job)
    if kind == "torchtitan":
        return torchtitan_toml(job)
    raise MemplanError(f"emit {kind!r} is not one of: {', '.join(KINDS)}")


def check_destination(path: str) -> None:
    """``--output FILE`` names a file that can be written: not a directory, in one that exists
    (checked before the search, so a typo costs no wait)."""
    if os.path.isdir(path):
        raise MemplanError(lambda n: f"{n('output')} {path!r} is a directory; name the file to write")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise MemplanError(lambda n: f"{n('output')} {path!r}: directory {parent!r} does not exist")


def write_file(path: str, text: str) -> None:
    """The emitted launch configuration written to ``path`` (replaced if it exists)."""
    check_destination(path)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise MemplanError(lambda n: f"{n('output')} {path!r} cannot be written: {why}") from None
