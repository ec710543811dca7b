"""DeepSpeed ZeRO stages 1-3: its bf16 / fp16 optimizer, gather and reduce buckets, and
the config that sets the bucket sizes the memory model charges (tables/deepspeed.csv)."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from functools import cache, lru_cache
from typing import Any, ClassVar

from .. import moe
from ..breakdown import Component, term
from ..catalog import deepspeed_defaults
from ..errors import MemplanError
from ..mla import attention_tensors
from ..precision import POLICIES
from ..specs import ZeroConfig
from .base import Emitter, Framework, needs

B = Component.BUFFERS
ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}


def zero_config(job) -> ZeroConfig:
    """The job's ``zero_optimization`` settings with Hugging Face's ``"auto"`` values resolved from
    the model; the ones ``--emit deepspeed`` writes (tables/deepspeed.csv) where the job has none."""
    if job.plan.zero is not None:
        return _resolved(job.plan.zero, job.model.hidden)
    return _default_zero()


@cache
def _default_zero() -> ZeroConfig:
    """``zero_config`` where the job has none, built once (the step reads it many times)."""
    ds: dict[str, Any] = deepspeed_defaults()
    return ZeroConfig(**{f.name: ds[f.name] for f in fields(ZeroConfig) if f.name in ds})


@lru_cache(maxsize=256)
def _resolved(zero: ZeroConfig, hidden: int) -> ZeroConfig:
    return zero.resolved(hidden)


def config(job, strategy) -> dict:
    """A DeepSpeed config whose bucket sizes are the ones the memory model charges."""
    needs(job, "deepspeed", tuple(ZERO_STAGE))
    policy = POLICIES[job.train.precision]
    if policy.id not in DeepSpeed.native_precisions:
        raise MemplanError(
            lambda n: (
                f"{n('emit')} deepspeed needs {n('precision')} "
                f"{', '.join(DeepSpeed.native_precisions[1:])} or {DeepSpeed.native_precisions[0]}, got {policy.id}"
            )
        )
    z = zero_config(job)
    stage = ZERO_STAGE[strategy.id]
    zero: dict[str, object] = {
        "stage": stage,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": z.allgather_bucket_size,
    }
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size,
            stage3_max_live_parameters=deepspeed_defaults()["stage3_max_live_parameters"],
            stage3_param_persistence_threshold=z.stage3_param_persistence_threshold,
        )
    if job.plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if job.plan.offload in ("params", "all"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    t = job.train
    # bf16 / fp16 modes keep fp32 master weights: they are mixed-*, never autocast
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * job.cluster.gpus,
        "bf16": {"enabled": policy.master and policy.compute_dtype == "bf16"},
        "fp16": {"enabled": policy.master and policy.compute_dtype == "fp16"},
        "zero_optimization": zero,
    }
    if t.activation_checkpointing != "none":
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return config


@lru_cache(maxsize=256)
def _persistent_numel(model, threshold: int) -> int:
    """Elements of the model's tensors of at most ``threshold`` elements (counted once per model)."""
    return sum(n for n in tensor_numels(model) if n <= threshold)


def tensor_numels(model) -> list[int]:
    """Elements of each parameter tensor of the Hugging Face model of the spec's shapes
    (modeling_llama.py, modeling_vit.py, modeling_bert.py: q, k, v apart; modeling_gpt2.py,
    modeling_gpt_neox.py: fused)."""
    h, q, kv, f, bias = model.hidden, model.q_hidden, model.kv_hidden, model.ffn_hidden, model.linear_bias
    apart = model.arch in ("llama", "vit", "bert")
    attn = [h * q, h * kv, h * kv] if apart else [h * (q + 2 * kv)]
    attn_bias = ([q, kv, kv] if apart else [q + 2 * kv]) if model.qkv_bias or bias else []
    mlp = [h * f, h * f, f * h] if model.gated_mlp else [h * f, f * h]
    mlp_bias = ([f, f, h] if model.gated_mlp else [f, h]) if bias else []
    norm = [h] if model.arch == "llama" else [h, h]
    qk_norm = [model.head_size] * 2 if model.qk_norm else []  # Qwen3's q_norm, k_norm
    attention = attn + attn_bias + [q * h] + ([h] if bias else []) + qk_norm
    if model.mla:  # DeepseekV3Attention's projections and latent norms (memplan.mla)
        attention = [math.prod(t) for t in attention_tensors(model)]
    block = attention + mlp + mlp_bias + 2 * norm
    if model.arch == "vit":  # patch conv (+ bias), class token, positions; classifier (+ bias)
        root = [model.image_channels * model.patch_size**2 * h, h, h, model.max_positions * h]
        return block * model.num_layers + root + norm + [h * model.vocab_size, model.vocab_size]
    if model.arch == "bert":  # word, position, token type, LayerNorm; MLM transform + bias | pooler + classifier
        root = [model.vocab_size * h, model.max_positions * h, model.type_vocab_size * h, *norm]
        L = model.num_labels
        head = [h * h, h, L * h, L] if L else [h * h, h, *norm, model.vocab_size]
        untied = [] if L or model.tied_embeddings else [model.vocab_size * h]
        return block * model.num_layers + root + head + untied
    positions = [model.max_positions * h] if model.max_positions else []
    head = [] if model.tied_embeddings else [model.vocab_size * h]
    blocks = block * model.num_layers
    if model.num_experts:  # a sparse block's MLP: the router and the experts' two 3-D tensors
        w = moe.expert_width(model)
        sparse = attention + 2 * norm + [model.num_experts * h]
        sparse += [model.num_experts * 2 * w * h, model.num_experts * h * w]
        if model.shared_ffn_hidden:  # Qwen2-MoE's shared expert (gate, up, down) and its h → 1 gate
            sparse += [h * model.shared_ffn_hidden] * 3 + ([h] if model.shared_expert_gate else [])
        layers = moe.num_moe_layers(model)
        blocks = block * (model.num_layers - layers) + sparse * layers
    return blocks + [model.vocab_size * h, *positions, *norm, *head]


