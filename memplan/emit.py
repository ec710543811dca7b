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
from .readers.torchtitan import flavor_spec, flavors, model_of
from .specs import Job
from .strategies import STRATEGIES

KINDS = ("fsdp2", "fsdp1", "accelerate", "deepspeed", "torchrun", "torchtitan")
_OWN_KINDS = {kind: write for f in FRAMEWORKS.values() for kind, write in f.emitters.items()}
WRITES = {
    "fsdp2": _fsdp.FSDP2_STRATEGIES,
    "fsdp1": tuple(_fsdp.FSDP1_SHARDING),
    "deepspeed": tuple(_deepspeed.ZERO_STAGE),
    "torchtitan": ("fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard", "ddp", "single"),
}
"""The strategies each framework's own form writes (accelerate and torchrun launch any)."""


DATA_PARALLEL_KINDS = ("fsdp2", "fsdp1", "accelerate", "deepspeed")
"""The forms that write their strategy over every GPU: no TP, CP or PP mesh (torchtitan's job
config and a torchrun line's script can hold a layout)."""


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
    if not job.layout.is_data_parallel:  # the script applies the layout: said where the line is read
        args = f"{args}  # the script lays out {job.layout.describe()} × dp {job.dp}"
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
TORCHTITAN_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
TORCHTITAN_IMPLS = {"fused": "fused", "foreach": "foreach", "single": "for-loop", None: "fused"}


def _titan_refuse(what: str) -> MemplanError:
    return MemplanError(lambda n: f"{n('emit')} torchtitan: torchtitan 0.2.2's job config cannot say {what}")


def _titan_ac(t) -> dict[str, str]:
    """memplan's AC as torchtitan's activation_checkpoint (distributed/activation_checkpoint.py):
    op → selective "op"; full on every N-th block → selective "N" (layer SAC), every block → full."""
    if t.activation_checkpointing == "none":
        return {"mode": "none"}
    if t.activation_checkpointing == "op" and t.ac_every == 1:
        return {"mode": "selective", "selective_ac_option": "op"}
    if t.activation_checkpointing == "full":
        return {"mode": "full"} if t.ac_every == 1 else {"mode": "selective", "selective_ac_option": str(t.ac_every)}
    raise _titan_refuse(f"ac {t.activation_checkpointing} every {t.ac_every} (none, op, full or full every N)")


def _titan_model(job: Job) -> dict[str, str]:
    """[model] name and flavor where the job's model is a torchtitan flavor's (tables/torchtitan_models.csv)."""
    for (name, flavor), row in flavors().items():
        if job.model.name == model_of(row) or job.model == flavor_spec(row):
            return {"name": name, "flavor": flavor}
    return {}


def torchtitan_sections(job: Job) -> dict[str, dict]:
    """A torchtitan 0.2.2 job config (config/job_config.py JobConfig: [model], [training],
    [parallelism], [activation_checkpoint], [compile], [optimizer]); what the file leaves out is
    JobConfig's default. ``memplan estimate --from`` reads it back to the same job."""
    layout, strategy, t = job.layout, STRATEGIES[job.plan.strategy], job.train
    if job.plan.strategy not in WRITES["torchtitan"]:
        raise MemplanError(
            lambda n: f"{n('emit')} torchtitan writes FSDP2, HSDP or DDP over dp, not strategy {job.plan.strategy}"
        )
    if layout.tp_plan == "blocks":
        raise _titan_refuse("tp-plan blocks (apply_tp shards the embedding and head)")
    if layout.tp > 1 and not layout.sp:
        raise _titan_refuse("TP without sequence parallel (apply_tp always shards the norms)")
    if t.optimizer not in TORCHTITAN_OPTIMIZERS:
        raise _titan_refuse(f"optimizer {t.optimizer} (adamw, adam)")
    if job.plan.offload not in ("none", "all") or (job.plan.offload == "all" and job.dp == 1):
        raise _titan_refuse(f"offload {job.plan.offload} (all, under FSDP)")
    if layout.pp > 1 and layout.pp_virtual != (2 if layout.pp_schedule in ("interleaved-1f1b", "zero-bubble") else 1):
        raise _titan_refuse(f"{layout.pp_virtual} stages per rank under {layout.pp_schedule}")
    if strategy.id in ("fsdp-full-shard", "fsdp-hybrid-shard") and layout.pp > 1:
        raise _titan_refuse(f"{strategy.id} under PP (its default keeps the gathered parameters: fsdp-shard-grad-op)")
    # HSDP shards within the node's dp ranks and replicates across; FSDP shards over every dp rank
    shard = {"ddp": 1, "fsdp-hybrid-shard": max(1, job.cluster.gpus_per_node // (layout.tp * layout.cp))}.get(
        strategy.id, job.dp
    )
    fsdp = shard > 1 or layout.cp > 1  # ParallelDims.fsdp_enabled: FSDP's mixed precision, else autocast
    amp = not fsdp and layout.tp == layout.pp == 1
    if t.precision not in ("fp32", "bf16", "mixed-bf16" if fsdp else "amp-bf16" if amp else "fp32"):
        raise _titan_refuse(f"precision {t.precision} under {strategy.id} (FSDP: mixed-bf16, DDP / one GPU: amp-bf16)")
    local = t.micro_batch * (layout.microbatches if layout.pp > 1 else 1)
    training: dict[str, object] = {
        "local_batch_size": local,
        "global_batch_size": local * job.dp * t.grad_accum,
        "seq_len": t.seq_len,
    }
    if t.precision == "bf16":
        training["dtype"] = "bfloat16"
    elif t.precision == "fp32":
        training["mixed_precision_param"] = "float32"
    if job.plan.offload == "all":
        training["enable_cpu_offload"] = True
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": job.dp // shard,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": layout.tp,
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
    }
    if strategy.id == "fsdp-shard-grad-op" and layout.pp == 1:
        parallelism["fsdp_reshard_after_forward"] = "never"
    if layout.pp > 1:
        parallelism["pipeline_parallel_schedule"] = TORCHTITAN_SCHEDULES[layout.pp_schedule]
        parallelism["pipeline_parallel_microbatch_size"] = t.micro_batch
    if job.plan.ep > 1:
        parallelism["expert_parallel_degree"] = job.plan.ep
    if layout.tp_plan == "tutorial":  # apply_tp without loss parallel: the head's output all-gathered
        parallelism["disable_loss_parallel"] = True
    if layout.async_tp:  # distributed/tensor_parallel.py: async TP is an inductor pass, so it needs compile
        parallelism["enable_async_tensor_parallel"] = True
    sections: dict[str, dict] = {}
    model = _titan_model(job)
    if model or t.float8:
        sections["model"] = model | ({"converters": ["float8"]} if t.float8 else {})
    sections |= {"training": training, "parallelism": parallelism, "activation_checkpoint": _titan_ac(t)}
    if t.compile or layout.async_tp:
        sections["compile"] = {"enable": True, "components": ["model", "loss"]}
    sections["optimizer"] = {
        "name": TORCHTITAN_OPTIMIZERS[t.optimizer],
        "implementation": TORCHTITAN_IMPLS[t.optimizer_impl],
        "early_step_in_backward": t.optimizer_in_backward,
    }
    return sections


