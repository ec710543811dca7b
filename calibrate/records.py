"""Calibration runs and their records: one JSON object per run, one run per line of a
``.jsonl`` file, appended and flushed to disk as each run ends.

Torch-free on purpose: ``memplan calibrate report`` and ``--resume`` read records, and
the parent of a sweep writes them, without importing torch. ``memplan``'s own start-up
imports this module (for the CLI's choices), so what only a run needs is imported late.

A record (``schema`` 1)::

    id            short hash of the run's key (spec + mode + steps + workload)
    mode          local | emulate | cluster
    steps, warmup, workload
    spec          {"model": ModelSpec, "train": TrainSpec, "cluster": ClusterSpec, "plan": Plan}
                  as dicts: ``job_from_spec`` rebuilds the Job
    world_size    ranks of the job, real or emulated (= spec.cluster.gpus)
    estimate      memplan's estimate of the same spec: allocated_bytes, total_bytes, phase,
                  by_component (params, gradients, optimizer, activations, buffers); null,
                  with estimate_error, when memplan refuses the spec
    status        ok | oom | timeout | failed | cancelled (its Slurm job was cancelled first)
    error         the error text (null when ok)
    measurement   calibrate.measure.Measurement as a dict (null unless ok)
    device, torch_version, host, finished_at (UTC, ISO 8601), wall_s
    slurm_job_id  the Slurm job that ran (or left unfinished) the run; only in cluster mode
    user          only for a model built by its own code (``--module``, or ``--config`` of a
                  family memplan does not describe; ``--mode trace``): ``UserModel`` as a dict,
                  its FSDP2 units and why there is no estimate (then ``estimate`` is null and
                  ``estimate_error`` says why); the spec's model is then a stand-in
                  (``STAND_IN``), never estimated

Example usage::

    run = Run(job=job, mode="emulate")
    append("runs.jsonl", make_record(run, status="ok", measurement=m, error=None, wall_s=3.2))
    for record in read(["runs.jsonl"]):      # a corrupt line is warned about and skipped
        ...
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.layout import Layout
from memplan.loop import Loop
from memplan.mla import MLA_FIELDS
from memplan.moe import MOE_FIELDS
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

SCHEMA = 1
MODES = ("local", "emulate", "cluster", "trace")
STATUSES = ("ok", "oom", "timeout", "failed", "cancelled")
WORKLOADS = ("native", "hf")
_NO_LAYOUT = Layout()
_SPEC_TYPES = {"model": ModelSpec, "train": TrainSpec, "cluster": ClusterSpec, "plan": Plan}
_FINETUNE = ("finetune", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "dora", "qlora_double_quant")
_LOOP_DEFAULTS = {
    f.name: f.default
    for f in fields(TrainSpec)
    if f.name in ("recipe", "ac_every", *_FINETUNE, *(g.name for g in fields(Loop)))
}
_LATER_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": _LOOP_DEFAULTS | {"kv_copies": None, "use_cache": False},
    "model": {
        f.name: f.default
        for f in fields(ModelSpec)
        if f.name
        in (*MOE_FIELDS, *MLA_FIELDS, "qk_norm", "type_vocab_size", "num_labels", "head_dim", "fused_projections")
    },
    "plan": {
        "ep": 1,
        "zero": None,
        "gradient_as_bucket_view": False,
        "bucket_cap_mb": None,
        "static_graph": False,
        "reshard_after_forward": None,
        "fsdp_wrap": "blocks",
    },
    "cluster": {"alloc_conf": ""},
}
"""Inputs added after records existed, by part: kept in a record only where not at their default."""


STAND_IN = ModelSpec(name="user-model", num_layers=1, hidden=1, num_heads=1, ffn_hidden=1, vocab_size=1)
"""The spec's model of a run whose model memplan does not describe (``UserModel``): the Job
needs one for its step, cluster and strategy; nothing estimates or builds it."""


@dataclass(frozen=True, kw_only=True)
class UserModel:
    """A model built by its own code in the run (``--mode trace``), not from a ModelSpec: a
    user's factory, or a Hugging Face config of a family memplan does not describe."""

    factory: str | None = None
    """``package.module:function`` returning the ``nn.Module`` (``--module``)."""
    config: dict | None = None
    """A Hugging Face config (``AutoModelForCausalLM.from_config``), when no factory."""
    step: str | None = None
    """``package.module:function(model, batch, optimizer)`` running one whole step (``--step``);
    None: calibrate's (forward, loss, backward, optimizer step, zero_grad)."""
    units: str | None = None
    """The attribute path of the ``nn.ModuleList`` whose items are the FSDP2 units (the
    module's largest where not given: ``--units``)."""
    no_estimate: str = ""
    """Why memplan has no estimate of it ("" where the probe found a spec memplan describes)."""

    def __post_init__(self):
        if (self.factory is None) == (self.config is None):
            raise MemplanError("a user model is built by a factory or from a config, exactly one")

    def name(self) -> str:
        model = f"module {self.factory}" if self.factory else f"{(self.config or {}).get('model_type')} (config)"
        return model + (f" step {self.step}" if self.step else "")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, "")}

    @classmethod
    def from_dict(cls, data: dict) -> UserModel:
        return cls(**data)


