"""Mixture of experts: parameter counts against the transformers modules, the MoE block's
saved tensors against autograd, expert parallelism's rules, and the measured MoE matrix."""

import pytest

from memplan import catalog, moe
from memplan.errors import MemplanError
from memplan.hfconfig import model_from_hf_config
from memplan.specs import ModelSpec

TINY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        decoder_sparse_step=2,
    ),
    # Qwen3-30B-A3B's proportions: heads of 32 (q width 128) over hidden 64, norm_topk_prob true
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=32, norm_topk_prob=True),
}


def tiny_config(model_type: str, **overrides) -> dict:
    return {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **TINY[model_type],
        **overrides,
    }


def hf_num_params(config, cls_name: str | None = None) -> int:
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    with torch.device("meta"):
        if cls_name:
            model = getattr(tf, cls_name)(config)
        else:
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(TINY))
@pytest.mark.parametrize("tied", [False, True])
def test_hf_config_counts_what_transformers_builds(model_type, tied):
    cfg = tiny_config(model_type, tie_word_embeddings=tied)
    spec = model_from_hf_config(cfg)
    assert spec.num_experts == cfg.get("num_local_experts", cfg.get("num_experts"))
    assert spec.num_params == hf_num_params(cfg)


def test_mixtral_preset_counts_what_transformers_builds():
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset("mixtral-8x7b")
    config = tf.MixtralConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
    )
    assert spec.num_params == hf_num_params(config, "MixtralForCausalLM")


def test_deepseek_v3_gqa_preset_counts_glm4_moe():
    """transformers' GLM-4-MoE is DeepSeek-V3's MoE (first dense layers, shared experts,
    256 routed) with GQA attention: the preset's shapes built as one."""
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset("deepseek-v3-gqa")
    config = tf.Glm4MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        moe_intermediate_size=spec.moe_ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        n_routed_experts=spec.num_experts,
        n_shared_experts=spec.shared_ffn_hidden // spec.moe_ffn_hidden,
        num_experts_per_tok=spec.experts_per_token,
        first_k_dense_replace=spec.first_dense_layers,
        attention_bias=False,
        use_qk_norm=False,
        tie_word_embeddings=False,
    )
    assert spec.num_params == hf_num_params(config, "Glm4MoeForCausalLM")


def test_active_params_count_top_k_experts():
    spec = catalog.model_preset("mixtral-8x7b")
    idle = spec.num_layers * (spec.num_experts - spec.experts_per_token) * 3 * spec.hidden * spec.ffn_hidden
    assert moe.active_params(spec) == spec.num_params - idle


def test_qwen3_30b_a3b_preset_counts_what_transformers_builds():
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset("qwen3-30b-a3b")
    config = tf.Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        moe_intermediate_size=spec.moe_ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        norm_topk_prob=spec.normalize_top_k,
        tie_word_embeddings=False,
    )
    assert (spec.head_size, spec.q_hidden, spec.hidden) == (128, 4096, 2048)
    assert spec.qk_norm and not spec.top_k_weights_fp32 and not spec.shared_ffn_hidden
    assert spec.num_params == hf_num_params(config, "Qwen3MoeForCausalLM")
    # the model card's 3.3B activated: top-8 of the 128 experts
    assert moe.active_params(spec) == pytest.approx(3.3e9, rel=0.02)


def test_qwen3_moe_config_reads_its_router():
    spec = model_from_hf_config(tiny_config("qwen3_moe"))
    assert spec.qk_norm and spec.normalize_top_k and not spec.top_k_weights_fp32
    assert not spec.shared_ffn_hidden and spec.head_dim == 32
    # norm_topk_prob absent: Qwen3MoeConfig's default, false
    assert not model_from_hf_config(
        {k: v for k, v in tiny_config("qwen3_moe").items() if k != "norm_topk_prob"}
    ).normalize_top_k


@pytest.mark.parametrize("model_type,fragment", [("deepseek_v2", "latent attention")])
def test_undescribed_attention_is_refused(model_type, fragment):
    with pytest.raises(MemplanError, match=fragment):
        model_from_hf_config({"model_type": model_type, "hidden_size": 64})


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (dict(experts_per_token=5), "between 1 and num_experts 4"),
        (dict(arch="gpt2", activation="gelu"), "arch llama"),
        (dict(shared_expert_gate=True), "needs a shared expert"),
        (dict(first_dense_layers=2), "no MoE layer"),
    ],
)
def test_bad_moe_fields(changes, fragment):
    with pytest.raises(MemplanError, match=fragment):
        ModelSpec(
            **{
                "num_layers": 2,
                "hidden": 64,
                "num_heads": 4,
                "ffn_hidden": 96,
                "vocab_size": 128,
                "num_experts": 4,
                "experts_per_token": 2,
                **changes,
            }
        )


