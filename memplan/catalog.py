"""The data tables shipped in ``tables/``: model presets, GPU datasheets, DeepSpeed defaults,
runtime overheads and decision settings, each row with its source."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from .csvtables import TABLES_DIR as TABLES_DIR  # where callers look for the tables
from .csvtables import read_table
from .errors import InputError, MemplanError
from .precision import POLICIES
from .specs import MLA_FIELDS, ModelSpec

_MIB = 2**20
_TFLOPS = 10**12
_GBS = 10**9


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator as its vendor's datasheet describes it (dense, no sparsity)."""

    name: str
    aliases: tuple[str, ...]
    memory_bytes: int
    """What the device reports as total memory (nvidia-smi's MiB), not the marketing GB."""
    peak_bf16_flops: float | None
    """None: no bf16 (V100)."""
    peak_fp16_flops: float
    peak_fp32_flops: float
    fp8: bool
    """Whether its tensor cores run FP8 matmuls (what torchao's float8 training needs)."""
    memory_bw_bytes_s: float
    interconnect: str
    """nvlink | pcie | infinity-fabric: how GPUs of one node talk."""
    intra_node_bw_bytes_s: float
    """The datasheet's GPU-to-GPU figure, both directions together."""
    host_link_bw_bytes_s: float
    """The datasheet's PCIe figure, both directions together."""
    source: str

    def peak_flops(self, precision: str) -> float:
        """Peak dense FLOPS of the matmuls a precision policy runs in."""
        compute = POLICIES[precision].compute_dtype
        peak = {"fp32": self.peak_fp32_flops, "bf16": self.peak_bf16_flops, "fp16": self.peak_fp16_flops}[compute]
        if peak is None:
            raise InputError(
                lambda n: f"{self.name} has no bf16 support; use {n('precision')} fp32, amp-fp16 or mixed-fp16",
                field="precision",
                value=precision,
                accepted="fp32, amp-fp16 or mixed-fp16",
            )
        return peak

    def check_float8(self, float8: bool) -> None:
        """Refuse float8 training on a GPU without FP8 matmuls."""
        if float8 and not self.fp8:
            raise InputError(
                lambda n: (
                    f"{self.name} has no FP8 tensor cores (tables/gpus.csv), so no float8 training; "
                    f"leave out {n('float8')} or give a GPU with FP8 (h100-sxm, h200, b200, l40s, ...)"
                ),
                field="float8",
                value=float8,
                accepted="false on this GPU",
            )


def _gpu_row(row: dict[str, str]) -> GpuSpec:
    return GpuSpec(
        name=row["name"],
        aliases=tuple(a for a in row["aliases"].split("|") if a),
        memory_bytes=int(row["memory_mib"]) * _MIB,
        peak_bf16_flops=float(row["peak_bf16_tflops"]) * _TFLOPS if row["peak_bf16_tflops"] else None,
        peak_fp16_flops=float(row["peak_fp16_tflops"]) * _TFLOPS,
        peak_fp32_flops=float(row["peak_fp32_tflops"]) * _TFLOPS,
        fp8=row["fp8"] == "1",
        memory_bw_bytes_s=float(row["memory_bw_gbs"]) * _GBS,
        interconnect=row["interconnect"],
        intra_node_bw_bytes_s=float(row["intra_node_bw_gbs"]) * _GBS,
        host_link_bw_bytes_s=float(row["host_link_bw_gbs"]) * _GBS,
        source=row["source"],
    )


def _model_row(row: dict[str, str]) -> ModelSpec:
    return ModelSpec(
        name=row["name"],
        arch=row["arch"],
        num_layers=int(row["layers"]),
        hidden=int(row["hidden"]),
        num_heads=int(row["heads"]),
        num_kv_heads=int(row["kv_heads"]),
        ffn_hidden=int(row["ffn"]),
        vocab_size=int(row["vocab"]),
        tied_embeddings=row["tied"] == "1",
        qkv_bias=row["qkv_bias"] == "1",
        linear_bias=row["linear_bias"] == "1",
        max_positions=int(row["max_positions"]),
        dropout=float(row["dropout"]),
        activation=row["activation"],
        patch_size=int(row["patch_size"]) or 16,
        **experts().get(row["name"], {}),
        qk_norm=row["name"] in qk_norms(),
        fused_projections=row["name"] in fused_projections(),
        head_dim=head_dims().get(row["name"], 0),
        **latent_attention().get(row["name"], {}),
        **encoders().get(row["name"], {}),
    )


