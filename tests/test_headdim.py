"""A head_dim apart from hidden / heads (Qwen3-0.6B/4B, Mistral-Nemo) and Qwen3-MoE: the spec's
rules, the presets' counts against transformers, and the measured head-dim matrix
(validation/records/headdim_matrix_cpu.jsonl)."""

from pathlib import Path

import pytest

from memplan import catalog, throughput
from memplan.errors import MemplanError
from memplan.frameworks.deepspeed import tensor_numels
from memplan.specs import ModelSpec

SHAPES = dict(num_layers=2, hidden=256, num_heads=8, num_kv_heads=2, ffn_hidden=768, vocab_size=4096)


def test_head_dim_sizes_every_attention_projection():
    spec = ModelSpec(**SHAPES, head_dim=64)
    h, q, kv = 256, 8 * 64, 2 * 64
    counts = spec.block_param_counts()
    assert (spec.q_hidden, spec.kv_hidden) == (q, kv)
    assert counts["attn_qkv"] == h * q + 2 * h * kv  # q_proj h → a·d, k_proj and v_proj h → a_kv·d
    assert counts["attn_out"] == q * h  # o_proj a·d → h
    assert sum(tensor_numels(spec)) == spec.num_params


def test_head_dim_at_hidden_over_heads_is_the_default_spec():
    assert ModelSpec(**SHAPES, head_dim=32) == ModelSpec(**SHAPES)
    assert ModelSpec(**SHAPES, head_dim=32).head_dim == 0


@pytest.mark.parametrize(
    "changes,fragment",
    [
        (dict(head_dim=-4), "head_dim must be a positive integer"),
        (dict(arch="gpt2", activation="gelu", head_dim=64), "modelled for arch llama"),
        (dict(hidden=250), "give head_dim"),
    ],
)
def test_bad_head_dims_are_refused(changes, fragment):
    with pytest.raises(MemplanError, match=fragment):
        ModelSpec(**SHAPES | changes)


def test_heads_need_not_divide_hidden_when_head_dim_is_given():
    spec = ModelSpec(**SHAPES | dict(hidden=250), head_dim=32)
    assert spec.q_hidden == 256 and spec.describe().count("head-dim 32") == 1


def test_attention_flops_run_over_the_heads_width():
    from memplan.specs import Job, TrainSpec

    wide, plain = ModelSpec(**SHAPES, head_dim=64), ModelSpec(**SHAPES)
    train = TrainSpec(seq_len=1024)
    extra = throughput.flops_per_token(Job(model=wide, train=train)) - throughput.flops_per_token(
        Job(model=plain, train=train)
    )
    layers, s = SHAPES["num_layers"], 1024
    # 6·ΔN for the wider q/o projections, 12·L·(a·d − h)·s for the scores and values
    delta_n = wide.num_params - plain.num_params
    assert extra == pytest.approx(6 * delta_n + 12 * layers * (wide.q_hidden - 256) * s)


def test_head_dim_by_shapes_on_the_command_line():
    from click.testing import CliRunner

    from memplan.cli import main

    shapes = "--arch llama --layers 28 --hidden 1024 --heads 16 --kv-heads 8 --ffn 3072 --vocab 151936"
    result = CliRunner().invoke(main, ["estimate", *shapes.split(), "--head-dim", "128", "--gpus", "1"])
    assert result.exit_code == 0, result.output
    # qwen3-0.6b's shapes without its q/k norms (2·128 per layer) and untied (another V·h)
    qwen3 = catalog.model_preset("qwen3-0.6b")
    expected = qwen3.num_params - 28 * 2 * 128 + 151936 * 1024
    assert "head-dim 128" in result.output and f"= {expected / 1e9:.3f}B parameters" in result.output


def test_qwen3_moe_per_tensor_list_holds_its_q_k_norms():
    """DeepSpeed's and the per-tensor optimizers' list of a Qwen3-MoE block: q/k norms in sparse blocks too."""
    spec = catalog.model_preset("qwen3-30b-a3b")
    assert sum(tensor_numels(spec)) == spec.num_params


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-4b"])
def test_qwen3_presets_with_wide_heads_count_what_transformers_builds(name):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    spec = catalog.model_preset(name)
    config = tf.Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=128,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = tf.Qwen3ForCausalLM(config)
    assert spec.head_size == 128 and spec.q_hidden != spec.hidden and spec.qk_norm
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert sum(tensor_numels(spec)) == spec.num_params


# -- the measured matrix (validation/records/headdim_matrix_cpu.jsonl) --------------------------------------

TOLERANCE = 0.02


def _records() -> list[dict]:
    from validation import headdim_matrix, heldout

    return heldout.latest_ok(Path(__file__).resolve().parent.parent / headdim_matrix.OUT)


def test_the_matrix_covers_wide_and_narrow_heads_and_qwen3_moe():
    recs = _records()
    from validation import headdim_matrix

    assert {r["id"] for r in recs} == {headdim_matrix.record_id(c) for c in headdim_matrix.CASES}
    widths = {
        (r["spec"]["model"].get("head_dim", 0) * r["spec"]["model"]["num_heads"] > r["spec"]["model"]["hidden"])
        for r in recs
        if r["spec"]["model"].get("head_dim")
    }
    assert widths == {True, False}
    plans = {(r["hf_model_type"], r["spec"]["plan"]["strategy"], r["spec"]["plan"].get("ep", 1)) for r in recs}
    assert {
        ("qwen3_moe", "single", 1),
        ("qwen3_moe", "fsdp-full-shard", 1),
        ("qwen3_moe", "fsdp-full-shard", 2),
    } <= plans


# held out, measured after the model (validation/records/headdim_matrix_cpu.md): none over 2 % now (the one-GPU full-AC
# qwen3 case, +2.4 %, fixed by the first block's backward as two instants: memory.FIRST_BLOCK_END)
_MISSED: dict[str, str] = {}


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=_MISSED[r["case"]])) if r["case"] in _MISSED else r
        for r in _records()
    ],
    ids=lambda r: r["case"],
)
def test_estimate_within_2_percent_of_the_measured_peak(record):
    from memplan.memory import estimate
    from validation import heldout

    measured = record["measurement"]["peak_allocated_bytes"]
    est = estimate(heldout.loop_job(record)).allocated_bytes
    assert abs(est - measured) <= TOLERANCE * measured, f"estimated {est:,} B, measured {measured:,} B"


def _one_case_per_model() -> list:
    from validation import headdim_matrix

    return list({c.job.model.name: c for c in headdim_matrix.CASES}.values())


@pytest.mark.parametrize("case", _one_case_per_model(), ids=lambda c: c.job.model.name)
def test_each_model_config_json_reads_as_its_spec(case):
    """What a user hands memplan (the model's config.json) is the spec the cases are estimated on."""
    from memplan.hfconfig import model_from_hf_config
    from validation import headdim_matrix

    read = model_from_hf_config(headdim_matrix.config_json(case), name=case.job.model.name)
    assert read == case.job.model


@pytest.mark.slow
def test_live_moe_case_matches_its_record():
    """The Qwen3-MoE EP case re-measured on 2 gloo ranks: the record's peak again."""
    from validation import headdim_matrix

    case = next(c for c in headdim_matrix.CASES if c.job.plan.ep == 2)
    record = next(r for r in _records() if r["case"] == case.id)
    outcome = headdim_matrix.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    recorded = record["measurement"]["peak_allocated_bytes"]
    assert abs(outcome["measurement"]["peak_allocated_bytes"] - recorded) <= 0.005 * recorded
