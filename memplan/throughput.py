"""Step time of one configuration: compute from FLOPs, exposed communication from the bytes
each strategy moves, and offload traffic over the host link. Pure functions; the constants
are rows of tables/throughput.csv and tables/interconnects.csv.

Known limitations: no collective latency term, no kernel efficiency below the MFU default,
no async TP or pipeline overlap of the model-parallel traffic; the documented penalties in tables/rules.csv are compared
with these numbers, not fed into them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from . import catalog
from .errors import MemplanError
from .finetune import nf4_bytes_per_param, trained
from .frameworks import adapter
from .mla import attention_flops_per_token
from .moe import active_params, fsdp_traffic_params, num_moe_layers, routed_rows
from .precision import POLICIES
from .specs import Job
from .strategies import STRATEGIES

_GBS = 10**9


@cache
def defaults() -> dict[str, str]:
    return {row["key"]: row["value"] for row in catalog.read_table("throughput.csv")}


def default(key: str) -> float:
    return float(defaults()[key])


@cache
def interconnects() -> dict[str, float | None]:
    return {
        row["name"]: float(row["bus_bw_gbs"]) * _GBS if row["bus_bw_gbs"] else None
        for row in catalog.read_table("interconnects.csv")
    }


@dataclass(frozen=True, kw_only=True)
class Link:
    """The bandwidths a step uses, per direction (what a ring collective runs at)."""

    intra_node_bytes_s: float
    inter_node_bytes_s: float
    host_bytes_s: float
    """GPU <-> host (PCIe), per direction."""
    host_dram_bytes_s: float
    """Host memory bandwidth available to one GPU's CPU optimizer step."""
    gpu: catalog.GpuSpec
    """Peak FLOPS per precision come from here (each option has its own precision)."""
    gpu_name: str
    assumed_gpu: bool
    interconnect: str


def link_for(job: Job, *, interconnect: str | None = None, bw_gbs: float | None = None) -> Link:
    """The GPU's datasheet figures and the fabric between nodes (``interconnect`` or ``bw_gbs``).

    ``bw_gbs`` (GB/s per direction) replaces the slowest link the job uses: the inter-node
    fabric on several nodes, the GPU-to-GPU link on one.
    """
    cluster = job.cluster
    assumed = cluster.gpu_name == "custom"
    gpu = catalog.gpu(defaults()["default_gpu"] if assumed else cluster.gpu_name)
    table = interconnects()
    if interconnect is not None and interconnect not in table:
        raise MemplanError(f"interconnect {interconnect!r} is not one of: {', '.join(table)}")
    if bw_gbs is not None and not (isinstance(bw_gbs, (int, float)) and 0 < bw_gbs < 1e6):
        raise MemplanError(f"bw must be a positive number of GB/s below 1e6, got {bw_gbs!r}")
    nvlink = gpu.intra_node_bw_bytes_s / 2  # datasheets give both directions together
    multi_node = cluster.num_nodes > 1
    fabric = interconnect or ("infiniband" if multi_node else "nvlink" if gpu.interconnect == "nvlink" else "pcie")

    def listed_or_nvlink(name: str) -> float:
        bw = table[name]
        return nvlink if bw is None else bw

    fabric_bw = listed_or_nvlink(fabric)
    intra = nvlink if gpu.interconnect == "nvlink" else listed_or_nvlink("pcie")
    inter = fabric_bw
    if not multi_node and interconnect is not None:
        intra = fabric_bw
    if bw_gbs is not None:
        if multi_node:
            inter = bw_gbs * _GBS
        else:
            intra = bw_gbs * _GBS
    return Link(
        intra_node_bytes_s=intra,
        inter_node_bytes_s=min(inter, intra) if multi_node else intra,
        host_bytes_s=gpu.host_link_bw_bytes_s / 2,
        host_dram_bytes_s=default("host_dram_bw_gbs") * _GBS / cluster.gpus_per_node,
        gpu=gpu,
        gpu_name=gpu.name,
        assumed_gpu=assumed,
        interconnect=fabric if bw_gbs is None else f"{bw_gbs:g} GB/s",
    )


