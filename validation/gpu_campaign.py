"""The child processes of the GPU campaign (``validation.campaign`` plans and drives them).

    python -m validation.gpu_campaign case CASE.json --snapshots DIR --result RESULT.json
    python -m validation.gpu_campaign probe context-lazy --result RESULT.json

``case``: one campaign run measured by ``calibrate.runner.execute`` (emulated rank, fake
process group; layer-scaled where planned so), under the case's SDPA backend, with the
allocator's history recorded and saved for a snapshot case; the outcome carries the
versions, the device and NVML's view of this process under ``campaign_extra``.
``probe``: the CUDA context this process holds right after creating it (run once with
CUDA_MODULE_LOADING=LAZY and once EAGER by the parent) and, lazily loaded, the cuBLAS
workspace the first matmul of each dtype adds.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import pickle
import sys
import traceback
from pathlib import Path

import torch

from calibrate import alloctrace, runner

from .campaign import SNAPSHOT_MAX_ENTRIES, Case

MIB = 2**20


def _nvml():
    """pynvml (nvidia-ml-py), initialised, or None where it is not installed or not working."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no NVML here (a CPU machine, a sandbox without the library): nothing to read
        return None


def nvml_view() -> dict:
    """The driver version, the device's used memory and this process's own, as NVML sees them
    (None where NVML is absent or does not list the process)."""
    nvml = _nvml()
    if nvml is None:
        return {"driver_version": None, "nvml_device_used_bytes": None, "nvml_process_used_bytes": None}
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    process = None
    with contextlib.suppress(nvml.NVMLError):
        mine = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
        process = mine[0].usedGpuMemory if mine else None
    driver = nvml.nvmlSystemGetDriverVersion()
    return {
        "driver_version": driver.decode() if isinstance(driver, bytes) else driver,
        "nvml_device_used_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
        "nvml_process_used_bytes": process,
    }


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()  # a tuple (major, minor, patch); an int in old releases
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def environment() -> dict:
    """What the numbers were measured with: versions, the device, the allocator settings."""
    cuda = torch.cuda.is_available()
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "nccl_version": _nccl_version() if cuda else None,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "device_total_bytes": torch.cuda.mem_get_info()[1] if cuda else None,
        "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "python": sys.version.split()[0],
        **(nvml_view() if cuda else {}),
    }


def _sdpa_backend(name: str):
    """``torch.nn.attention.sdpa_kernel`` restricted to one backend; default: torch's dispatch."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[name])


def save_snapshot(snapshot: dict, directory: Path, name: str) -> dict:
    """The raw snapshot (pickle, gzip) and its events in calibrate.alloctrace's replay form."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = name.replace("/", "_")
    raw, trace = directory / f"{stem}.pickle.gz", directory / f"{stem}.trace.jsonl.gz"
    with gzip.open(raw, "wb") as f:
        pickle.dump(snapshot, f)
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    events = alloctrace.from_snapshot(snapshot, device)
    alloctrace.save(events, trace)
    return {"snapshot_file": raw.name, "trace_file": trace.name, "trace_events": len(events)}


def run_case(case: Case, snapshot_dir: Path) -> dict:
    """The case's outcome (calibrate.runner's, which never raises), with ``campaign_extra``:
    what goes wrong after the measurement is noted there and loses nothing measured."""
    recording = case.snapshot and torch.cuda.is_available()
    if recording:
        # no stack frames (context None): the replay needs sizes, order and streams only
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES, context=None, stacks="python")
    with _sdpa_backend(case.sdpa_backend):
        outcome = runner.execute(case.run)
    extra: dict = {"loss_source": "calibrate.measure.chunked_ce"} if case.run.job.train.loss == "chunked-ce" else {}
    if case.run.job.train.compile:
        extra["compile_scope"] = "blocks"
    try:
        if recording:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            extra |= save_snapshot(snapshot, snapshot_dir, case.name)
        elif case.snapshot:
            extra["snapshot_skipped"] = "no CUDA device: the allocator history is CUDA's"
    except Exception as exc:  # the measurement stands without its snapshot
        extra["snapshot_error"] = f"{type(exc).__name__}: {exc}"
    try:
        extra |= environment()
    except Exception as exc:  # likewise without the versions NVML or torch could not give
        extra["environment_error"] = f"{type(exc).__name__}: {exc}"
    outcome["campaign_extra"] = extra
    return outcome


def _used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def probe(name: str) -> dict:
    """The CUDA context of this process (and, lazily loaded, the cuBLAS workspace)."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the context probe measures one")
    nvml = _nvml()
    before = None
    if nvml is not None:  # the device before this process touched it
        before = int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).used)
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out: dict = {
        "nvml_used_before_bytes": before,
        "used_after_context_bytes": _used_bytes(),
        "reserved_after_context_bytes": torch.cuda.memory_reserved(),
        **environment(),
    }
    if name == "context-lazy":
        out["cublas"] = [_first_matmul(dtype) for dtype in (torch.bfloat16, torch.float32)]
        out["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return out


def _first_matmul(dtype) -> dict:
    """Allocated, reserved and device-used bytes around the first matmul of ``dtype`` (and
    its backward), then after torch clears the cuBLAS workspaces."""
    a = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
    torch.cuda.synchronize()
    stats = lambda: (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), _used_bytes())  # noqa: E731
    start = stats()
    (a @ a).sum().backward()
    torch.cuda.synchronize()
    after = stats()
    del a
    torch.cuda.empty_cache()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds only
    if clear is not None:
        clear()
    torch.cuda.synchronize()
    cleared = stats()
    keys = ("allocated_bytes", "reserved_bytes", "used_bytes")
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "before": dict(zip(keys, start)),
        "after_matmul": dict(zip(keys, after)),
        "after_clear": dict(zip(keys, cleared)),
    }


def _write(path: str, outcome: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(outcome), encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str]) -> None:
    kind, target = argv[0], argv[1]
    result = argv[argv.index("--result") + 1]
    if kind == "case":
        case = Case.from_dict(json.loads(Path(target).read_text(encoding="utf-8")))
        snapshots = Path(argv[argv.index("--snapshots") + 1])
        _write(result, run_case(case, snapshots))
        return
    try:
        outcome = {"status": "ok", "measurement": probe(target), "error": None}
    except BaseException as exc:  # the probe's failure is its record
        outcome = {
            "status": "failed",
            "measurement": None,
            "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}",
        }
    _write(result, outcome)


if __name__ == "__main__":
    main(sys.argv[1:])
