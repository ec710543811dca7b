"""The GPU calibration campaign: a planned design of runs on one CUDA device, each rank of an
N-GPU job emulated on it (fake process group), its time budgeted from memplan's own
throughput model, and the driver that runs it (torch-free: every run is a child process,
``validation.gpu_campaign``, killed with its children past its timeout).

The design is not the full cross product of the issue's axes: a base configuration
(llama-3.2-1b, FSDP2 full-shard over 8 ranks, mixed-bf16, no AC, SDPA, foreach AdamW, logits
kept, b2 × s2048) varied one axis at a time (main effects), plus a few crossed blocks
(precision × strategy on a 0.5B model, AC and attention against precision, the loop's
options on other models and strategies) and four runs with allocator snapshots. A model
whose estimate does not fit the device is measured layer-scaled (calibrate.layerscale).

Records: ``OUT/records.jsonl`` (calibrate.records schema, one per run, appended and flushed
as each ends, with the campaign's own fields under ``campaign``), ``OUT/probes.jsonl`` (the
CUDA context with and without lazy loading, the cuBLAS workspace) and ``OUT/snapshots/``.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from calibrate import layerscale, records, runs
from calibrate.records import Run
from memplan import catalog
from memplan.errors import MemplanError
from memplan.frameworks import runs_natively
from memplan.memory import estimate
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from memplan.strategies import STRATEGIES
from memplan.throughput import link_for, step_time

BUDGET_S = 25 * 60
"""The campaign's whole wall-clock budget on one device (issue 16)."""
SLICE_S = 480.0
"""Seconds of runs in one device call (``--budget-s``): a lent device gives 15 minutes in all,
its start and idle waits included (issue 25), so the first call's 8 minutes must answer the
questions FIRST asks."""
STARTUP_S = 10.0
"""Planning allowance per child process: Python, torch (0.9 s to import on the CPU machine),
memplan, the CUDA context, the fake process group. Not a measurement of the GPU machine:
each record's ``wall_s`` is, and replaces it when the campaign is planned again."""
HF_IMPORT_S = 5.0
"""Planning allowance for importing transformers in a child that builds a Hugging Face model."""
BUILD_S_PER_GIB = 0.5
"""Planning allowance for initialising a model's parameters on the device, per GiB of them."""
STEP_FLOOR_S = 0.05
"""Planning allowance: the least one step takes (kernel launches of a small model, the fake
process group's Python), however few FLOPs it does."""
COMPILE_S = 90.0
"""Planning allowance for inductor compiling a block's forward and backward, cold cache."""
SNAPSHOT_S = 10.0
"""Planning allowance for recording the allocator's history and writing it out."""
START_FACTOR = 2.0
"""Under a call's budget, a run starts only while twice its planned time is left; the rest of
the call is its timeout at most."""
MIN_TIMEOUT_S, MAX_TIMEOUT_S, TIMEOUT_FACTOR = 90.0, 420.0, 4.0
"""A run is killed after TIMEOUT_FACTOR × its estimate, within these bounds (seconds); the
upper bound keeps every run inside one 10-minute device command."""
SNAPSHOT_MAX_ENTRIES = 2_000_000
"""Trace entries the allocator history keeps (a ring buffer): more than a snapshot run makes."""
PROBES = ("context-lazy", "context-eager")
"""Child processes measuring the CUDA context under CUDA_MODULE_LOADING=LAZY and EAGER; the
lazy one then measures the cuBLAS workspace of the first matmuls."""
SDPA_BACKENDS = ("default", "flash", "efficient")

QWEN25_05B = ModelSpec(
    name="qwen2.5-0.5b",
    arch="llama",
    num_layers=24,
    hidden=896,
    num_heads=14,
    num_kv_heads=2,
    ffn_hidden=4864,
    vocab_size=151936,
    tied_embeddings=True,
    qkv_bias=True,
)
"""Qwen/Qwen2.5-0.5B config.json (hidden_size 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings; Qwen2 attention has q/k/v biases)."""
ENCODER = "vit-large-patch16-224"
"""The encoder: a ViT (transformers' ViTForImageClassification from its config), which the
campaign's ``Run`` workloads build. BERT and RoBERTa are measured on CPU through
calibrate/loops.py's Hugging Face loop (validation/finetune_matrix.py's encoder cases), not a ``Run``
workload, so the campaign does not run them."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One run of the campaign."""

    name: str
    axis: str
    """The design block it belongs to (model, strategy, precision, ac, attention, optimizer,
    loop, batch, snapshot)."""
    run: Run
    sdpa_backend: str = "default"
    """default: torch's SDPA dispatch; flash / efficient: that backend alone (sdpa_kernel)."""
    snapshot: bool = False

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "axis": self.axis,
            "run": self.run.to_dict(),
            "sdpa_backend": self.sdpa_backend,
            "snapshot": self.snapshot,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Case:
        return cls(
            name=data["name"],
            axis=data["axis"],
            run=Run.from_dict(data["run"]),
            sdpa_backend=data["sdpa_backend"],
            snapshot=data["snapshot"],
        )