def flops_per_token(job: Job) -> float:
    """Training FLOPs per token, recompute included.

    PaLM (Chowdhery et al. 2022, Appendix B): 6·N + 12·L·H·Q·T per token, where the 12·L·h·s
    term is the attention score and value matmuls (forward 4·L·h·s, backward twice that).
    Activation checkpointing re-runs forward work in backward (Korthikanti et al. 2022,
    'Reducing Activation Recomputation', §4): full AC one whole forward, 2·N + 4·L·h·s;
    selective only the attention core, 4·L·h·s; torchtitan's op SAC every second matmul of
    a block (its policy saves mm 1, 3, 5, ... and sdpa), about half the matmul forward, N.
    """
    m, s = job.model, job.train.seq_len
    # an MoE token runs through its top-k experts only: N counts the active parameters
    n = active_params(m)
    attention_fwd = 4 * m.num_layers * m.q_hidden * s  # q·kᵀ and probs·v over a·d, hidden unless set apart
    if m.mla:  # q·kᵀ over a·(qk_nope + qk_rope), probs·v over a·v_head_dim (memplan.mla)
        attention_fwd = m.num_layers * attention_flops_per_token(m, s)
    recompute = {"none": 0.0, "selective": attention_fwd, "op": n, "full": 2 * n + attention_fwd}[
        job.train.activation_checkpointing
    ]
    tuning = job.train.tuning
    if tuning.mode == "full":
        return 6 * n + 3 * attention_fwd + recompute
    t = trained(m, tuning)
    if tuning.adapters:
        # 6·N = 2·N forward + 4·N backward, the backward half input gradients, half weight
        # gradients (Narayanan et al. 2021, §3.4: each matmul's backward is two of its size);
        # a frozen weight needs only the input gradient, which flows through every block down to
        # the first adapter: 4·N_frozen; the adapters (lora_A, lora_B) train in full: 6·N_adapters
        return 4 * n + 6 * t.trainable + 3 * attention_fwd + recompute
    # frozen:N: nothing below block N needs a gradient, so the input embedding and the first N
    # blocks run forward only (2·N_frozen and their attention's forward); the rest trains in full
    frozen_share = tuning.frozen_blocks / m.num_layers
    trained_attention = attention_fwd * (1 - frozen_share)
    return (
        2 * t.frozen
        + 6 * t.trainable
        + attention_fwd * frozen_share
        + 3 * trained_attention
        + recompute * (1 - frozen_share)
    )


def dequant_seconds(job: Job, link: Link) -> float:
    """QLoRA's dequantization per step: bitsandbytes' MatMul4Bit dequantizes every NF4 weight to
    the compute dtype in forward and again in backward (autograd/_functions.py MatMul4Bit.forward
    and .backward: F.dequantize_4bit), a memory-bound pass reading the NF4 codes and scales and
    writing a 2-byte weight, at the GPU's peak memory bandwidth (an optimistic floor)."""
    tuning = job.train.tuning
    if tuning.mode != "qlora":
        return 0.0
    calls = 2 * job.train.grad_accum * job.layout.microbatches
    nbytes = trained(job.model, tuning).quantized * (nf4_bytes_per_param(tuning.double_quant) + 2)
    return calls * nbytes / link.gpu.memory_bw_bytes_s / job.layout.model_parallel


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds of one optimizer step on one GPU, by cause."""

    compute_s: float
    comm_s: float
    """All collective traffic, before overlap."""
    exposed_comm_s: float
    offload_s: float
    """Host-link traffic and the CPU optimizer step, not hidden."""
    tokens_per_step: int
    """Tokens one GPU processes per optimizer step."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def _ring(n: int) -> float:
    """Bytes a rank sends per byte of an all-gather or reduce-scatter over n ranks: (n-1)/n
    (Patarasuk & Yuan 2009, bandwidth-optimal ring); an all-reduce is both, 2·(n-1)/n."""
    return (n - 1) / n


