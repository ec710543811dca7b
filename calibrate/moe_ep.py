"""Mixture-of-experts models for the harness: transformers' MoE configs from a ModelSpec, and
expert parallelism on real gloo ranks.

torchtitan 0.3.0's own MoE and ``ExpertParallel`` are DTensor / grouped-mm code written for
CUDA meshes; what decides EP's memory is reproduced here on transformers' experts instead
(the ground truth of validation/records/moe_matrix_cpu.jsonl's EP cases): each rank keeps E/ep experts'
slices of ``gate_up_proj`` / ``down_proj``, and the experts' forward becomes torchtitan's
``AllToAllTokenDispatcher`` (models/common/token_dispatcher.py): sort the k·T routed copies
by expert, exchange the per-expert counts, ``all_to_all_single`` (autograd) the rows to the
experts' ranks, run the local experts as transformers' eager loop does, send the rows back,
weight them in fp32 and scatter-add them per token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from memplan.specs import ModelSpec

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def hf_moe_kwargs(spec: ModelSpec, hf_type: str) -> dict:
    """The transformers config keys of the spec's experts, eager experts (the loop the
    transformers implementation calls ``eager``; its default on CPU is ``grouped_mm``)."""
    keys: dict[str, Any]
    if hf_type == "mixtral":
        keys = {"num_local_experts": spec.num_experts, "intermediate_size": spec.moe_ffn_hidden or spec.ffn_hidden}
    elif hf_type == "qwen2_moe":
        keys = {
            "num_experts": spec.num_experts,
            "moe_intermediate_size": spec.moe_ffn_hidden or spec.ffn_hidden,
            "shared_expert_intermediate_size": spec.shared_ffn_hidden,
            "decoder_sparse_step": spec.moe_every,
            "mlp_only_layers": [],
            "norm_topk_prob": spec.normalize_top_k,
        }
    elif hf_type == "qwen3_moe":  # Qwen3MoeSparseMoeBlock: routed experts only, no shared expert
        keys = {
            "num_experts": spec.num_experts,
            "moe_intermediate_size": spec.moe_ffn_hidden or spec.ffn_hidden,
            "decoder_sparse_step": spec.moe_every,
            "mlp_only_layers": [],
            "norm_topk_prob": spec.normalize_top_k,
        }
    elif hf_type == "deepseek_v3":  # DeepseekV3MoE: sigmoid router, shared experts as one MLP, dense first layers
        width = spec.moe_ffn_hidden or spec.ffn_hidden
        if spec.shared_ffn_hidden % width or spec.moe_every != 1:
            raise ValueError("deepseek_v3 holds n_shared_experts × moe_intermediate_size and no layer step")
        keys = {
            "n_routed_experts": spec.num_experts,
            "moe_intermediate_size": width,
            "n_shared_experts": spec.shared_ffn_hidden // width,
            "first_k_dense_replace": spec.first_dense_layers,
            "norm_topk_prob": spec.normalize_top_k,
            "n_group": 1,  # group-limited routing picks among experts: what it keeps is E-wide either way
            "topk_group": 1,
        }
    else:
        raise ValueError(f"hf type {hf_type!r} is not an MoE type; known: {', '.join(MOE_TYPES)}")
    return keys | {"num_experts_per_tok": spec.experts_per_token, "experts_implementation": "eager"}


def experts_modules(model: nn.Module) -> list[Any]:
    """transformers' experts (3-D ``gate_up_proj`` / ``down_proj``), one per sparse layer."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {p for m in experts_modules(model) for p in m.parameters(recurse=False)}


def apply_expert_parallel(model: nn.Module, ep: int) -> None:
    """Keep this rank's E/ep experts and route tokens to their ranks (EP group = the world)."""
    if dist.get_world_size() != ep:
        raise ValueError(f"the harness runs EP over the whole world: ep {ep} != world {dist.get_world_size()}")
    rank = dist.get_rank()
    for experts in experts_modules(model):
        local = experts.gate_up_proj.shape[0] // ep
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone()))
        experts.forward = _ep_forward.__get__(experts)  # one module's forward, as torchtitan swaps it


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    num_experts, ep = self.num_experts, dist.get_world_size()
    local = self.gate_up_proj.shape[0]
    k, dim = top_k_index.shape[1], hidden_states.shape[-1]
    group = dist.distributed_c10d._get_default_group()
    # _local_reorder: the k·T copies sorted by expert
    order = torch.argsort(top_k_index.view(-1), stable=True)
    scores = top_k_weights.view(-1)[order]
    token = order // k
    routed = hidden_states[token]
    with torch.no_grad():
        counts = torch.bincount(top_k_index.view(-1), minlength=num_experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        input_splits = counts.view(ep, local).sum(1).tolist()
        output_splits = received_counts.view(ep, local).sum(1).tolist()
        # rows arrive by source rank, each block by local expert: regroup them expert-major
        per_source = received_counts.view(ep, local)
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(ep), per_source.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        sizes = per_source.sum(0).tolist()
    received = all_to_all_single_autograd(routed, output_splits, input_splits, group)
    rows = received[regroup]
    outputs = []
    for e, chunk in enumerate(rows.split(sizes)):
        # MixtralExperts' eager body for one expert
        gate, up = nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
        outputs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
    back = torch.empty_like(regroup)
    back[regroup] = torch.arange(regroup.numel())
    returned = all_to_all_single_autograd(torch.cat(outputs)[back], input_splits, output_splits, group)
    # LocalTokenDispatcher.combine: weight in fp32, scatter-add per token
    weighted = (returned.to(torch.float32) * scores.reshape(-1, 1)).to(returned.dtype)
    out = torch.zeros_like(hidden_states)
    return out.scatter_add(0, token.reshape(-1, 1).expand(-1, dim), weighted)