def _model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    return QWEN25_05B if model == QWEN25_05B.name else catalog.model_preset(model)


_SHORT = {
    "qwen2.5-0.5b": "0.5b",
    "llama-3.2-1b": "1b",
    "llama-3.2-3b": "3b",
    "llama-3.1-8b": "8b",
    "gpt2": "gpt2",
    ENCODER: "vit-l",
}
_STRATEGY_SHORT = {
    "single": "single",
    "ddp": "ddp",
    "fsdp-full-shard": "fsdp",
    "fsdp-shard-grad-op": "sgo",
    "fsdp-hybrid-shard": "hsdp",
}
BASE = dict(
    model="llama-3.2-1b",
    strategy="fsdp-full-shard",
    world=8,
    precision="mixed-bf16",
    ac="none",
    attention="sdpa",
    optimizer_impl="foreach",
    logits="kept",
    loss="ce",
    compile=False,
    micro_batch=2,
    seq_len=2048,
    sdpa_backend="default",
    finetune="full",
    workload="native",
)


def _name(axis: str, c: dict, snapshot: bool, seq_len: int) -> str:
    """The run's configuration, every axis that differs from the base named."""
    model = c["model"]
    parts = [
        _SHORT.get(model, model) if isinstance(model, str) else model.name,
        _STRATEGY_SHORT.get(c["strategy"], c["strategy"]),
        f"w{c['world']}",
        c["precision"],
    ]
    for key, label in (
        ("ac", "ac-"),
        ("attention", ""),
        ("sdpa_backend", "sdpa-"),
        ("optimizer_impl", ""),
        ("logits", "logits-"),
        ("loss", ""),
        ("finetune", ""),
        ("workload", ""),
    ):
        if c[key] != BASE[key]:
            parts.append(f"{label}{c[key]}")
    if c["compile"]:
        parts.append("compile")
    parts.append(f"b{c['micro_batch']}s{seq_len}")
    if snapshot:
        parts.append("snapshot")
    return f"{axis}/" + "-".join(parts)


def make_case(axis: str, *, gpu: str, device: str = "cuda", snapshot: bool = False, **changes) -> Case:
    """The base configuration with ``changes``, on ``gpu`` (a tables/gpus.csv name), layer-scaled
    when memplan's estimate of the whole model does not fit that GPU's usable memory."""
    c = {**BASE, **changes}
    model = _model(c["model"])
    spec = catalog.gpu(gpu)
    workload = "hf" if model.arch == "vit" else c["workload"]
    train = TrainSpec(
        seq_len=model.max_positions if model.arch == "vit" else c["seq_len"],
        micro_batch=c["micro_batch"],
        precision=c["precision"],
        optimizer_impl=c["optimizer_impl"],
        activation_checkpointing=c["ac"],
        attention=c["attention"],
        device=device,
        logits=c["logits"],
        loss=c["loss"],
        compile=c["compile"],
        finetune=c["finetune"],
    )
    job = Job(
        model=model,
        train=train,
        cluster=ClusterSpec(
            gpus=c["world"], gpus_per_node=min(c["world"], 8), gpu_mem_bytes=spec.memory_bytes, gpu_name=spec.name
        ),
        plan=Plan(strategy=c["strategy"]),
    )
    scaled = estimate(job).total_bytes > job.cluster.usable_bytes
    run = Run(job=job, mode="emulate", steps=3, warmup=2, workload=workload, layers_scaled=scaled)
    return Case(
        name=_name(axis, c, snapshot, train.seq_len),
        axis=axis,
        run=run,
        sdpa_backend=c["sdpa_backend"],
        snapshot=snapshot,
    )


