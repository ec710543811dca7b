"""Each distributed strategy written down once, as data: what it shards, over which
group, and which framework's buffers it holds. Adding a strategy is adding a row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Strategy:
    id: str
    framework: str
    """none | ddp | fsdp | deepspeed: the adapter (``memplan.frameworks.adapter``) that says whose
    buffers (DDP buckets, FSDP all-gather and reduce-scatter buffers, DeepSpeed buckets) the
    step holds, which precisions run natively and how the job is emitted."""
    shards_params: bool
    shards_grads: bool
    shards_optimizer: bool
    shard_group: str = "world"
    """world: shard over every GPU; node: over the GPUs of one node (hybrid)."""
    reshard_after_forward: bool = True
    """FSDP/ZeRO-3: free the gathered parameters of a unit after its forward."""
    offloads: tuple[str, ...] = ()
    max_gpus: int | None = None
    label: str = ""

    def shard_degree(self, gpus: int, gpus_per_node: int) -> int:
        return gpus_per_node if self.shard_group == "node" else gpus

    def allows_gpus(self, gpus: int) -> bool:
        return self.max_gpus is None or gpus <= self.max_gpus

    def supports_offload(self, offload: str) -> bool:
        return offload == "none" or offload in self.offloads

    def offload_hint(self) -> str:
        users = [s.id for s in STRATEGIES.values() if s.offloads]
        return f"one of {', '.join(users)} (this one allows {', '.join(self.offloads) or 'none'})"


_ROWS = (
    # a plain training loop on one GPU: no wrapper, so no buckets or gather buffers (torchtune's
    # single-device recipes, a bare HF Trainer); DDP even at one GPU allocates its buckets (measured)
    Strategy(
        id="single",
        framework="none",
        shards_params=False,
        shards_grads=False,
        shards_optimizer=False,
        max_gpus=1,
        label="one GPU, no wrapper",
    ),
    Strategy(
        id="ddp",
        framework="ddp",
        shards_params=False,
        shards_grads=False,
        shards_optimizer=False,
        label="DistributedDataParallel",
    ),
    Strategy(
        id="fsdp-no-shard",
        framework="fsdp",
        shards_params=False,
        shards_grads=False,
        shards_optimizer=False,
        label="FSDP NO_SHARD",
    ),
    Strategy(
        id="fsdp-shard-grad-op",
        framework="fsdp",
        shards_params=True,
        shards_grads=True,
        shards_optimizer=True,
        reshard_after_forward=False,
        offloads=("params", "all"),
        label="FSDP SHARD_GRAD_OP / fully_shard(reshard_after_forward=False)",
    ),
    Strategy(
        id="fsdp-full-shard",
        framework="fsdp",
        shards_params=True,
        shards_grads=True,
        shards_optimizer=True,
        offloads=("params", "all"),
        label="FSDP FULL_SHARD / fully_shard",
    ),
    Strategy(
        id="fsdp-hybrid-shard",
        framework="fsdp",
        shards_params=True,
        shards_grads=True,
        shards_optimizer=True,
        shard_group="node",
        offloads=("params", "all"),
        label="FSDP HYBRID_SHARD / fully_shard on a 2-D mesh",
    ),
    Strategy(
        id="zero1",
        framework="deepspeed",
        shards_params=False,
        shards_grads=False,
        shards_optimizer=True,
        offloads=("optimizer",),
        label="DeepSpeed ZeRO stage 1",
    ),
    Strategy(
        id="zero2",
        framework="deepspeed",
        shards_params=False,
        shards_grads=True,
        shards_optimizer=True,
        offloads=("optimizer",),
        label="DeepSpeed ZeRO stage 2",
    ),
    Strategy(
        id="zero3",
        framework="deepspeed",
        shards_params=True,
        shards_grads=True,
        shards_optimizer=True,
        offloads=("optimizer", "params", "all"),
        label="DeepSpeed ZeRO stage 3",
    ),
)

STRATEGIES: dict[str, Strategy] = {s.id: s for s in _ROWS}


def strategies_on(gpus: int) -> list[str]:
    """The strategy ids that can run on ``gpus`` GPUs."""
    return [s.id for s in STRATEGIES.values() if s.allows_gpus(gpus)]