def spec_dict(job: Job) -> dict:
    """The four specs of a job as plain dicts (the ``spec`` field of a record), and its layout
    where it has one."""
    spec = {part: asdict(getattr(job, part)) for part in _SPEC_TYPES}
    # the later inputs only where they differ from their defaults: records made before they
    # were inputs keep their keys (run_key), and load with the defaults
    for part, defaults in _LATER_DEFAULTS.items():
        spec[part] = {k: v for k, v in spec[part].items() if k not in defaults or v != defaults[k]}
    # a TP/CP/PP layout only where there is one (its fields that differ from a Layout's defaults)
    layout = {k: v for k, v in asdict(job.layout).items() if v != getattr(_NO_LAYOUT, k)}
    if layout:
        spec["layout"] = layout
    return spec


def job_from_spec(spec: dict) -> Job:
    """Rebuild the Job a record was made from."""
    try:
        parts = {part: cls(**spec[part]) for part, cls in _SPEC_TYPES.items()}
        return Job(**parts, layout=Layout(**spec.get("layout", {})))
    except (KeyError, TypeError) as exc:
        raise MemplanError(f"a record's spec does not describe a memplan Job ({exc})") from None


def run_key(
    spec: dict, mode: str, steps: int, workload: str, layers_scaled: bool = False, user: dict | None = None
) -> str:
    """Canonical JSON of what makes two runs the same run (``--resume`` skips a recorded key)."""
    key: dict[str, Any] = {"spec": spec, "mode": mode, "steps": steps, "workload": workload}
    if layers_scaled:
        key["layers_scaled"] = True
    if user:
        key["user"] = user
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True)
class Run:
    """One calibration point: a Job, where it runs, and how many steps it takes."""

    job: Job
    mode: str
    """local: real processes on this machine; emulate: one rank, fake process group;
    cluster: launched by torchrun on every node; trace: emulate's rank under fake tensors
    (calibrate.trace), at any size."""
    steps: int = 3
    warmup: int = 2
    """Steps before the measured one; the measured step must have optimizer states."""
    workload: str = "native"
    layers_scaled: bool = False
    """Measure 2-, 3- and 4-block copies at full width and extrapolate to the real depth
    (calibrate.layerscale), for a model too big for the calibration device."""
    user: UserModel | None = None
    """The model built by its own code (trace mode only), not from the spec's model."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise MemplanError(f"mode {self.mode!r} is not one of: {', '.join(MODES)}")
        if self.workload not in WORKLOADS:
            raise MemplanError(f"workload {self.workload!r} is not one of: {', '.join(WORKLOADS)}")
        if not 1 <= self.warmup < self.steps:
            raise MemplanError(
                f"steps must exceed warmup and warmup be at least 1 (got steps {self.steps}, warmup {self.warmup})"
            )
        if self.user is not None and self.mode != "trace":
            raise MemplanError(f"a model built by its own code runs under --mode trace, not --mode {self.mode}")

    @property
    def key(self) -> str:
        return run_key(spec_dict(self.job), self.mode, self.steps, self.workload, self.layers_scaled, self._user_dict())

    def _user_dict(self) -> dict | None:
        return self.user.to_dict() if self.user else None

    @property
    def id(self) -> str:
        import hashlib

        return hashlib.sha1(self.key.encode()).hexdigest()[:10]

    def to_dict(self) -> dict:
        data = {
            "spec": spec_dict(self.job),
            "mode": self.mode,
            "steps": self.steps,
            "warmup": self.warmup,
            "workload": self.workload,
            "layers_scaled": self.layers_scaled,
        }
        if self.user:
            data["user"] = self.user.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Run:
        return cls(
            job=job_from_spec(data["spec"]),
            mode=data["mode"],
            steps=data["steps"],
            warmup=data["warmup"],
            workload=data["workload"],
            layers_scaled=data.get("layers_scaled", False),
            user=UserModel.from_dict(data["user"]) if data.get("user") else None,
        )

    def describe(self) -> str:
        name = describe(spec_dict(self.job), self.mode, self.workload, self._user_dict())
        return name + (" layer-scaled" if self.layers_scaled else "")


def describe(spec: dict, mode: str, workload: str = "native", user: dict | None = None) -> str:
    """A short human name of a run: strategy, precision, model shape (transformers' model of
    those shapes: "hf"; a model built by its own code: its name), batch, world, mode."""
    m, t, c, p = spec["model"], spec["train"], spec["cluster"], spec["plan"]
    layout = Layout(**spec["layout"]).describe() if spec.get("layout") else ""
    extras = [
        t["activation_checkpointing"] != "none" and f"ac-{t['activation_checkpointing']}",
        t["attention"] != "sdpa" and t["attention"],
        p["offload"] != "none" and f"offload-{p['offload']}",
        t["grad_accum"] > 1 and f"ga{t['grad_accum']}",
    ]
    return " ".join(
        [
            p["strategy"],
            *filter(None, [layout]),
            t["precision"],
            *filter(None, extras),
            UserModel.from_dict(user).name()
            if user
            else f"{m['arch']}{' (hf)' if workload == 'hf' else ''} {m['num_layers']}L h{m['hidden']}",
            f"b{t['micro_batch']}×s{t['seq_len']}",
            f"{mode}×{c['gpus']}",
        ]
    )


def estimate_summary(job: Job) -> dict:
    """memplan's estimate of the job, as the ``estimate`` field of a record."""
    from memplan.memory import estimate

    est = estimate(job)
    return {
        "allocated_bytes": est.allocated_bytes,
        "total_bytes": est.total_bytes,
        "phase": est.phase,
        "by_component": {c.value: b for c, b in est.by_component.items()},
    }