LORA = {"model": "llama-3.1-8b", "strategy": "single", "world": 1, "precision": "bf16", "finetune": "lora"}
"""peft's LoRA (rank 8 on the attention projections, memplan's default) on transformers' Llama-3.1-8B
shapes, one GPU, the model cast to bf16 before the adapters are added (calibrate.finetune.adapt)."""
FIRST: tuple[tuple[str, dict], ...] = (
    # 1. reserved against allocated on the base FSDP2 run: the allocator's history, then the run timed
    ("snapshot", {"snapshot": True}),
    ("model", {}),
    # (2. the probes run here: the CUDA context and cuBLAS workspace, PROBES_AFTER)
    # 3. DDP's buckets and a single GPU's foreach temporaries on CUDA, each with its history
    ("strategy", {"strategy": "ddp", "world": 8}),
    ("snapshot", {"strategy": "ddp", "precision": "amp-bf16", "snapshot": True}),
    ("strategy", {"strategy": "single", "world": 1}),
    ("snapshot", {"model": "qwen2.5-0.5b", "strategy": "single", "world": 1, "precision": "bf16", "snapshot": True}),
    # 4. flash against memory-efficient SDPA
    ("attention", {"sdpa_backend": "flash"}),
    ("attention", {"sdpa_backend": "efficient"}),
    # 5. torch.compile of the blocks, where the CPU and the published rows disagree
    ("loop", {"compile": True}),
    # 6. one full-AC run and one LoRA run
    ("ac", {"ac": "full"}),
    ("finetune", {**LORA, "workload": "hf"}),
)
"""What the first minutes of a lent device must answer (issue 25), in this order; the rest follows."""
PROBES_AFTER = 2
"""The probes run after the first two cases of FIRST (the base run with its history and timed)."""


def _design_points() -> list[tuple[str, dict]]:
    """(axis, changes from BASE) of every run, in the order they run: FIRST, then the rest
    (a run FIRST already holds keeps its place there)."""
    points: list[tuple[str, dict]] = [*FIRST, ("model", {})]
    # strategy × emulated world size at the base model, and at 8B where DDP and single are layer-scaled
    for strategy, world in (
        ("single", 1),
        ("ddp", 8),
        ("ddp", 64),
        ("fsdp-full-shard", 1),
        ("fsdp-full-shard", 64),
        ("fsdp-shard-grad-op", 8),
        ("fsdp-shard-grad-op", 64),
        ("fsdp-hybrid-shard", 64),
    ):
        points.append(("strategy", {"strategy": strategy, "world": world}))
    # precision × strategy on a 0.5B model (every precision each strategy runs natively)
    for strategy, world in (
        ("single", 1),
        ("ddp", 8),
        ("fsdp-full-shard", 8),
        ("fsdp-shard-grad-op", 8),
        ("fsdp-hybrid-shard", 64),
    ):
        for precision in ("fp32", "amp-bf16", "mixed-bf16", "bf16"):
            points.append(
                ("precision", {"model": "qwen2.5-0.5b", "strategy": strategy, "world": world, "precision": precision})
            )
    # precision at the base model
    for precision in ("fp32", "amp-bf16", "bf16"):
        points.append(("precision", {"precision": precision}))
    # activation checkpointing, and against precision and strategy
    for ac in ("selective", "op", "full"):
        points.append(("ac", {"ac": ac}))
    points += [
        ("ac", {"ac": "full", "strategy": "single", "world": 1, "precision": "bf16"}),
        ("ac", {"ac": "op", "model": "qwen2.5-0.5b", "strategy": "ddp", "precision": "amp-bf16"}),
        ("ac", {"ac": "selective", "attention": "eager", "seq_len": 1024}),
        ("ac", {"ac": "full", "model": "llama-3.1-8b"}),
    ]
    # attention: SDPA's flash and memory-efficient backends, and eager
    points += [
        ("attention", {"sdpa_backend": "flash"}),
        ("attention", {"sdpa_backend": "efficient"}),
        ("attention", {"attention": "eager"}),
        # without GQA (GPT-2's heads are all key/value heads): a backend that refuses enable_gqa still runs
        ("attention", {"model": "gpt2", "micro_batch": 8, "seq_len": 1024, "sdpa_backend": "flash"}),
        ("attention", {"model": "gpt2", "micro_batch": 8, "seq_len": 1024, "sdpa_backend": "efficient"}),
        (
            "attention",
            {
                "attention": "eager",
                "model": "qwen2.5-0.5b",
                "strategy": "single",
                "world": 1,
                "precision": "fp32",
                "seq_len": 1024,
            },
        ),
        (
            "attention",
            {
                "sdpa_backend": "efficient",
                "model": "qwen2.5-0.5b",
                "strategy": "single",
                "world": 1,
                "precision": "fp32",
                "seq_len": 1024,
            },
        ),
    ]
    # AdamW: fused against foreach
    points += [
        ("optimizer", {"optimizer_impl": "fused"}),
        ("optimizer", {"optimizer_impl": "fused", "strategy": "single", "world": 1, "precision": "bf16"}),
        ("optimizer", {"optimizer_impl": "fused", "model": "qwen2.5-0.5b", "strategy": "ddp", "precision": "amp-bf16"}),
    ]
    # the loop: logits freed, chunked loss, torch.compile
    points += [
        ("loop", {"logits": "freed"}),
        ("loop", {"loss": "chunked-ce", "logits": "freed"}),
        ("loop", {"compile": True}),
        ("loop", {"logits": "freed", "strategy": "single", "world": 1, "precision": "bf16"}),
        (
            "loop",
            {
                "loss": "chunked-ce",
                "logits": "freed",
                "model": "llama-3.2-3b",
                "strategy": "single",
                "world": 1,
                "precision": "bf16",
            },
        ),
        (
            "loop",
            {
                "compile": True,
                "ac": "full",
                "model": "qwen2.5-0.5b",
                "strategy": "single",
                "world": 1,
                "precision": "bf16",
            },
        ),
    ]
    # models at the base settings, and at the strategies that do not fit the 8B
    points += [
        ("model", {"model": "qwen2.5-0.5b"}),
        ("model", {"model": "llama-3.2-3b"}),
        ("model", {"model": "llama-3.1-8b"}),
        ("model", {"model": "gpt2", "micro_batch": 8, "seq_len": 1024}),
        ("model", {"model": "gpt2", "micro_batch": 8, "seq_len": 1024, "attention": "eager", "strategy": "ddp"}),
        ("model", {"model": ENCODER, "micro_batch": 32}),
        ("model", {"model": ENCODER, "micro_batch": 32, "strategy": "ddp", "precision": "amp-bf16"}),
        ("model", {"model": "llama-3.2-3b", "strategy": "ddp"}),
        ("model", {"model": "llama-3.1-8b", "strategy": "single", "world": 1, "precision": "bf16"}),
        ("model", {"model": "llama-3.1-8b", "strategy": "ddp", "precision": "amp-bf16"}),
        ("model", {"model": "llama-3.1-8b", "world": 64}),
        ("model", {"model": "llama-3.1-8b", "strategy": "fsdp-hybrid-shard", "world": 64}),
    ]
    # micro-batch and sequence shapes
    points += [
        ("batch", {"micro_batch": 1, "seq_len": 4096}),
        ("batch", {"micro_batch": 8, "seq_len": 512}),
        ("batch", {"micro_batch": 4, "seq_len": 2048}),
    ]
    return points