@cache
def qk_norms() -> frozenset[str]:
    """The presets whose attention normalises q and k per head (tables/qk_norm.csv: Qwen3)."""
    return frozenset(row["name"] for row in read_table("qk_norm.csv"))


@cache
def fused_projections() -> frozenset[str]:
    """The presets whose blocks fuse q/k/v and gate/up into one linear each (tables/fused_projections.csv: Phi-3)."""
    return frozenset(row["name"] for row in read_table("fused_projections.csv"))


@cache
def head_dims() -> dict[str, int]:
    """The presets whose attention heads are apart from hidden / heads (tables/head_dims.csv)."""
    return {row["name"]: int(row["head_dim"]) for row in read_table("head_dims.csv")}


@cache
def latent_attention() -> dict[str, dict[str, Any]]:
    """The presets with DeepSeek's multi-head latent attention, their MLA shapes (tables/mla.csv)."""
    return {row["name"]: {f: int(row[f]) for f in MLA_FIELDS} for row in read_table("mla.csv")}


@cache
def encoders() -> dict[str, dict[str, Any]]:
    """The encoder presets' token types and head (tables/encoders.csv), by preset name."""
    return {
        row["name"]: {"type_vocab_size": int(row["type_vocab"]), "num_labels": int(row["num_labels"])}
        for row in read_table("encoders.csv")
    }


@cache
def experts() -> dict[str, dict[str, Any]]:
    """The MoE presets' expert fields (tables/experts.csv), by preset name."""
    return {
        row["name"]: {
            "num_experts": int(row["experts"]),
            "experts_per_token": int(row["top_k"]),
            "moe_ffn_hidden": int(row["expert_ffn"]),
            "shared_ffn_hidden": int(row["shared_ffn"]),
            "shared_expert_gate": row["shared_gate"] == "1",
            "first_dense_layers": int(row["first_dense"]),
            "moe_every": int(row["moe_every"]),
            "normalize_top_k": row["norm_top_k"] == "1",
            "top_k_weights_fp32": row["top_k_fp32"] == "1",
        }
        for row in read_table("experts.csv")
    }


@cache
def gpus() -> dict[str, GpuSpec]:
    return {row["name"]: _gpu_row(row) for row in read_table("gpus.csv")}


@cache
def models() -> dict[str, ModelSpec]:
    return {row["name"]: _model_row(row) for row in read_table("models.csv")}


@cache
def published_params() -> dict[str, tuple[int, str]]:
    """Preset name -> (published parameter total, where it is published)."""
    return {row["name"]: (int(row["published_params"]), row["source"]) for row in read_table("models.csv")}


def _lookup(table: dict, name: str, what: str, keyword: str, aliases=lambda v: ()):
    key = str(name).strip().lower()
    for canonical, value in table.items():
        if key == canonical or key in aliases(value):
            return value
    raise InputError(
        lambda n: f"{n(keyword)} {name!r} is not a known {what}; known: {', '.join(table)}",
        field=keyword,
        value=name,
        accepted=", ".join(table),
    )


def gpu(name: str) -> GpuSpec:
    return _lookup(gpus(), name, "GPU", "gpu", lambda g: g.aliases)


def model_preset(name: str) -> ModelSpec:
    return _lookup(models(), name, "model preset", "model")


@cache
def deepspeed_defaults() -> dict[str, int]:
    """DeepSpeed ZeRO's buffer sizes (in elements) when its config leaves them unset."""
    return {row["key"]: int(row["value"]) for row in read_table("deepspeed.csv")}


@cache
def _settings(name: str) -> dict[str, float]:
    return {row["key"]: float(row["value"]) for row in read_table(name)}


@cache
def overheads() -> dict[str, float]:
    """Per-GPU bytes outside the allocator's tensors (tables/overheads.csv)."""
    return _settings("overheads.csv")


@cache
def decision_settings() -> dict[str, float]:
    """The recommendation's settings that are choices, not physics (tables/decision.csv)."""
    return _settings("decision.csv")


def decision_setting(name: str) -> float:
    settings = decision_settings()
    if name not in settings:
        raise MemplanError(f"decision setting {name!r} is not in tables/decision.csv; known: {', '.join(settings)}")
    return settings[name]
