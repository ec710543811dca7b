"""memplan: per-GPU memory planner and distributed-strategy recommender for PyTorch training.

    import memplan
    memplan.estimate(params=13e9, gpus=8, gpu_mem=80).to_frame()
    memplan.recommend(model="llama-2-70b", gpus=16, gpu="a100-80gb")
    memplan.min_gpus(params=70e9, gpu="a100-80gb", ac="full")
    memplan.sweep(params=[7e9, 70e9], gpus=[8, 64], micro_batch=[1, 4], seq_len=[2048], gpu_mem=80)
    memplan.from_module(model, gpus=8, gpu="h100-sxm")
    memplan.estimate(memplan.Request.of(params=13e9, gpus=8), calibration=None)

Each takes a ``Request`` and/or its inputs as keywords (see memplan.request).
"""

import gc

# The cyclic collector waits while the package loads: its classes and tables are no garbage,
# and its passes over them took 15–20 ms of the main job's 0.45 s (benchmarks/cli_startup.py).
_collecting = gc.isenabled()
gc.disable()
try:
    from .api import Result, estimate, from_module, min_gpus, recommend
    from .errors import InputError, MemplanError, UnknownKeywordError
    from .request import ClusterRequest, ModelRequest, Request, StrategyRequest, TrainingRequest
    from .specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
    from .strategies import STRATEGIES
    from .version import __version__
finally:
    if _collecting:
        gc.enable()

# numpy, pandas and matplotlib load only when these are used
_LAZY = {
    "sweep": ("grid", "sweep"),
    "plot_breakdown": ("plot", "plot_breakdown"),
    "plot_fits": ("plot", "plot_fits"),
    "plot_calibration": ("plot", "plot_calibration"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'memplan' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)


__all__ = [
    "STRATEGIES",
    "ClusterRequest",
    "ClusterSpec",
    "InputError",
    "Job",
    "MemplanError",
    "ModelRequest",
    "ModelSpec",
    "Plan",
    "Request",
    "Result",
    "StrategyRequest",
    "TrainSpec",
    "TrainingRequest",
    "UnknownKeywordError",
    "__version__",
    "estimate",
    "from_module",
    "min_gpus",
    "plot_breakdown",
    "plot_calibration",
    "plot_fits",
    "recommend",
    "sweep",
]