def _measured_moe_saved(model_type: str, spec: ModelSpec, train) -> int:
    """Bytes of distinct storages one sparse block's MLP saves (its parameters and input excluded)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from calibrate.moe_ep import hf_moe_kwargs
    from calibrate.wrappers import DTYPES
    from memplan.precision import POLICIES
    from validation.saved import saved_bytes

    config = tf.AutoConfig.for_model(model_type, hidden_size=spec.hidden, **hf_moe_kwargs(spec, model_type))
    block_class = {
        "mixtral": "MixtralSparseMoeBlock",
        "qwen2_moe": "Qwen2MoeSparseMoeBlock",
        "qwen3_moe": "Qwen3MoeSparseMoeBlock",
    }[model_type]
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=[block_class])
    torch.manual_seed(0)
    dtype = DTYPES[POLICIES[train.precision].param_dtype]
    block = getattr(module, block_class)(config).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(train.micro_batch, train.seq_len, spec.hidden, dtype=dtype, requires_grad=True)
    return saved_bytes(lambda: block(x), skip=(*block.parameters(), x))


@pytest.mark.parametrize("model_type", sorted(TINY))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_block_saved_bytes_match_autograd(model_type, precision, top_k):
    from memplan.activations import shapes
    from memplan.specs import TrainSpec

    spec = model_from_hf_config(tiny_config(model_type, num_experts_per_tok=top_k))
    train = TrainSpec(seq_len=48, micro_batch=2, precision=precision, device="cpu")
    x = shapes(spec, train)
    modelled = sum(s.bytes for s in moe.moe_saved(spec, x, moe.routed_rows(x.tokens, spec, 1)))
    assert modelled == _measured_moe_saved(model_type, spec, train)


# -- expert parallelism ------------------------------------------------------------------


def _job(**changes):
    from memplan.specs import ClusterSpec, Job, Plan, TrainSpec

    model = catalog.model_preset("mixtral-8x7b")
    return Job(
        model=model,
        train=TrainSpec(seq_len=4096),
        cluster=ClusterSpec(gpus=changes.pop("gpus", 8), gpu_name="h100-sxm"),
        plan=Plan(strategy=changes.pop("strategy", "fsdp-full-shard"), ep=changes.pop("ep", 1)),
    )


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (dict(ep=3, gpus=6), "does not divide num_experts 8"),
        (dict(ep=4, gpus=2), "does not divide gpus 2"),
        (dict(ep=2, strategy="ddp"), "use an fsdp strategy"),
    ],
)
def test_bad_ep_is_refused(changes, fragment):
    from memplan.memory import estimate

    with pytest.raises(MemplanError, match=fragment):
        estimate(_job(**changes))


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(MemplanError, match="is dense"):
        moe.check_ep(catalog.model_preset("llama-2-7b"), 2, 8)


def test_ep_shards_experts_and_keeps_fsdp_total():
    """FSDP over the world with experts over ep × dp_mod_ep holds P/n per rank either way; with
    the experts whole on their rank (ep = n) the gathered block drops the other ranks' experts."""
    spec = catalog.model_preset("mixtral-8x7b")
    experts = moe.routed_expert_params(spec)
    rest = spec.num_params - experts
    assert moe.local_params(spec, 8, 8, sharded=True) == -(-rest // 8) + experts // 8
    assert moe.local_params(spec, 8, 8, sharded=False) == rest + experts // 8
    gathered = moe.gathered_block_params(spec, 8, 8)
    assert gathered == spec.block_params() - spec.num_experts * moe.expert_params(spec)


def test_ep_all_to_all_time_counts_four_exchanges_per_sparse_layer():
    from memplan import throughput

    job = _job(ep=8)
    link = throughput.link_for(job)
    m, t = job.model, job.train.seq_len
    volume = 4 * m.num_layers * m.experts_per_token * t * m.hidden * 2  # bf16 rows
    assert throughput.ep_seconds(job, link) == pytest.approx(volume * 7 / 8 / link.intra_node_bytes_s)
    assert throughput.ep_seconds(_job(), link) == 0.0


def test_moe_flops_count_active_parameters():
    from memplan import throughput

    job = _job()
    assert throughput.flops_per_token(job) == pytest.approx(
        6 * moe.active_params(job.model) + 12 * job.model.num_layers * job.model.hidden * job.train.seq_len
    )


# -- the measured matrix (validation/records/moe_matrix_cpu.jsonl) ---------------------------------------

TOLERANCE = 0.02


def _matrix_records() -> list[dict]:
    from pathlib import Path

    from validation import heldout, moe_matrix

    return heldout.latest_ok(Path(__file__).resolve().parent.parent / moe_matrix.OUT)


def test_the_matrix_covers_the_asked_shapes():
    recs = _matrix_records()
    strategies = {(r["spec"]["plan"]["strategy"], r["spec"]["plan"].get("ep", 1)) for r in recs}
    assert len(recs) >= 10
    assert {("single", 1), ("ddp", 1), ("fsdp-full-shard", 1), ("fsdp-full-shard", 2)} <= strategies


@pytest.mark.parametrize("record", _matrix_records(), ids=lambda r: r["case"])
def test_moe_estimate_within_2_percent_of_the_measured_peak(record):
    from memplan.memory import estimate
    from validation import heldout

    measured = record["measurement"]["peak_allocated_bytes"]
    est = estimate(heldout.loop_job(record)).allocated_bytes
    assert abs(est - measured) <= TOLERANCE * measured, f"estimated {est:,} B, measured {measured:,} B"


@pytest.mark.slow
def test_live_ep_case_matches_its_record():
    """One EP case re-measured on 2 gloo ranks: the record's peak again."""
    from validation import moe_matrix

    case = moe_matrix.BY_ID["mixtral-h256-e4-plain-kept-fsdp-ep2-fp32-acnone-g2-b2s128"]
    record = next(r for r in _matrix_records() if r["case"] == case.id)
    outcome = moe_matrix.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    recorded = record["measurement"]["peak_allocated_bytes"]
    assert abs(outcome["measurement"]["peak_allocated_bytes"] - recorded) <= 0.005 * recorded


def test_capacity_factor_pads_each_local_expert():
    from dataclasses import replace

    spec = replace(catalog.model_preset("mixtral-8x7b"), capacity_factor=1.25)
    # 4096 tokens, top-2, 8 experts over ep 4: 2 local experts of ⌈1.25·2·4096·4/8⌉ rows each
    assert moe.routed_rows(4096, spec, 4) == 2 * 5120
    assert moe.routed_rows(4096, catalog.model_preset("mixtral-8x7b"), 4) == 2 * 4096


def test_dropless_ep_notes_the_skewed_bound():
    from memplan.memory import estimate

    (note,) = estimate(_job(ep=8)).notes
    assert "8,192 routed rows" in note and f"{8 * 4096:,}" in note


def test_single_tensor_adam_steps_the_3d_expert_tensor():
    """torch's single-tensor AdamW makes two sqrt(v) copies of its largest tensor: an MoE
    model's is a layer's gate_up_proj (E/ep × 2·f × h), not a 2-D weight."""
    from memplan.memory import estimate
    from memplan.specs import Job, TrainSpec

    model = ModelSpec(
        num_layers=2, hidden=64, num_heads=4, ffn_hidden=96, vocab_size=128, num_experts=8, experts_per_token=2
    )
    job = Job(model=model, train=TrainSpec(seq_len=32, precision="fp32", device="cpu"))
    (sqrt,) = [t for m in estimate(job).moments for t in m.terms if t.key == "optimizer.sqrt_temporaries"]
    assert sqrt.bytes == 2 * 4 * 8 * 2 * 96 * 64


def test_leading_dense_layers_keep_a_dense_blocks_activations():
    from memplan.activations import block_kept
    from memplan.memory import estimate
    from memplan.specs import ClusterSpec, Job, Plan, TrainSpec

    model = catalog.model_preset("deepseek-v3-gqa")
    train = TrainSpec(seq_len=1024)
    job = Job(model=model, train=train, cluster=ClusterSpec(gpus=64), plan=Plan(ep=8))
    end_of_forward = next(m for m in estimate(job).moments if m.label.startswith("end of forward"))
    terms = {t.key: t.bytes for t in end_of_forward.terms}
    # FSDP's mixed precision casts each block's inputs (activations.block_saved's inputs_cast)
    dense = sum(s.bytes for s in block_kept(moe.dense_view(model), train, inputs_cast=True))
    assert terms["activations.blocks.dense"] == model.first_dense_layers * dense
    assert moe.num_moe_layers(model) == model.num_layers - model.first_dense_layers


def test_fsdp_traffic_under_ep_gathers_experts_within_their_group():
    spec = catalog.model_preset("mixtral-8x7b")
    rest = spec.num_params - moe.routed_expert_params(spec)
    # ep = world: each rank's experts are its own, nothing of them crosses the ring
    assert moe.fsdp_traffic_params(spec, 8, 8) == rest
    # 16 ranks, ep 8: experts/8 over rings of 2, (1/2) / (15/16) of a byte per byte
    expected = rest + moe.routed_expert_params(spec) / 8 * (1 / 2) / (15 / 16)
    assert moe.fsdp_traffic_params(spec, 8, 16) == pytest.approx(expected)