SNAPSHOTS: tuple[dict, ...] = (
    {"model": "qwen2.5-0.5b", "strategy": "single", "world": 1, "precision": "bf16"},
    {},
    {"strategy": "ddp", "precision": "amp-bf16"},
    {"ac": "full"},
)
"""Runs repeated with the allocator's history recorded (their own records: the history's
hooks slow the step, so the timed runs stay the plain ones)."""


def design(gpu: str = "h100-sxm", *, device: str = "cuda") -> tuple[list[Case], list[str]]:
    """The campaign's cases on ``gpu``, each distinct run once, and the points left out (a
    precision the strategy has no native implementation of), with why."""
    cases: dict[tuple, Case] = {}
    left_out = []
    points = _design_points() + [("snapshot", {**s, "snapshot": True}) for s in SNAPSHOTS]
    for axis, changes in points:
        c = {**BASE, **changes}
        if c["precision"] == "mixed-bf16" and not runs_natively(STRATEGIES[c["strategy"]], "mixed-bf16"):
            # DDP and a single GPU have no fp32-master policy of their own: torch.autocast is theirs
            changes = {**changes, "precision": "amp-bf16"}
            c["precision"] = "amp-bf16"
        if not runs_natively(STRATEGIES[c["strategy"]], c["precision"]):
            left_out.append(f"{axis}: {c['precision']} under {c['strategy']} has no native torch implementation")
            continue
        case = make_case(axis, gpu=gpu, device=device, **changes)
        cases.setdefault((case.run.key, case.sdpa_backend, case.snapshot), case)
    return list(cases.values()), left_out


