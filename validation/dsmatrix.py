"""DeepSpeed ZeRO-1/2/3 measured on CPU: ``deepspeed.initialize`` with exactly the config
``memplan recommend --emit deepspeed`` writes for the job (memplan.emit), DeepSpeed's CPU
accelerator (``DS_ACCELERATOR=cpu``), gloo between 2 real ranks or one rank of a larger
world on torch's fake process group.

    python -m validation.dsmatrix            # measure every case not yet recorded
    python -m validation.dsmatrix --report   # measured, estimated today, error %, host bytes

The step is DeepSpeed's own loop on a Hugging Face model built from its config:
``loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()`` (the
logits are freed before backward: the record's ``loop`` is plain-freed's). The client
optimizer is the spec's torch AdamW; with optimizer offload DeepSpeed refuses a torch
optimizer (engine.py, ``zero_force_ds_cpu_optimizer``) and the harness passes the one it
asks for, ``deepspeed.ops.adam.DeepSpeedCPUAdam``.

Device and host are the same memory on the CPU accelerator: MemTracker sees both. The
tensors DeepSpeed keeps on the offload side (the optimizer's fp32 partitions, their
gradients and Adam states; ZeRO-3's offloaded parameter partitions) are found on the engine
and their storages summed (``host_bytes``); the record's ``peak_allocated_bytes`` is
MemTracker's peak less them (what a GPU would hold), ``tracker_peak_bytes`` the peak itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from calibrate import records
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

from . import heldout

OUT = "validation/records/deepspeed_matrix_cpu.jsonl"
TIMEOUT_S = 300
STEPS, WARMUP = 2, 1
LOOP = "plain-freed"
"""The loop whose conventions DeepSpeed's step has (calibrate.loops)."""

LLAMA = ModelSpec(
    name="ds-llama-h256",
    arch="llama",
    num_layers=2,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=688,
    vocab_size=8192,
)
QWEN = ModelSpec(
    name="ds-qwen2-h192",
    arch="llama",
    num_layers=3,
    hidden=192,
    num_heads=6,
    num_kv_heads=2,
    ffn_hidden=512,
    vocab_size=6144,
    tied_embeddings=True,
    qkv_bias=True,
)
GPT2 = ModelSpec(
    name="ds-gpt2-h256",
    arch="gpt2",
    num_layers=2,
    hidden=256,
    num_heads=4,
    ffn_hidden=1024,
    vocab_size=8192,
    max_positions=256,
    tied_embeddings=True,
    linear_bias=True,
)
HF_TYPE = {"ds-llama-h256": "llama", "ds-qwen2-h192": "qwen2", "ds-gpt2-h256": "gpt2"}


@dataclass(frozen=True, kw_only=True)
class Case:
    id: str
    job: Job
    mode: str
    """local: real gloo ranks; emulate: rank 0 of the world on the fake process group."""
    loop: str = LOOP
    ac: str = "none"
    config_file: str | None = None
    """A DeepSpeed config as its user wrote it (validation.dsconfig); None: the one memplan emits."""
    trainer: bool = False
    """Hugging Face's ``"auto"`` values in ``config_file`` are filled by the Trainer's own code."""

    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]


def _case(model: ModelSpec, strategy: str, precision: str, *, gpus: int, offload="none", mode="local", b=1, s=128):
    job = Job(
        model=model,
        train=TrainSpec(seq_len=s, micro_batch=b, precision=precision, device="cpu"),
        cluster=ClusterSpec(gpus=gpus),
        plan=Plan(strategy=strategy, offload=offload),
    )
    where = "g" if mode == "local" else "w"
    tail = f"-off-{offload}" if offload != "none" else ""
    return Case(id=f"{model.name}-{strategy}-{precision}{tail}-{where}{gpus}-b{b}s{s}", job=job, mode=mode)


