"""DeepSeek's multi-head latent attention (memplan.mla): the spec's rules, parameter counts and
per-tensor lists against transformers' DeepseekV3ForCausalLM, one block's saved bytes against
autograd, attention FLOPs, what is refused, and the measured MLA matrix
(validation/records/mla_matrix_cpu.jsonl)."""

from pathlib import Path

import pytest

from memplan import catalog, throughput
from memplan.activations import block_saved, shapes
from memplan.errors import MemplanError
from memplan.finetune import full_tensors
from memplan.frameworks.deepspeed import tensor_numels
from memplan.hfconfig import model_from_hf_config
from memplan.layout import Layout
from memplan.specs import ClusterSpec, Job, ModelSpec, TrainSpec

MLA = dict(q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20)
SHAPES = dict(num_layers=2, hidden=128, num_heads=4, ffn_hidden=344, vocab_size=512)
MOE = dict(num_experts=8, experts_per_token=2, moe_ffn_hidden=64, shared_ffn_hidden=128, first_dense_layers=1)


def hf_config(spec: ModelSpec) -> dict:
    """The config.json of the spec's DeepseekV3 (transformers' keys)."""
    cfg = {
        "model_type": "deepseek_v3",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn_hidden,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "first_k_dense_replace": spec.first_dense_layers if spec.num_experts else spec.num_layers,
        "tie_word_embeddings": spec.tied_embeddings,
    }
    if spec.num_experts:
        cfg |= {
            "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.experts_per_token,
            "moe_intermediate_size": spec.moe_ffn_hidden,
            "n_shared_experts": spec.shared_ffn_hidden // spec.moe_ffn_hidden,
            "n_group": 1,
            "topk_group": 1,
        }
    return cfg


def hf_model(cfg: dict, device: str = "meta"):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    config = tf.AutoConfig.for_model(**cfg)
    with torch.device(device):
        return tf.AutoModelForCausalLM.from_config(config)


def attention_block_counts(spec: ModelSpec) -> int:
    h, a, Q, R = spec.hidden, spec.num_heads, spec.q_lora_rank, spec.kv_lora_rank
    dqk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    q = h * a * dqk if not Q else h * Q + Q + Q * a * dqk  # q_proj | q_a_proj, q_a_layernorm, q_b_proj
    kv = h * (R + spec.qk_rope_head_dim) + R + R * a * (spec.qk_nope_head_dim + spec.v_head_dim)
    return q + kv + a * spec.v_head_dim * h  # o_proj


# -- the spec --------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [96, 0])
def test_attention_parameters_are_deepseek_v3s(q_lora_rank):
    spec = ModelSpec(**SHAPES, **MLA | {"q_lora_rank": q_lora_rank})
    counts = spec.block_param_counts()
    assert counts["attn_qkv"] + counts["attn_out"] + counts["norms"] - 2 * spec.hidden == attention_block_counts(spec)


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (dict(kv_lora_rank=0), "need kv_lora_rank"),
        (dict(v_head_dim=0), "needs positive v_head_dim"),
        (dict(qk_rope_head_dim=15), "must be even"),
        (dict(num_kv_heads=2), "must equal heads"),
        (dict(qkv_bias=True), "without head_dim, qk_norm or biases"),
        (dict(q_lora_rank=-1), "non-negative integer"),
    ],
)
def test_bad_mla_fields_are_refused(changes, fragment):
    with pytest.raises(MemplanError, match=fragment):
        ModelSpec(**SHAPES, **MLA | changes)


@pytest.mark.parametrize(
    "changes",
    [
        dict(layout=Layout(tp=2)),
        dict(layout=Layout(cp=2)),
        dict(train=TrainSpec(activation_checkpointing="op")),
        dict(train=TrainSpec(compile=True)),
        dict(train=TrainSpec(precision="amp-fp16")),
        dict(train=TrainSpec(attention="eager")),
        dict(train=TrainSpec(finetune="lora")),
    ],
    ids=["tp", "cp", "op-sac", "compile", "autocast", "eager", "lora"],
)
def test_unmeasured_mla_settings_are_refused_in_one_line(changes):
    with pytest.raises(MemplanError) as err:
        Job(model=ModelSpec(**SHAPES, **MLA), **{"cluster": ClusterSpec(gpus=2)} | changes)
    message = str(err.value)
    assert "\n" not in message and "multi-head latent attention under" in message
    assert "fp32, bf16, mixed-bf16 or amp-bf16" in message


def test_attention_flops_run_over_q_k_and_v_widths():
    spec = ModelSpec(**SHAPES, **MLA)
    s = 1024
    base = Job(model=spec, train=TrainSpec(seq_len=s))
    # 6·N + 3·forward attention: per layer q·kᵀ 2·a·dqk·s and probs·v 2·a·dv·s (memplan.mla)
    attention = spec.num_layers * 2 * spec.num_heads * (24 + 16 + 20) * s
    assert throughput.flops_per_token(base) == 6 * spec.num_params + 3 * attention


# -- counts against transformers -------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [96, 0])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_config_json_reads_as_transformers_builds_it(q_lora_rank, moe):
    spec = ModelSpec(**SHAPES, **MLA | {"q_lora_rank": q_lora_rank}, **(MOE if moe else {}))
    cfg = hf_config(spec)
    model = hf_model(cfg)
    read = model_from_hf_config(cfg, name=spec.name)
    assert read == spec
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert sum(tensor_numels(spec)) == spec.num_params
    if not moe:  # a full fine-tune's per-tensor list: transformers' tensors, in order
        assert list(full_tensors(spec)) == [tuple(p.shape) for p in model.parameters()]