def comm_seconds(job: Job, link: Link) -> float:
    """Collective traffic of one optimizer step (gradients reduced once per step: no_sync on
    all but the last micro-batch; parameters gathered on every micro-batch when sharded).

    DDP / FSDP NO_SHARD: all-reduce of the gradients, 2·(n-1)/n·G.
    ZeRO-1/2: reduce-scatter of gradients + all-gather of updated parameters, (n-1)/n·(G + W)
    (Rajbhandari et al. 2020, ZeRO §7: 'same communication volume as data parallelism').
    FULL_SHARD / ZeRO-3: all-gather in forward and again in backward, reduce-scatter of grads,
    (n-1)/n·(2·W + G) (ZeRO §7.2.2: 1.5x data parallelism). SHARD_GRAD_OP: one all-gather.
    HYBRID_SHARD: FULL_SHARD inside the node, then an all-reduce of each 1/k shard across nodes.
    """
    strategy = STRATEGIES[job.plan.strategy]
    policy = POLICIES[job.train.precision]
    # under a layout the strategy runs over dp × cp ranks, each holding 1/(tp·pp) of the parameters
    layout = job.layout
    p: float = job.model.num_params // (layout.tp * layout.pp)
    n = job.dp * layout.cp
    if job.plan.ep > 1:  # the experts are gathered and reduced among the n/ep ranks holding them
        p = fsdp_traffic_params(job.model, job.plan.ep, n)
    reduce_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}.get(job.train.reduce_dtype or "", policy.grad_bytes)
    grads, weights = p * reduce_bytes, p * policy.param_bytes
    micro = job.train.grad_accum * layout.microbatches
    slow = link.inter_node_bytes_s if job.cluster.num_nodes > 1 else link.intra_node_bytes_s
    if n == 1:
        return 0.0
    k = max(1, job.cluster.gpus_per_node // layout.tp)
    group = job.post_forward_group
    if group:
        # fully_shard(reshard_after_forward=N): the backward's all-gather runs over the N ranks
        # holding the post-forward copies (torch 2.13 _fsdp_param.py to_sharded_post_forward),
        # within a node where N fits in one; the forward's over all n
        backward = _ring(group) * weights * micro / (link.intra_node_bytes_s if group <= k else slow)
        forward = _ring(n) * (weights * micro + grads) / slow
        return forward + backward + ep_seconds(job, link)
    # one FSDP unit (--fsdp-wrap none) gathers once: the root is never resharded after forward
    gathers = 1 if job.one_fsdp_unit or not strategy.reshard_after_forward else 2
    return _dp_seconds(n, k, link, strategy, grads, weights, micro, slow, gathers) + ep_seconds(job, link)


def ep_seconds(job: Job, link: Link) -> float:
    """Expert parallelism's all-to-alls: each sparse layer dispatches its k·T routed rows and
    combines them back, forward and again in backward (4 exchanges of k·T·h in the compute
    dtype per micro-batch; torchtitan's AllToAllTokenDispatcher), (ep-1)/ep of them leaving
    the rank; within a node while the EP group fits in one."""
    ep = job.plan.ep
    if ep == 1:
        return 0.0
    m, train = job.model, job.train
    rows = routed_rows(train.seq_len * train.micro_batch, m, ep)
    volume = 4 * num_moe_layers(m) * rows * m.hidden * POLICIES[train.precision].compute_bytes * train.grad_accum
    bw = link.intra_node_bytes_s if ep <= job.cluster.gpus_per_node else link.inter_node_bytes_s
    return volume * (ep - 1) / ep / bw


def _dp_seconds(
    n: int, k: int, link: Link, strategy, grads: float, weights: float, micro: int, slow: float, gathers: int
) -> float:
    """Seconds of the data-parallel traffic over ``n`` ranks, ``k`` of them in a node; ``gathers``:
    the parameters' all-gathers per micro-batch under a sharded strategy."""
    if strategy.shard_group == "node":
        m = n // k
        intra = _ring(k) * (gathers * weights * micro + grads) / link.intra_node_bytes_s
        inter = 2 * _ring(m) * grads / k / link.inter_node_bytes_s if m > 1 else 0.0
        return intra + inter
    if strategy.shards_params:
        return _ring(n) * (gathers * weights * micro + grads) / slow
    if strategy.shards_optimizer:
        return _ring(n) * (grads + weights) / slow
    return 2 * _ring(n) * grads / slow


def offload_seconds(job: Job, link: Link) -> float:
    """Host traffic: offloaded optimizer (gradient shard down, updated parameter shard up, and
    the CPU AdamW step at host memory bandwidth) and offloaded parameters (the shard copied
    up for each forward and backward of every micro-batch) over PCIe (ZeRO-Offload §4)."""
    offload = job.plan.offload
    if offload == "none":
        return 0.0
    strategy = STRATEGIES[job.plan.strategy]
    policy = POLICIES[job.train.precision]
    shard = job.model.num_params / strategy.shard_degree(job.cluster.gpus, job.cluster.gpus_per_node)
    seconds = 0.0
    if offload in ("optimizer", "all") or (adapter(strategy).offload_moves_states and offload == "params"):
        # FSDP CPUOffload(offload_params=True) also steps the optimizer on the CPU.
        seconds += shard * (policy.grad_bytes + policy.param_bytes) / link.host_bytes_s
        seconds += shard * default("host_adam_bytes_per_param") / link.host_dram_bytes_s
    if offload in ("params", "all"):
        seconds += 2 * job.train.grad_accum * shard * policy.param_bytes / link.host_bytes_s
    return seconds


def step_time(
    job: Job,
    link: Link,
    *,
    mfu: float | None = None,
    overlap: float | None = None,
    achieved_flops: float | None = None,
    exposed_fraction: float | None = None,
) -> StepTime:
    """Compute over peak × MFU (or over a measured ``achieved_flops``); communication hidden up
    to ``overlap`` × compute, or a measured ``exposed_fraction`` of it left exposed."""
    layout = job.layout
    # one model replica's tokens, its FLOPs split over the tp·cp·pp GPUs it spans
    tokens = job.train.seq_len * job.train.micro_batch * job.train.grad_accum * layout.microbatches
    if achieved_flops is None:
        mfu = default("mfu") if mfu is None else mfu
        achieved_flops = link.gpu.peak_flops(job.train.precision) * mfu
    compute = tokens * flops_per_token(job) / achieved_flops / layout.model_parallel * (1 + bubble_fraction(job))
    compute += dequant_seconds(job, link)
    comm = comm_seconds(job, link)
    if exposed_fraction is None:
        overlap = default("overlap_fraction") if overlap is None else overlap
        # one FSDP unit hides nothing: its all-gather precedes the forward, its reduce-scatter follows the backward
        exposed = comm if job.one_fsdp_unit else max(0.0, comm - overlap * compute)
    else:
        exposed = exposed_fraction * comm
    return StepTime(
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=exposed + model_parallel_seconds(job, link),
        offload_s=offload_seconds(job, link),
        tokens_per_step=tokens // layout.model_parallel,
    )


def bubble_fraction(job: Job) -> float:
    """Idle time of a pipeline over its compute: (pp − 1)/(M·V) for GPipe, 1F1B and interleaved
    1F1B (Narayanan et al. 2021, Megatron-LM §2.2: interleaving divides the bubble by V);
    the zero-bubble schedule leaves a fraction of that (tables/throughput.csv)."""
    layout = job.layout
    if layout.pp == 1:
        return 0.0
    bubble = (layout.pp - 1) / (layout.microbatches * layout.pp_virtual)
    return bubble * default("zero_bubble_ratio") if layout.pp_schedule == "zero-bubble" else bubble


def model_parallel_seconds(job: Job, link: Link) -> float:
    """Exposed seconds of the model-parallel traffic of one step (none without a layout).

    TP: per layer and micro-batch, forward and backward each run two all-gathers and two
    reduce-scatters of the b·s·h stream under SP (two all-reduces without: the same bytes),
    (tp−1)/tp·b·s·h·c each, on the link within the node (Korthikanti et al. 2022 §4.2.2), not
    overlapped (async TP is not modelled). CP: ring attention passes K and V round the cp ranks
    in forward, K, V and their gradients in backward, (cp−1)·b·(s/cp)·2·kv·c per pass (torch's
    ``_templated_ring_attention``), hidden behind attention up to ``overlap_fraction``. PP: each
    stage boundary sends the stream forward and its gradient back per micro-batch."""
    layout = job.layout
    if layout.is_data_parallel:
        return 0.0
    m, t = job.model, job.train
    c = POLICIES[t.precision].compute_bytes
    micro = t.grad_accum * layout.microbatches
    stream = t.micro_batch * t.seq_len * m.hidden * c // layout.cp
    layers = m.num_layers / layout.pp
    intra = link.intra_node_bytes_s
    across = link.inter_node_bytes_s if job.cluster.num_nodes > 1 else intra
    tp = 8 * _ring(layout.tp) * stream * layers * micro / (intra if layout.tp <= job.cluster.gpus_per_node else across)
    kv = t.micro_batch * (t.seq_len // layout.cp) * 2 * m.kv_hidden * c
    cp = 3 * (layout.cp - 1) * kv * layers * micro / across * (1 - default("overlap_fraction"))
    pp = 2 * micro * stream / layout.tp * (layout.pp > 1) / across
    return tp + cp + pp


def relative_to_ddp(job: Job, timer: Callable[[Job], StepTime]) -> float:
    """Tokens/s of ``job`` over tokens/s of DDP at the same settings without offload (whether or
    not DDP fits: the seeds' penalties are 'relative to DDP' in the same sense), both timed by
    ``timer`` (``step_time`` on a link, calibrated or not)."""
    ddp = job.with_(offload="none", strategy="ddp")
    return timer(job).tokens_per_s / timer(ddp).tokens_per_s