# bf16 matmuls run several times slower than fp32 on this CPU: small shapes throughout
CASES = (
    _case(LLAMA, "zero1", "mixed-bf16", gpus=2),
    _case(LLAMA, "zero2", "mixed-bf16", gpus=2),
    _case(LLAMA, "zero3", "mixed-bf16", gpus=2),
    _case(LLAMA, "zero3", "fp32", gpus=2),
    _case(LLAMA, "zero1", "fp32", gpus=4, mode="emulate"),
    _case(QWEN, "zero2", "fp32", gpus=8, mode="emulate"),
    _case(QWEN, "zero1", "mixed-bf16", gpus=8, mode="emulate"),
    _case(QWEN, "zero3", "mixed-bf16", gpus=4, mode="emulate"),
    _case(GPT2, "zero2", "mixed-bf16", gpus=4, mode="emulate", b=2),
    _case(LLAMA, "zero2", "mixed-bf16", gpus=2, offload="optimizer"),
    _case(LLAMA, "zero3", "mixed-bf16", gpus=2, offload="all"),
    _case(QWEN, "zero3", "mixed-bf16", gpus=8, mode="emulate", offload="optimizer"),
    _case(GPT2, "zero3", "fp32", gpus=8, mode="emulate", offload="params"),
    _case(GPT2, "zero1", "fp32", gpus=16, mode="emulate", offload="optimizer"),
)
BY_ID = {case.id: case for case in CASES}


def _run(case: Case) -> records.Run:
    return records.Run(job=case.job, mode=case.mode, workload="hf", steps=STEPS, warmup=WARMUP)


# --- the child: one case in this process ---------------------------------------------


HOST_ATTRIBUTES = {
    "optimizer": (
        # stage_1_and_2.py with cpu_offload: the fp32 partition (its .grad the fp32 gradient
        # partition), the bf16 copy-back buffer, the gradient staging buffer
        "single_partition_of_fp32_groups",
        "param_buffer_of_bit16_for_cpu_offload_groups",
        "temp_grad_buffer_for_cpu_offload",
        # stage3.py with offload_optimizer: the fp32 partition and the gradient partitions' flat buffer
        "fp32_partitioned_groups_flat",
        "grad_partitions_flat_buffer",
    ),
    "params": ("fp16_partitioned_groups_flat", "param_groups_fp16_flat_cpu_memory", "lp_param_contiguous_pin_buffer"),
}
"""The ZeRO optimizer's attributes that live on the offload device (``"cpu"``) per offload kind."""


def _tensors(value):
    import torch

    if torch.is_tensor(value):
        yield value
        if value.grad is not None:
            yield value.grad
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _host_storages(engine, job: Job) -> dict[int, int]:
    """Storages (by data pointer) DeepSpeed keeps on the offload side, with their bytes."""
    optimizer = engine.optimizer
    kinds = {"optimizer": ("optimizer", "all"), "params": ("params", "all")}
    tensors = []
    for kind, offloads in kinds.items():
        if job.plan.offload not in offloads:
            continue
        tensors += [t for name in HOST_ATTRIBUTES[kind] for t in _tensors(getattr(optimizer, name, None))]
        if kind == "optimizer":
            tensors += list(_tensors(optimizer.optimizer.state))
        else:
            tensors += [p.ds_tensor for p in engine.module.parameters()]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}


def file_config(case: Case) -> dict | None:
    """The case's config file as written, or None for memplan's emitted one."""
    if case.config_file is None:
        return None
    return json.loads(Path(case.config_file).read_text(encoding="utf-8"))


class _TrainerArgs:
    """Hugging Face ``TrainingArguments`` with the world size of the case (the fake process group's)."""

    def __init__(self, args, world_size: int):
        self._args, self.world_size = args, world_size

    def __getattr__(self, name):
        return getattr(self._args, name)


def trainer_args(case: Case):
    """The case's ``TrainingArguments`` (built before the process group: accelerate reads it)."""
    import tempfile

    from transformers import TrainingArguments

    t = case.job.train
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=t.micro_batch,
        gradient_accumulation_steps=t.grad_accum,
        bf16=t.precision == "mixed-bf16",
        fp16=t.precision == "mixed-fp16",
        use_cpu=True,
        report_to=[],
    )
    return _TrainerArgs(args, case.job.cluster.gpus)