def torch_version() -> str | None:
    """The installed torch's version, read without importing torch."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def make_record(
    run: Run,
    *,
    status: str,
    measurement: dict | None,
    error: str | None,
    wall_s: float,
    slurm_job_id: str | None = None,
) -> dict:
    """The record of one finished run (any status)."""
    import datetime
    import socket

    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    try:
        if run.user and run.user.no_estimate:
            raise MemplanError(run.user.no_estimate)
        estimate, estimate_error = estimate_summary(run.job), None
    except MemplanError as exc:
        estimate, estimate_error = None, str(exc)
    measurement = measurement or None
    record = {
        "schema": SCHEMA,
        "id": run.id,
        **run.to_dict(),
        "world_size": run.job.cluster.gpus,
        "estimate": estimate,
        "status": status,
        "error": error,
        "measurement": measurement,
        "device": measurement["device"] if measurement else None,
        "torch_version": measurement["torch_version"] if measurement else torch_version(),
        "host": socket.gethostname(),
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 3),
    }
    if estimate_error:
        record["estimate_error"] = estimate_error
    if slurm_job_id:
        record["slurm_job_id"] = slurm_job_id
    return record


def append(path, record: dict) -> None:
    """Append one record and force it to disk, so a crash later in a sweep loses nothing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _problem(record) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [k for k in ("spec", "mode", "steps", "workload", "status") if k not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    if record["status"] not in STATUSES:
        return f"status {record['status']!r} is not one of {', '.join(STATUSES)}"
    return None


def read(paths, *, warn=_warn_stderr) -> list[dict]:
    """Every record of the files, in order; a corrupt line is reported (file:line) and skipped."""
    records = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        if not Path(path).exists():
            raise MemplanError(f"record file {str(path)!r} does not exist")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError as exc:
            raise MemplanError(f"record file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                warn(f"{path}:{number}: skipped a corrupt record ({exc.msg})")
                continue
            problem = _problem(record)
            if problem:
                warn(f"{path}:{number}: skipped a corrupt record ({problem})")
                continue
            records.append(record)
    return records


def record_key(record: dict) -> str:
    return run_key(
        record["spec"],
        record["mode"],
        record["steps"],
        record["workload"],
        record.get("layers_scaled", False),
        record.get("user"),
    )


def recorded_keys(path, *, warn=_warn_stderr) -> set[str]:
    """Keys of the runs a file already holds (none when it does not exist yet)."""
    if not Path(path).exists():
        return set()
    return {record_key(r) for r in read([path], warn=warn)}


def write_runs(path, runs: list[Run]) -> None:
    """The run requests that ``python -m calibrate --runs FILE --index I`` executes."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in runs), encoding="utf-8")


def read_run(path, index: int) -> Run:
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not 0 <= index < len(lines):
        raise MemplanError(f"index {index} is out of range: {path} holds {len(lines)} runs (0..{len(lines) - 1})")
    return Run.from_dict(json.loads(lines[index]))