def _params_gib(job: Job) -> float:
    return job.model.num_params * 4 / 2**30


def estimated_s(case: Case) -> float:
    """Seconds the case is planned to take: start-up, building each model it measures, its
    steps at memplan's compute time on the job's GPU (the fake process group moves no bytes,
    so no communication time), compilation and the snapshot."""
    job, run = case.run.job, case.run
    depths = layerscale.DEPTHS if run.layers_scaled else (job.model.num_layers,)
    seconds = STARTUP_S + (HF_IMPORT_S if run.workload == "hf" else 0.0)
    for depth in depths:
        shallow = job.with_(num_layers=depth) if depth != job.model.num_layers else job
        step_s = max(step_time(shallow, link_for(shallow)).compute_s, STEP_FLOOR_S)
        seconds += BUILD_S_PER_GIB * _params_gib(shallow) + run.steps * step_s
    if job.train.compile:
        seconds += COMPILE_S * len(depths)
    if case.snapshot:
        seconds += SNAPSHOT_S
    return seconds


def timeout_s(case: Case) -> float:
    return min(MAX_TIMEOUT_S, max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * estimated_s(case)))


def probe_timeout_s(probe: str) -> float:
    return MIN_TIMEOUT_S * (3 if probe == "context-eager" else 1)


def probe_estimated_s(probe: str) -> float:
    """A probe is a start-up; loading every module eagerly is planned as three."""
    return STARTUP_S * (3 if probe == "context-eager" else 1)


def select(cases: list[Case], only: str | None) -> list[Case]:
    """The cases whose name matches the regular expression ``only`` (all when None)."""
    if not only:
        return cases
    try:
        pattern = re.compile(only)
    except re.error as exc:
        raise MemplanError(f"--only {only!r} is not a regular expression ({exc})") from None
    return [c for c in cases if pattern.search(c.name)]


def detect_gpu() -> str:
    """The tables/gpus.csv name of this machine's CUDA device; h100-sxm without one."""
    import subprocess
    import sys

    from memplan.calibration import same_device

    probe = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    name = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    if not name:
        return "h100-sxm"
    found = [g.name for g in catalog.gpus().values() if same_device(name, g.name)]
    if not found:
        raise MemplanError(f"the device {name!r} is not in tables/gpus.csv; pass --gpu NAME")
    # "NVIDIA H100 80GB HBM3" matches h100-sxm and h100-pcie alike: the SXM part unless PCIe is named
    pcie = [g for g in found if "pcie" in g]
    return (pcie if "pcie" in name.lower() else [g for g in found if g not in pcie] or found)[0]


def ordered(cases: list[Case], probes=PROBES) -> list[Case | str]:
    """The order the sweep runs in: the first PROBES_AFTER cases, the probes, the other cases."""
    return [*cases[:PROBES_AFTER], *probes, *cases[PROBES_AFTER:]]


def _planned(item: Case | str) -> tuple[str, float, float]:
    """(name, estimated seconds, timeout) of a case or a probe."""
    if isinstance(item, str):
        return f"probe/{item}", probe_estimated_s(item), probe_timeout_s(item)
    return item.name, estimated_s(item), timeout_s(item)


def slices(items: list[Case | str], slice_s: float) -> list[int]:
    """The slice (0, 1, ...) each item runs in when every device call has ``slice_s`` seconds
    and runs take their estimated time, by the sweep's own rule (START_FACTOR)."""
    out, index, elapsed = [], 0, 0.0
    for item in items:
        _, s, _ = _planned(item)
        if elapsed > 0 and elapsed + START_FACTOR * s > slice_s:
            index, elapsed = index + 1, 0.0
        out.append(index)
        elapsed += s
    return out