def run_config(case: Case, model, args=None) -> dict:
    """The config ``deepspeed.initialize`` gets: memplan's emitted one; the user's file; or the file
    with its ``"auto"`` values filled as the Trainer fills them (transformers.integrations.deepspeed
    HfTrainerDeepSpeedConfig.trainer_config_process / trainer_config_finalize, from ``args`` and the
    model). The client optimizer is the spec's torch one: a config's ``optimizer`` / ``scheduler``
    sections (DeepSpeed's FusedAdam needs CUDA) are dropped before initialize."""
    from memplan.emit import emit

    written = file_config(case)
    if written is None:
        return json.loads(emit(case.job, "deepspeed"))
    if case.trainer:
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        hf = HfTrainerDeepSpeedConfig(written)
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, getattr(model, "hf", model), STEPS)  # the Hugging Face model LoopLM wraps
        written = hf.config
    return {k: v for k, v in written.items() if k not in ("optimizer", "scheduler")}


def _engine(case: Case, model, args=None):
    import deepspeed

    from calibrate.measure import _optimizer

    config = run_config(case, model, args)
    if case.job.plan.offload in ("optimizer", "all"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    else:
        optimizer = _optimizer(model, case.job)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, config


def measure(case: Case, args=None) -> dict:
    """Build, initialise and train the case's model; measure the last step (rank 0's view).
    The host storages are those seen after either step's backward or step (by data pointer)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from calibrate.loops import LoopLM
    from calibrate.measure import Measurement, _CpuMeter

    torch.manual_seed(dist.get_rank())
    train = case.job.train
    meter = _CpuMeter()
    ids = torch.randint(0, case.job.model.vocab_size, (train.micro_batch, train.seq_len))
    phase_peaks: dict[str, int] = {}
    host: dict[int, int] = {}
    with meter:
        model = LoopLM(case.job.model, hf_type=case.hf_type, attention=train.attention)
        engine, config = _engine(case, model, args)
        for index in range(STEPS):
            measured = index == STEPS - 1
            if measured:
                meter.reset_peak()
            start = time.perf_counter()
            meter.new_step()
            loss = engine(input_ids=ids, labels=ids).loss
            phase_peaks["forward"] = meter.peak()
            engine.backward(loss)
            del loss
            phase_peaks["backward"] = meter.peak()
            host |= _host_storages(engine, case.job)
            engine.step()
            host |= _host_storages(engine, case.job)
            step_s = time.perf_counter() - start
            phase_peaks["optimizer"] = meter.peak()
        peak = meter.peak()
        categories = meter.categories()
    host_bytes = sum(host.values())
    phase = next(p for p in ("forward", "backward", "optimizer") if phase_peaks[p] == peak)
    m = Measurement(
        peak_allocated_bytes=peak - host_bytes,
        phase=phase,
        categories=categories,
        step_time_s=step_s,
        tokens_per_s=train.tokens_per_micro_batch / step_s,
        device="cpu",
        world_size=dist.get_world_size(),
        emulated=case.mode == "emulate",
        phase_peaks={k: v - host_bytes for k, v in phase_peaks.items()},
    )
    return {
        "measurement": dataclasses.asdict(m),
        "host_bytes": host_bytes,
        "tracker_peak_bytes": peak,
        "ds_config": config,
    }


def _measure_rank(case_id: str) -> dict:
    """This gloo rank's measurement (a rank of ``heldout.run_ranks``); DeepSpeed asserts LOCAL_RANK."""
    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    return measure(case_by_id(case_id))


def case_by_id(case_id: str) -> Case:
    """A case of this matrix or of validation.dsconfig's (the user-config cases)."""
    from . import dsconfig

    return {**BY_ID, **dsconfig.BY_ID}[case_id]


def _measure_emulated(case: Case) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    args = trainer_args(case) if case.trainer else None
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(case.job.cluster.gpus))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.job.cluster.gpus)
    try:
        return measure(case, args)
    finally:
        dist.destroy_process_group()