def test_a_transformers_saved_config_reads_the_same():
    """transformers writes head_dim = qk_rope_head_dim into a saved DeepseekV3 config: not a head width."""
    spec = ModelSpec(**SHAPES, **MLA)
    tf = pytest.importorskip("transformers")
    saved = tf.AutoConfig.for_model(**hf_config(spec)).to_dict()
    assert saved["head_dim"] == 16
    assert model_from_hf_config(saved, name=spec.name) == spec


def test_deepseek_v3_preset_counts_transformers_module():
    """The preset's shapes are DeepseekV3Config's defaults (deepseek-ai/DeepSeek-V3's config.json)."""
    spec = catalog.model_preset("deepseek-v3")
    tf = pytest.importorskip("transformers")
    defaults = tf.DeepseekV3Config()
    cfg = hf_config(spec)
    assert {k: getattr(defaults, k) for k in cfg if k != "model_type"} == {
        k: v for k, v in cfg.items() if k != "model_type"
    } | {"n_group": 8, "topk_group": 4}
    model = hf_model(cfg)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert sum(tensor_numels(spec)) == spec.num_params
    assert model_from_hf_config(defaults.to_dict(), name=spec.name) == spec


# -- one block's saved tensors against autograd ----------------------------------------------


def measured_block_saved(spec: ModelSpec, precision: str, b: int, s: int) -> int:
    """Bytes of distinct storages autograd saves in one DeepseekV3DecoderLayer's forward (its
    parameters and the model's shared rotary tables excluded)."""
    torch = pytest.importorskip("torch")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "amp-bf16": torch.float32}[precision]
    cfg = hf_config(spec) | {"num_hidden_layers": 1, "first_k_dense_replace": 1}
    model = hf_model(cfg, device="cpu").to(dtype)
    model.config._attn_implementation = "sdpa"
    layer = model.model.layers[0]
    x = torch.randn(b, s, spec.hidden, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(s)[None])
    skip = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp-bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        layer(x, attention_mask=None, position_embeddings=(cos, sin))
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("q_lora_rank,v_head_dim", [(96, 20), (0, 20), (96, 40)])
def test_block_saved_bytes_match_autograd(precision, q_lora_rank, v_head_dim):
    """v_head_dim 20: CPU sdpa's math path (q/k heads 40 wide); 40: its fused kernel."""
    spec = ModelSpec(**SHAPES | {"num_layers": 1}, **MLA | {"q_lora_rank": q_lora_rank, "v_head_dim": v_head_dim})
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, device="cpu")
    assert shapes(spec, train).attention == ("flash" if v_head_dim == 40 else "math-fp32")
    estimated = sum(saved.bytes for saved in block_saved(spec, train))
    assert estimated == measured_block_saved(spec, precision, 2, 64)


# -- the measured matrix (validation/records/mla_matrix_cpu.jsonl) ------------------------------------------

TOLERANCE = 0.02


def _records() -> list[dict]:
    from validation import heldout, mla_matrix

    return heldout.latest_ok(Path(__file__).resolve().parent.parent / mla_matrix.OUT)


def test_the_matrix_covers_q_lora_dense_first_moe_precisions_strategies_and_full_ac():
    from validation import mla_matrix

    recs = _records()
    assert {r["id"] for r in recs} == {mla_matrix.record_id(c) for c in mla_matrix.CASES}
    models = [r["spec"]["model"] for r in recs]
    assert {bool(m.get("q_lora_rank")) for m in models} == {True, False}
    assert {m.get("first_dense_layers", 0) > 0 for m in models if m.get("num_experts")} == {True}
    assert {r["spec"]["train"]["precision"] for r in recs} == {"fp32", "bf16", "mixed-bf16", "amp-bf16"}
    assert {r["spec"]["plan"]["strategy"] for r in recs} == {"single", "ddp", "fsdp-full-shard"}
    assert {r["spec"]["plan"].get("ep", 1) for r in recs} == {1, 2}
    assert {r["loop"]["ac"] for r in recs} == {"none", "full"}


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["case"])
def test_estimate_within_2_percent_of_the_measured_peak(record):
    from memplan.memory import estimate
    from validation import heldout

    measured = record["measurement"]["peak_allocated_bytes"]
    est = estimate(heldout.loop_job(record)).allocated_bytes
    assert abs(est - measured) <= TOLERANCE * measured, f"estimated {est:,} B, measured {measured:,} B"


def _one_case_per_model() -> list:
    from validation import mla_matrix

    return list({c.job.model.name: c for c in mla_matrix.CASES}.values())


@pytest.mark.parametrize("case", _one_case_per_model(), ids=lambda c: c.job.model.name)
def test_each_model_config_json_reads_as_its_spec(case):
    from validation import mla_matrix

    assert model_from_hf_config(mla_matrix.config_json(case), name=case.job.model.name) == case.job.model


@pytest.mark.slow
def test_live_case_matches_its_record_and_the_estimate():
    """The FSDP2 case without a q LoRA rank re-measured on 2 gloo ranks: the record's peak again."""
    from validation import mla_matrix

    case = next(c for c in mla_matrix.CASES if c.job.cluster.gpus == 2 and not c.job.model.q_lora_rank)
    record = next(r for r in _records() if r["case"] == case.id)
    outcome = mla_matrix.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    recorded = record["measurement"]["peak_allocated_bytes"]
    assert abs(outcome["measurement"]["peak_allocated_bytes"] - recorded) <= 0.005 * recorded


def test_a_transformers_module_reads_as_its_spec():
    """memplan.module: a DeepseekV3ForCausalLM carries its config, read as a config.json is."""
    from memplan.module import spec_from_module

    spec = ModelSpec(**SHAPES, **MLA, **MOE)
    assert spec_from_module(hf_model(hf_config(spec)), name=spec.name) == spec