def dry_run(
    cases: list[Case], *, budget_s: float = BUDGET_S, probes=PROBES, slice_s: float = SLICE_S
) -> tuple[list[str], float]:
    """The listing of every run in the order it runs, with its configuration, estimated time
    and the device call (slice of ``slice_s`` seconds) it falls in, the planned minutes of each
    slice, and the total."""
    items = ordered(cases, probes)
    where = slices(items, slice_s)
    lines = [f"{'#':>3}  {'slice':>5}  {'est s':>6}  {'timeout':>7}  name  [memplan's description]"]
    total, per_slice = 0.0, [0.0] * (max(where, default=0) + 1)
    for i, (item, k) in enumerate(zip(items, where)):
        name, s, timeout = _planned(item)
        total += s
        per_slice[k] += s
        if isinstance(item, str):
            lines.append(f"{i:>3}  {k + 1:>5}  {s:>6.1f}  {timeout:>7.0f}  {name}")
            continue
        extra = f" sdpa-{item.sdpa_backend}" if item.sdpa_backend != "default" else ""
        flags = " snapshot" if item.snapshot else ""
        lines.append(f"{i:>3}  {k + 1:>5}  {s:>6.1f}  {timeout:>7.0f}  {name}  [{item.run.describe()}{extra}{flags}]")
    for k, s in enumerate(per_slice):
        count = where.count(k)
        lines.append(f"slice {k + 1}: {count} runs, {s / 60:.1f} min planned (calls of {slice_s:.0f} s)")
    verdict = "within" if total <= budget_s else "OVER"
    lines.append(
        f"{len(cases)} runs + {len(probes)} probes: {total:.0f} s estimated ({total / 60:.1f} min), "
        f"{verdict} the {budget_s / 60:.0f}-minute budget"
    )
    return lines, total


# ---- the driver ------------------------------------------------------------------------

RECORDS, PROBE_RECORDS, SNAPSHOT_DIR = "records.jsonl", "probes.jsonl", "snapshots"


