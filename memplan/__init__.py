"""memplan: per-GPU memory planner and distributed-strategy recommender for PyTorch training."""
from .errors import MemplanError
from .specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from .strategies import STRATEGIES

__all__ = ["MemplanError", "ClusterSpec", "Job", "ModelSpec", "Plan", "TrainSpec", "STRATEGIES"]