def measure_case(case: Case) -> dict:
    """The case's outcome here: status, measurement, error, host_bytes, tracker_peak_bytes."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if case.mode == "local":
        return heldout.outcome(lambda: heldout.run_ranks(case.job.cluster.gpus, _measure_rank, case.id))
    return heldout.outcome(lambda: _measure_emulated(case))


# --- the parent: one child per case, one record per case -------------------------------


def record_id(case: Case) -> str:
    import hashlib

    parts: list[object] = [_run(case).key, case.loop, case.ac, case.hf_type, "deepspeed"]
    if case.config_file is not None:
        parts += [file_config(case), case.trainer]
    key = json.dumps(parts, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def make_record(case: Case, outcome: dict, wall_s: float) -> dict:
    from importlib import metadata

    from memplan.emit import emit

    record = records.make_record(
        _run(case),
        status=outcome["status"],
        measurement=outcome.get("measurement"),
        error=outcome.get("error"),
        wall_s=wall_s,
    )
    from calibrate.loops import LOOPS

    loop = {
        "loop": LOOPS[case.loop].conventions(case.ac),
        "loop_source": f"deepspeed {metadata.version('deepspeed')} DeepSpeedEngine: "
        "loss = engine(input_ids, labels).loss; engine.backward(loss); engine.step()",
        "case": case.id,
        "hf_model_type": case.hf_type,
    }
    extra = {k: outcome[k] for k in ("host_bytes", "tracker_peak_bytes") if k in outcome}
    config = outcome.get("ds_config") or json.loads(emit(case.job, "deepspeed"))
    written = {"ds_config_file": file_config(case), "trainer": case.trainer} if case.config_file else {}
    return record | {"id": record_id(case), "ds_config": config} | written | loop | extra


# --- the report ----------------------------------------------------------------------


def host_error_pct(record: dict) -> float | None:
    """Estimated host RAM (memplan today) against the offloaded bytes found on the engine."""
    from memplan.memory import estimate

    measured = record.get("host_bytes")
    if not measured:
        return None
    return 100.0 * (estimate(heldout.loop_job(record)).host_bytes - measured) / measured


def bucket_bytes(record: dict) -> int:
    """The reduce buckets DeepSpeed allocates for the record's config: two of reduce_bucket_size
    elements in the compute dtype for ZeRO-1/2 (stage_1_and_2.py setup_buckets, overlap_comm),
    one for ZeRO-3 (stage3.py __init__); MemTracker shows them as 1e9 / 2e9-byte tensors."""
    spec = record["spec"]
    config = record["ds_config"]["zero_optimization"]
    per_element = 2 if spec["train"]["precision"] == "mixed-bf16" else 4
    return (1 if config["stage"] == 3 else 2) * per_element * config["reduce_bucket_size"]


def _non_bucket_line(record: dict) -> str:
    from memplan.memory import estimate

    est = estimate(heldout.loop_job(record))
    estimated = est.allocated_bytes - sum(t.bytes for t in est.peak.terms if t.key == "zero.ipg_bucket")
    measured = record["measurement"]["peak_allocated_bytes"] - bucket_bytes(record)
    return (
        f"| {record['case']} | {measured / 2**20:.2f} | {estimated / 2**20:.2f} | "
        f"{100 * (estimated - measured) / measured:+.2f} |"
    )


def _host_line(record: dict) -> str:
    from memplan.memory import estimate

    estimated, error = estimate(heldout.loop_job(record)).host_bytes, host_error_pct(record)
    return f"| {record['case']} | {record['host_bytes'] / 2**20:.2f} | {estimated / 2**20:.2f} | {error:+.2f} |"


def render_report(recs: list[dict]) -> str:
    """The device table (calibrate.report's columns), the peaks less the reduce buckets, and
    host RAM of the offload cases."""
    from calibrate.report import render_table

    ok = [r for r in recs if r["status"] == "ok"]
    return "\n".join(
        [
            render_table(heldout.table_rows(recs)),
            "",
            "Peak less the reduce buckets (`bucket_bytes`: what DeepSpeed allocates for the config):",
            "",
            "| run | measured MiB | estimated MiB | non-bucket error % |",
            "|---|---|---|---|",
            *(_non_bucket_line(r) for r in ok),
            "",
            "Host RAM of the offload cases (measured: the offloaded tensors found on the engine):",
            "",
            "| run | measured host MiB | estimated host MiB | error % |",
            "|---|---|---|---|",
            *(_host_line(r) for r in ok if r.get("host_bytes")),
        ]
    )


def main(argv=None) -> None:
    heldout.main(argv, matrix=sys.modules[__name__])


if __name__ == "__main__":
    main()