def recorded_names(out_dir: Path) -> set[str]:
    """Cases and probes the output folder already records (``--resume`` skips them)."""
    names = set()
    path = Path(out_dir, RECORDS)
    if path.exists():
        names |= {r.get("campaign", {}).get("name") for r in records.read([path])}
    probes = Path(out_dir, PROBE_RECORDS)
    if probes.exists():
        for line in probes.read_text(encoding="utf-8").splitlines():
            try:
                names.add("probe/" + json.loads(line)["probe"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return names


def child_case(case: Case, out_dir: Path, timeout: float) -> dict:
    """Run the case in ``python -m validation.gpu_campaign`` (killed past ``timeout``)."""
    with tempfile.TemporaryDirectory(prefix="campaign-") as tmp:
        case_path = Path(tmp, "case.json")
        case_path.write_text(json.dumps(case.to_dict()), encoding="utf-8")
        args = ["-m", "validation.gpu_campaign", "case", str(case_path), "--snapshots", str(out_dir / SNAPSHOT_DIR)]
        return runs.execute_child([*args, "--result"], [], tmp=Path(tmp), timeout_s=timeout)


def child_probe(probe: str, timeout: float) -> dict:
    loading = "LAZY" if probe == "context-lazy" else "EAGER"
    with tempfile.TemporaryDirectory(prefix="campaign-") as tmp:
        args = ["-m", "validation.gpu_campaign", "probe", probe, "--result"]
        return runs.execute_child(args, [], tmp=Path(tmp), timeout_s=timeout, env={"CUDA_MODULE_LOADING": loading})


def campaign_record(case: Case, outcome: dict, *, wall_s: float, gpu: str) -> dict:
    """A calibrate.records record of the case, with memplan's reserved estimate beside its
    allocated and total, and the campaign's own fields (name, axis, SDPA backend, snapshot
    files, versions, NVML's view) under ``campaign``."""
    outcome = dict(outcome)
    extra = outcome.pop("campaign_extra", None) or {}
    record = records.make_record(case.run, **outcome, wall_s=wall_s)
    if record["estimate"] is not None:
        from memplan.overheads import reserved_bytes
        from memplan.totals import final

        record["estimate"]["reserved_bytes"] = reserved_bytes(final(case.run.job))
    record["campaign"] = {
        "name": case.name,
        "axis": case.axis,
        "gpu": gpu,
        "sdpa_backend": case.sdpa_backend,
        "snapshot": case.snapshot,
        "estimated_s": round(estimated_s(case), 1),
        "timeout_s": timeout_s(case),
        **extra,
    }
    return record


@dataclass
class Progress:
    done: list[str]
    skipped: list[str]
    left: list[str]
    """Not started: the call's budget would not hold them (run again with --resume)."""


def sweep(
    cases: list[Case],
    out_dir,
    *,
    gpu: str,
    resume: bool = False,
    probes=PROBES,
    budget_s: float | None = None,
    run_case: Callable[[Case, Path, float], dict] = child_case,
    run_probe: Callable[[str, float], dict] = child_probe,
    say: Callable[[str], None] = print,
) -> Progress:
    """Run the cases and probes in their order (``ordered``), appending each record as it ends. With ``budget_s``
    (seconds for this call), a run starts only while START_FACTOR × its planned time is left,
    and is killed at the call's end if it runs past it (recorded as ``timeout``): the call
    ends in time whatever the runs do (a device command has a hard limit)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = recorded_names(out_dir) if resume else set()
    progress = Progress(done=[], skipped=[], left=[])
    start = time.perf_counter()

    def do_probe(probe: str, timeout: float) -> None:
        t0 = time.perf_counter()
        outcome = run_probe(probe, timeout)
        record = {"probe": probe, **outcome, "wall_s": round(time.perf_counter() - t0, 3)}
        records.append(out_dir / PROBE_RECORDS, record)
        say(f"probe/{probe}: {outcome['status']}")

    def do_case(case: Case, timeout: float) -> None:
        t0 = time.perf_counter()
        try:
            outcome = run_case(case, out_dir, timeout)
        except Exception as exc:  # the driver's own failure around the child: recorded, the sweep goes on
            outcome = {"status": "failed", "measurement": None, "error": f"{type(exc).__name__}: {exc}"}
        record = campaign_record(case, outcome, wall_s=time.perf_counter() - t0, gpu=gpu)
        records.append(out_dir / RECORDS, record)
        say(f"{case.name}: {record['status']} in {record['wall_s']:.1f} s")

    for item in ordered(cases, probes):
        name, planned_s, timeout = _planned(item)
        if name in done:
            progress.skipped.append(name)
            continue
        if budget_s is not None:
            left_s = budget_s - (time.perf_counter() - start)
            if START_FACTOR * planned_s > left_s:
                progress.left.append(name)
                continue
            timeout = min(timeout, left_s)
        if isinstance(item, str):
            do_probe(item, timeout)
        else:
            do_case(item, timeout)
        progress.done.append(name)
    return progress


def ship_stem(gpu: str, torch_version: str) -> str:
    """``h100-sxm-torch2.11.0-cu130``: the device key ``memplan.calibration.shipped`` globs
    for (``GPU-*.corrections.json``), then the torch version ('+' made '-')."""
    return f"{gpu}-torch{torch_version.replace('+', '-')}"


def ship(out_dir, tables_dir) -> tuple[Path, Path]:
    """Copy the campaign's records to ``TABLES/calibration/GPU-torchVERSION.jsonl`` and fit
    their corrections beside them (``.corrections.json``), where ``memplan.calibration.shipped``
    finds them for ``--gpu GPU``. Refused unless every ok record was measured on that GPU and
    one torch version (only figures that came back from the device are shipped)."""
    from calibrate.fit import fit_records
    from memplan.calibration import SHIPPED_DIR, same_device

    path = Path(out_dir, RECORDS)
    found = records.read([path])
    ok = [r for r in found if r["status"] == "ok"]
    if not ok:
        raise MemplanError(f"{path} holds no ok records: nothing to ship")
    gpus = {r["campaign"]["gpu"] for r in ok}
    versions = {r["measurement"]["torch_version"] for r in ok}
    if len(gpus) != 1 or len(versions) != 1:
        raise MemplanError(f"{path} mixes GPUs {sorted(gpus)} or torch versions {sorted(versions)}: ship one of each")
    (gpu,), (version,) = gpus, versions
    strangers = sorted({r["measurement"]["device"] for r in ok if not same_device(r["measurement"]["device"], gpu)})
    if strangers:
        raise MemplanError(f"{path}: records measured on {', '.join(strangers)} are not {gpu} records")
    stem = Path(tables_dir, SHIPPED_DIR, ship_stem(gpu, version))
    stem.parent.mkdir(parents=True, exist_ok=True)
    shipped_records = stem.with_name(stem.name + ".jsonl")
    shipped_records.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    corrections = stem.with_name(stem.name + ".corrections.json")
    fit_records(found, sources=[f"tables/{SHIPPED_DIR}/{shipped_records.name}"]).save(corrections)
    return shipped_records, corrections


# ---- the accuracy report -------------------------------------------------------------


@dataclass(frozen=True)
class Errors:
    """One ok record's errors (%, estimate against measurement): allocated, reserved and total,
    before correction and after the correction fitted on the other half of the records."""

    name: str
    measured: tuple[int, int, int]
    """Peak allocated, peak reserved, device used (total − free: the context included)."""
    before: tuple[float, float, float]
    after: tuple[float, float, float]


def _pct(estimated: int, measured: int) -> float:
    return (estimated / measured - 1) * 100


def _pcts(estimated: tuple[int, int, int], measured: tuple[int, int, int]) -> tuple[float, float, float]:
    return (_pct(estimated[0], measured[0]), _pct(estimated[1], measured[1]), _pct(estimated[2], measured[2]))


def accuracy(found: list[dict]) -> list[Errors]:
    """Every ok record against today's model: its estimate as ``memplan estimate`` gives it (the
    allocator replayed), and corrected by the fit of the other half (records alternately
    assigned), so that no record judges a fit it took part in."""
    from calibrate.fit import fit, observations
    from memplan.calibration import apply
    from memplan.overheads import allocator_bytes, reserved_bytes
    from memplan.totals import final

    ok = [r for r in found if r["status"] == "ok"]
    halves = (ok[0::2], ok[1::2])
    out = []
    for half, other in (halves, halves[::-1]):
        (correction,) = fit(observations(other))
        for record in half:
            m = record["measurement"]
            measured = (m["peak_allocated_bytes"], m["peak_reserved_bytes"], m["device_used_bytes"])
            est = final(records.job_from_spec(record["spec"]))
            fixed = apply(est, correction, device_matches=True)
            before = (est.allocated_bytes, reserved_bytes(est), est.total_bytes)
            after = (fixed.allocated_bytes, fixed.allocated_bytes + allocator_bytes(est), fixed.total_bytes)
            out.append(
                Errors(
                    name=record["campaign"]["name"],
                    measured=measured,
                    before=_pcts(before, measured),
                    after=_pcts(after, measured),
                )
            )
    order = [r["campaign"]["name"] for r in ok]
    return sorted(out, key=lambda e: order.index(e.name))


def _summary(rows: list[Errors]) -> list[str]:
    import statistics

    lines = [
        "| quantity | median abs. error before | max before | median abs. error after (held out) | max after |",
        "|---|---|---|---|---|",
    ]
    for i, quantity in enumerate(("allocated", "reserved", "total (device used)")):
        before = [abs(r.before[i]) for r in rows]
        after = [abs(r.after[i]) for r in rows]
        lines.append(
            f"| {quantity} | {statistics.median(before):.2f} % | {max(before):.1f} % | "
            f"{statistics.median(after):.2f} % | {max(after):.1f} % |"
        )
    return lines


def report(found: list[dict], traces: dict[str, int]) -> str:
    """The campaign's accuracy table in Markdown: the summary, every run, the runs that did not
    come back, and ``traces`` (run name → the reserved peak memplan's allocator replays from
    that run's own recorded events)."""
    rows = accuracy(found)
    gib = 2**30
    lines = [f"{len(rows)} of {len(found)} recorded runs ok.", "", *_summary(rows), ""]
    lines += [
        "| run | allocated GiB | reserved GiB | used GiB | allocated % before / after | "
        "reserved % before / after | total % before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{b:+.1f} / {a:+.1f}" for b, a in zip(r.before, r.after))
        sizes = " | ".join(f"{x / gib:.2f}" for x in r.measured)
        lines.append(f"| {r.name} | {sizes} | {cells} |")
    failed = [r for r in found if r["status"] != "ok"]
    if failed:
        lines += ["", "Runs that did not come back ok:", ""]
        lines += [f"- {r['campaign']['name']}: {r['status']}, {(r.get('error') or '').splitlines()[0]}" for r in failed]
    if traces:
        by_name = {r["campaign"]["name"]: r["measurement"] for r in found if r["status"] == "ok"}
        lines += [
            "",
            "The allocator replay on each snapshot run's own events (calibrate.alloctrace, memplan.allocator):",
            "",
            "| run | measured peak reserved B | replayed B | difference |",
            "|---|---|---|---|",
        ]
        for name, replayed in traces.items():
            measured = by_name[name]["peak_reserved_bytes"]
            lines.append(f"| {name} | {measured:,} | {replayed:,} | {_pct(replayed, measured):+.2f} % |")
    return "\n".join(lines) + "\n"


def replayed_traces(folder) -> dict[str, int]:
    """Run name → the peak reserved memplan's allocator replays from the run's saved events."""
    from calibrate import alloctrace
    from memplan.allocator import replay

    out = {}
    for path in sorted(Path(folder).glob("snapshot_*.trace.jsonl.gz")):
        name = "snapshot/" + path.name.removeprefix("snapshot_").removesuffix(".trace.jsonl.gz")
        out[name] = replay(alloctrace.load(path)).peak_reserved_bytes
    return out