def _titan_runs(job: Job) -> list[str]:
    """What torchtitan 0.2.2 runs otherwise than the job says: its loop (train.py: logits freed,
    cross-entropy, zero_grad(set_to_none)) and FSDP's fp32 reduction (apply_fsdp)."""
    t, layout = job.train, job.layout
    runs = [] if t.recipe == "torchtitan" else ["recipe torchtitan"]
    if t.zero_grad != "none":
        runs.append("zero-grad none")
    sharded = job.plan.strategy.startswith("fsdp") or layout.cp > 1
    if sharded and t.reduce_dtype != "fp32":
        runs.append("reduce-dtype fp32")
    return runs


def torchtitan_toml(job: Job) -> str:
    """``torchtitan_sections`` as TOML text (flat tables of scalars and lists: written here, no dependency)."""
    lines = [f"# {header(job)}", f"# layout: {job.layout.describe()} × dp {job.dp}"]
    if not _titan_model(job):
        lines.append("# [model]: not a torchtitan llama3 flavor; give memplan --model")
    runs = _titan_runs(job)
    if runs:
        lines.append(f"# torchtitan 0.2.2 runs this with {', '.join(runs)} (memplan estimate --from this file)")
    for section, values in torchtitan_sections(job).items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return f'"{value}"' if isinstance(value, str) else str(value)


def emit(job: Job, kind: str) -> str:
    """The launch configuration of ``kind`` for ``job`` as text."""
    if not job.layout.is_data_parallel and kind in DATA_PARALLEL_KINDS:
        # each writes its strategy over every GPU: the layout would be dropped without a word
        raise MemplanError(
            lambda n: (
                f"{n('emit')} {kind} writes {job.plan.strategy} over all {job.cluster.gpus} GPUs, not the layout "
                f"{job.layout.describe()} × dp {job.dp}: use --emit torchtitan (or torchrun, whose script applies it)"
            )
        )
    if job.post_forward_group and kind in ("accelerate", "torchtitan"):
        # accelerate's fsdp_reshard_after_forward and torchtitan's fsdp_reshard_after_forward are
        # true / false and default / always / never: neither passes fully_shard an integer
        raise MemplanError(
            lambda n: (
                f"{n('emit')} {kind} cannot say {n('reshard_after_forward')} {job.plan.reshard_after_forward} "
                "(its config takes no reshard group): use --emit fsdp2"
            )
        )
    if job.one_fsdp_unit and kind in ("fsdp2", "torchtitan"):
        raise MemplanError(
            lambda n: (
                f"{n('emit')} {kind} cannot say {n('fsdp_wrap')} none: the whole model as one unit is measured "
                "under FSDP1 (FullyShardedDataParallel): use --emit fsdp1 or accelerate"
            )
        )
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