def config_json(job, strategy) -> str:
    return json.dumps(config(job, strategy), indent=2) + "\n"


class DeepSpeed(Framework):
    id = "deepspeed"
    label = "DeepSpeed"
    # its bf16 / fp16 optimizer modes keep master weights; torch.autocast is not a DeepSpeed
    # precision mode, and `--emit deepspeed` writes only these
    native_precisions = ("fp32", "mixed-bf16", "mixed-fp16")
    emitters: ClassVar[dict[str, Emitter]] = {"deepspeed": config_json}
    # a tied embedding's summed gradients are not measured under its buckets
    sums_tied_grads = False
    # stage_1_and_2.py single_partition_of_fp32_groups, stage3.py fp32_partitioned_groups_flat:
    # the client optimizer's param groups are the flat fp32 partitions
    steps_flat_partition = True

    def grads_held(self, step) -> bool:
        # stage3.py (line 791): grad_partitions_flat_buffer, every gradient partition, allocated at init
        return step.strategy.shards_params and not step.grads_on_host

    def grads_at_step(self, step) -> bool:
        # stage_1_and_2.py step (0.19.8, line 3120): with bf16 / fp16 master weights and no offload the
        # gradient partition is copied to fp32 (step_buffers) and every bit16 gradient freed
        # (free_grad_in_param_list, averaged_gradients = None) before _optimizer_step (measured:
        # validation.dsconfig's user-bucket ZeRO-1/2 cases peak in the step); in fp32 the copy is the tensor
        return step.strategy.shards_params or not step.policy.master or step.states_on_host

    def grads_on_host(self, step) -> bool:
        # stage3.py (line 333): with offload_optimizer that buffer is allocated on the host
        return step.strategy.shards_params and step.states_on_host

    def host_buffers(self, step) -> list:
        """With offload_optimizer (measured: the offload cases' host bytes, found on the engine)."""
        if not step.states_on_host:
            return []
        sharded, div = step.local(step.params, True), step.div(True)
        # stage_1_and_2.py initialize_optimizer_states (line 937), stage3.py (line 1342): the fp32
        # gradient partition the host optimizer steps with
        terms = [term(B, "deepspeed.host_fp32_grads", "fp32 gradient partition (host)", f"4·P{div}", 4 * sharded)]
        if not step.policy.master:
            # stage_1_and_2.py (line 560), stage3.py (line 1160): offloaded, the fp32 partition is a copy
            terms.append(self._fp32_partition_clone(step))
        if not step.strategy.shards_params:
            nbytes, largest = step.gather_bytes, step.largest_param()
            terms += [
                # stage_1_and_2.py (line 567): the low-precision copy of the partition written back to the device
                term(
                    B,
                    "deepspeed.host_bit16_partition",
                    "bit16 partition copy-back buffer",
                    f"{nbytes}·P{div}",
                    nbytes * sharded,
                ),
                # stage_1_and_2.py (line 653): temp_grad_buffer_for_cpu_offload, one largest parameter
                term(
                    B,
                    "deepspeed.host_grad_staging",
                    "gradient staging buffer",
                    f"{nbytes}·largest tensor",
                    nbytes * largest,
                ),
            ]
        return terms

    def persistent_buffers(self, step) -> list:
        terms = []
        if step.strategy.shards_params:
            # stage3.py DeepSpeedZeroOptimizer_Stage3.__init__ (0.19.8, line 780): with
            # contiguous_gradients the ipg bucket is allocated once, at reduce_bucket_size elements,
            # and held (measured: ZeRO-3's forward peak)
            if zero_config(step.job).contiguous_gradients:
                terms.append(self._ipg_buckets(step, 1))
            terms += self._persistent_params(step)
        if not step.policy.master and not step.states_on_host and not step.strategy.shards_params:
            # stage_1_and_2.py (line 560): the fp32 master partition is a clone even when the
            # parameters are fp32 (stage3.py line 1162 shares the flat fp32 partition instead)
            terms.append(self._fp32_partition_clone(step))
        return terms

    def _fp32_partition_clone(self, step):
        return term(
            B,
            "deepspeed.fp32_partition",
            "fp32 partition (cloned from fp32 parameters)",
            f"4·P{step.div(True)}",
            4 * step.local(step.params, True),
        )

    def _persistent_params(self, step) -> list:
        """parameter_offload.py mark_persistent_parameters: a tensor of at most
        stage3_param_persistence_threshold elements stays gathered on every rank."""
        # measured: they stay on the device with offload_param too
        threshold = zero_config(step.job).stage3_param_persistence_threshold
        count = self._persistent_count(step)
        return [
            term(
                B,
                "zero3.persistent_params",
                f"persistent parameters (tensors of ≤ {threshold:.0e} elements, gathered)",
                f"{step.gather_bytes}·{count:,}",
                step.gather_bytes * count,
            )
        ]

    def _persistent_count(self, step) -> int:
        threshold = int(zero_config(step.job).stage3_param_persistence_threshold)  # resolved: no "auto"
        return _persistent_numel(step.job.model, threshold)

    def _reuse_kept(self, step) -> int:
        """Parameters still gathered from forward when backward starts: partitioned_param_coordinator.py
        __params_to_release (0.19.8, line 634) keeps a module's parameters once the trace is complete
        if the module is used again within stage3_max_reuse_distance elements of traversal; at the
        forward → backward turn a module is reused after twice the parameters that follow it in
        forward (measured: the user-config ZeRO-3 cases, whole model gathered at these shapes)."""
        reuse, m = deepspeed_defaults()["stage3_max_reuse_distance"], step.job.model
        head = m.vocab_size * m.hidden  # the head (or the tied embedding), used last
        rest = max(0, step.root_params - head - m.hidden)  # an untied input embedding, positions
        kept = after = 0
        for numel in [head, m.hidden] + [step.block_params] * m.num_layers + [rest]:
            if 2 * after >= reuse:
                break
            kept, after = kept + numel, after + numel
        return kept

    def _ipg_buckets(self, step, count: int):
        """``count`` ipg buckets of reduce_bucket_size elements in the compute dtype (``self.dtype``)."""
        bucket, nbytes = zero_config(step.job).reduce_bucket_size, step.gather_bytes
        return term(
            B,
            "zero.ipg_bucket",
            "ipg reduce bucket" + ("s (overlap_comm double-buffers)" if count > 1 else ""),
            f"{count}·{nbytes}·reduce_bucket_size ({bucket:.0e})",
            count * nbytes * bucket,
        )

    def gathered(self, step, instant: str) -> list:
        zero, bp = zero_config(step.job), step.block_params
        terms = []
        if step.strategy.shards_params:
            prefetch = min(zero.stage3_prefetch_bucket_size, bp)
            gathered = bp + prefetch
            if instant == "loss":  # the root's unit, or what forward left gathered (_reuse_kept), at most all
                gatherable = step.params - self._persistent_count(step)
                gathered = min(gatherable, max(bp, step.root_params, self._reuse_kept(step)) + prefetch)
            terms.append(
                term(
                    B,
                    "zero3.gathered",
                    "gathered unit + prefetch bucket (ZeRO-3)",
                    f"{step.gather_bytes}·{gathered:,}",
                    step.gather_bytes * gathered,
                )
            )
        elif instant not in ("start", "forward", "loss") and zero.contiguous_gradients:
            # stage_1_and_2.py setup_buckets (line 3256), called by the first gradient's hook (not yet at
            # the loss: measured, the user-bucket ZeRO-1 case peaks there without them) and released by
            # the backward epilogue: with contiguous_gradients buf_0, and buf_1 when overlap_comm
            terms.append(self._ipg_buckets(step, 1 + zero.overlap_comm))
        return terms

    def step_buffers(self, step) -> list:
        if not step.policy.master:
            return []
        # stage_1_and_2.py: reduced bf16 gradients are copied into an fp32 partition for the step
        sharded = step.strategy.shards_optimizer
        return [
            term(
                B,
                "deepspeed.fp32_grad_partition",
                "fp32 gradient partition",
                f"4·P{step.div(sharded)}",
                4 * step.local(step.params, sharded),
            )
        ]

    def accelerate(self, job, strategy) -> dict:
        offload = job.plan.offload
        return {
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "zero_stage": ZERO_STAGE[strategy.id],
                "gradient_accumulation_steps": job.train.grad_accum,
                "offload_optimizer_device": "cpu" if offload in ("optimizer", "all") else "none",
                "offload_param_device": "cpu" if offload in ("params", "all") else "none",
                "zero3_init_flag": strategy.id == "zero3",
            },
        }
