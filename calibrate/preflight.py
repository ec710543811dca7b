"""Checks before a sweep's first run, each a one-line error (exit 2): what would make every
run fail is said once, up front, not recorded run after run.

The parent of a sweep never imports torch; what the runs will find (torch, its version, the
CUDA devices, DeepSpeed) is asked of the interpreter that runs them, in one short child.

Example usage::

    machine = probe()
    device = default_device(machine)           # cuda where torch sees a device, else cpu
    check(runs, machine=machine, mode="local")  # raises MemplanError on the first problem
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.frameworks import adapter, runs_natively
from memplan.strategies import STRATEGIES

from .records import Run, UserModel

MIN_TORCH = (2, 4)
"""The calibrate extra's floor (setup.cfg: torch>=2.4): FSDP2's fully_shard, the fake process
group and MemTracker as the harness calls them."""
PROBE_TIMEOUT_S = 120.0
_PROBE = """
import importlib.util, json
out = {"deepspeed": importlib.util.find_spec("deepspeed") is not None}
try:
    import torch
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
else:
    cuda = torch.cuda.is_available()
    out.update(torch=torch.__version__, cuda_devices=torch.cuda.device_count() if cuda else 0,
               cuda_name=torch.cuda.get_device_name(0) if cuda else None)
print(json.dumps(out))
"""


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What the runs' interpreter finds here."""

    python: str
    torch_version: str | None = None
    import_error: str | None = None
    """Why ``import torch`` failed (None: it did not)."""
    cuda_devices: int = 0
    cuda_name: str | None = None
    deepspeed: bool = False

    def describe(self, device: str) -> str:
        if device == "cuda":
            return f"cuda ({self.cuda_devices} × {self.cuda_name}), torch {self.torch_version}"
        why = "no CUDA device here" if self.torch_version else "torch not checked"
        return f"cpu ({why}), torch {self.torch_version}"


def probe(python: str = sys.executable) -> Machine:
    """Ask ``python`` (the interpreter the runs use) for torch, its CUDA devices and DeepSpeed."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError) as exc:
        return Machine(python=python, import_error=f"{python} could not be asked about torch ({exc})")
    return Machine(
        python=python,
        torch_version=found.get("torch"),
        import_error=found.get("error"),
        cuda_devices=found.get("cuda_devices", 0),
        cuda_name=found.get("cuda_name"),
        deepspeed=found["deepspeed"],
    )


def default_device(machine: Machine) -> str:
    """What ``--device`` means when not given: cuda where torch sees a device, else cpu."""
    return "cuda" if machine.cuda_devices else "cpu"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_torch(machine: Machine) -> None:
    floor = ".".join(map(str, MIN_TORCH))
    if machine.import_error is not None:
        raise MemplanError(
            f"torch cannot be imported by {machine.python} ({machine.import_error.splitlines()[0]}); "
            f'calibration runs need torch>={floor}: pip install ".[calibrate]" '
            "(the CPU build: see memplan calibrate --help)"
        )
    if machine.torch_version is not None and _version(machine.torch_version) < MIN_TORCH:
        raise MemplanError(
            f"torch {machine.torch_version} is older than calibration needs (torch>={floor}, FSDP2 and the fake "
            f"process group); upgrade it in {machine.python}'s environment"
        )


def check_runs(runs: list[Run], *, machine: Machine, mode: str) -> None:
    """The first run the harness cannot give here, as one error."""
    for run in runs:
        job, what = run.job, run.describe()
        strategy = STRATEGIES[job.plan.strategy]
        if strategy.framework == "deepspeed":
            missing = "" if machine.deepspeed else f"; DeepSpeed is not installed for {machine.python} either"
            raise MemplanError(
                f"{what}: {strategy.id} runs under DeepSpeed, which `memplan calibrate run` does not drive "
                f"(it drives DDP and FSDP2; python -m validation.dsmatrix measures ZeRO){missing}"
            )
        if not runs_natively(strategy, job.train.precision):
            native = ", ".join(adapter(strategy).native_precisions)
            raise MemplanError(
                f"{what}: {strategy.id} has no native {job.train.precision} (it runs {native}); "
                "pass --precision one of those, or leave --strategy at all to skip it"
            )
        if mode == "cluster" or job.train.device != "cuda":
            continue
        if machine.cuda_devices == 0:
            raise MemplanError(
                f"{what}: --device cuda, but torch {machine.torch_version} sees no CUDA device here; "
                "leave --device out (it defaults to what this machine has) or pass --device cpu"
            )
        ranks = job.cluster.gpus if mode == "local" else 1
        if ranks > machine.cuda_devices:
            raise MemplanError(
                f"{what}: --mode local needs {ranks} CUDA devices, this machine has {machine.cuda_devices}; "
                "--mode emulate runs one rank of it on a fake process group, --mode cluster on Slurm"
            )


def check_user(user: UserModel, *, machine: Machine) -> dict:
    """What the runs' interpreter finds of a model built by its own code (``calibrate.usermodel``
    ``probe``: it imports the factory and builds the model under fake tensors): its units, a spec
    memplan describes; why it cannot run, as one error."""
    command = [machine.python, "-m", "calibrate.usermodel", json.dumps(user.to_dict())]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise MemplanError(f"{user.name()} could not be built to check it ({exc})") from None
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise MemplanError(f"{user.name()} could not be built to check it: {last}") from None
    if "error" in found:
        raise MemplanError(found["error"])
    return found
