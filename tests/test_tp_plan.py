"""Tensor parallel plans other than torchtitan's (``layout.TP_PLANS``): memplan's estimate against
every committed measurement of ``validation.tp_plan`` (PyTorch's ``parallelize_module`` with the
TP tutorial's plans, one rank on the fake process group), the refusals, and the JSON report."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import memplan
from memplan.breakdown import Component
from memplan.cli import main
from memplan.errors import InputError
from memplan.layout import Layout
from memplan.readers import detect
from memplan.readers.tp_plan import plan_of
from validation import tp_plan

RECORDS = tp_plan.read()
TOLERANCE = 0.02
"""The held-out target: allocated peak within 2 % of the measured rank."""


def test_every_case_is_recorded():
    assert sorted(r["case"] for r in RECORDS) == sorted(name for name, _, _ in tp_plan.CASES)
    assert {r["plan"] for r in RECORDS} == set(tp_plan.PLANS)


@pytest.mark.parametrize("record", RECORDS, ids=[r["case"] for r in RECORDS])
def test_estimate_matches_measured_rank(record):
    measured = record["measurement"]["peak_allocated_bytes"]
    estimated, phase = tp_plan.estimated_bytes(record)
    assert abs(estimated - measured) <= TOLERANCE * measured, (estimated, measured)
    assert phase == record["measurement"]["phase"]


def _job(**extra):
    flags = {"arch": "llama", "layers": 2, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1408, "vocab": 32000}
    return flags | {"gpus": 2, "tp": 2, "strategy": "single", "device": "cpu", "seq_len": 512, "micro_batch": 2} | extra


def test_replicated_vocabulary_adds_what_the_sharded_plan_splits():
    """blocks against torchtitan without SP: the embedding and head (V·h each, fp32 with AdamW's two
    states and a gradient) and the logits are whole, where torchtitan's plan holds 1/tp of them."""
    v, h = 32000, 512
    (titan,) = memplan.estimate(**_job(sp=False, precision="fp32")).estimates
    (blocks,) = memplan.estimate(**_job(tp_plan="blocks", precision="fp32")).estimates
    by_titan, by_blocks = titan.by_component, blocks.by_component
    param = Component.PARAMS
    # two V·h matrices (embedding, head), of which torchtitan's rank holds 1/2: 4 bytes each
    assert by_blocks[param] - by_titan[param] == 2 * 4 * v * h // 2
    assert blocks.allocated_bytes > titan.allocated_bytes


@settings(max_examples=15, deadline=None)
@given(
    tp=st.sampled_from([2, 4]),
    vocab=st.sampled_from([8192, 32000, 50176]),
    seq=st.sampled_from([256, 1024]),
    ac=st.sampled_from(["none", "full"]),
)
def test_full_vocabulary_logits_never_hold_less(tp, vocab, seq, ac):
    """Every plan but torchtitan's keeps the full-vocabulary logits on each rank: never less memory
    than torchtitan's plan of the same job, with the same SP."""
    job = _job(gpus=tp, tp=tp, vocab=vocab, seq_len=seq, ac=ac, precision="fp32")

    def allocated(**extra) -> int:
        (est,) = memplan.estimate(**job, **extra).estimates
        return est.allocated_bytes

    assert allocated(tp_plan="tutorial") >= allocated()
    assert allocated(tp_plan="blocks") >= allocated(sp=False)


def test_blocks_has_no_sequence_parallel():
    assert Layout(tp=2, tp_plan="blocks").sp is False
    assert Layout(tp=2, tp_plan="tutorial").sp is True


def test_sp_given_with_the_blocks_plan_is_refused_in_one_line():
    """--sp defaults to on (off under the blocks plan); given with it, it is refused, not dropped."""
    args = ["estimate", *(f"--{k.replace('_', '-')}={v}" for k, v in _job().items()), "--tp-plan", "blocks"]
    result = CliRunner().invoke(main, [*args, "--sp"])
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: --sp does not apply to --tp-plan blocks (the blocks alone: no SequenceParallel norms); "
        "drop it, or take --tp-plan tutorial\n"
    )
    for flags in ([], ["--no-sp"]):
        out = CliRunner().invoke(main, [*args, *flags, "--format", "json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["estimates"][0]["layout"]["sp"] is False


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"tp_plan": "megatron", "tp": 2}, "tp_plan"),
        ({"tp_plan": "blocks"}, "tp_plan"),
        ({"tp_plan": "tutorial", "tp": 2, "sp": False}, "tp_plan"),
        ({"tp_plan": "blocks", "tp": 2, "pp": 2}, "pp"),
        ({"tp_plan": "tutorial", "tp": 2, "cp": 2}, "cp"),
        ({"tp_plan": "tutorial", "tp": 2, "async_tp": True}, "async_tp"),
    ],
)
def test_unmeasured_combinations_are_refused(layout, named):
    with pytest.raises(InputError) as err:
        Layout(**layout)
    assert err.value.field == named


def test_cli_flag_and_json_carry_the_plan():
    args = ["estimate", "--arch", "llama", "--layers", "2", "--hidden", "512", "--heads", "8", "--ffn", "1408"]
    args += ["--vocab", "32000", "--gpus", "2", "--tp", "2", "--strategy", "single", "--format", "json"]
    out = CliRunner().invoke(main, [*args, "--tp-plan", "blocks"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["estimates"][0]["layout"]["tp_plan"] == "blocks"
    # torchtitan's plan (the default) reads as before the field existed
    out = CliRunner().invoke(main, args)
    assert "tp_plan" not in json.loads(out.stdout)["estimates"][0]["layout"]
    bad = CliRunner().invoke(main, [*args, "--tp-plan", "tutorial", "--no-sp"])
    assert bad.exit_code == 2
    assert bad.output.count("\n") == 1 and "tp-plan 'tutorial'" in bad.output


@pytest.mark.slow
def test_live_tiny_blocks_run_matches_estimate():
    """One rank of a tiny blocks-plan job, measured now (fake process group, real tensors)."""
    flags = {"arch": "llama", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 352, "vocab": 8192}
    flags |= {"gpus": 2, "tp": 2, "strategy": "single", "precision": "fp32", "seq_len": 128, "micro_batch": 2}
    record = tp_plan.measure_case("tiny blocks tp2", "blocks", flags)
    measured = record["measurement"]["peak_allocated_bytes"]
    estimated, _ = tp_plan.estimated_bytes(record)
    assert abs(estimated - measured) <= TOLERANCE * measured, (estimated, measured)


# a user's parallelize_module plan as a dict (memplan.readers.tp_plan)
HF_BLOCKS = {
    f"layers.*.{name}": style
    for name, style in (
        ("self_attn.q_proj", "ColwiseParallel"),
        ("self_attn.k_proj", "ColwiseParallel"),
        ("self_attn.v_proj", "ColwiseParallel"),
        ("self_attn.o_proj", "RowwiseParallel"),
        ("mlp.gate_proj", "ColwiseParallel"),
        ("mlp.up_proj", "ColwiseParallel"),
        ("mlp.down_proj", "RowwiseParallel"),
    )
}
"""transformers' LlamaConfig.base_model_tp_plan with torch's style names."""
EXAMPLE_SP = {
    "tok_embeddings": "RowwiseParallel",
    "norm": "SequenceParallel",
    "output": "ColwiseParallel",
    **{
        f"layers.0.{name}": style
        for name, style in (
            ("attention_norm", "SequenceParallel"),
            ("attention", "PrepareModuleInput"),
            ("attention.wq", "ColwiseParallel"),
            ("attention.wk", "ColwiseParallel"),
            ("attention.wv", "ColwiseParallel"),
            ("attention.wo", "RowwiseParallel"),
            ("ffn_norm", "SequenceParallel"),
            ("feed_forward", "PrepareModuleInput"),
            ("feed_forward.w1", "ColwiseParallel"),
            ("feed_forward.w2", "RowwiseParallel"),
            ("feed_forward.w3", "ColwiseParallel"),
        )
    },
}
"""pytorch/examples fsdp_tp_example.py's plan: its top-level dict and one block's layer_tp_plan."""


def test_user_plans_map_to_the_measured_ones():
    assert plan_of(HF_BLOCKS, "plan.json") == "blocks"
    assert plan_of(EXAMPLE_SP, "plan.json") == "tutorial"
    # the harness's own module names, as validation.tp_plan applies the tutorial's plan
    harness = {k.replace("self_attn", "attn"): v for k, v in HF_BLOCKS.items()}
    assert plan_of(harness | {"layers.*.input_norm": "SequenceParallel"} | _root_and_rest(), "p") == "tutorial"


def _root_and_rest() -> dict:
    return {
        "embed_tokens": "RowwiseParallel",
        "norm": "SequenceParallel",
        "lm_head": "ColwiseParallel",
        "layers.*.post_attention_norm": "SequenceParallel",
        "layers.*.attn": "PrepareModuleInput",
        "layers.*.mlp": "PrepareModuleInput",
    }


@pytest.mark.parametrize(
    ("entries", "named"),
    [
        (HF_BLOCKS | {"layers.*.mlp.down_proj": "ColwiseParallel"}, "layers.*.mlp.down_proj"),
        (HF_BLOCKS | {"lm_head": "colwise_gather_output"}, "lm_head"),
        (HF_BLOCKS | {"layers.*.router": "ColwiseParallel"}, "layers.*.router"),
        ({k: v for k, v in HF_BLOCKS.items() if "k_proj" not in k}, "tp_plan"),
        ({k: v for k, v in EXAMPLE_SP.items() if k != "norm"}, "tp_plan"),
    ],
)
def test_unmeasured_user_plans_are_refused_naming_the_entry(entries, named):
    with pytest.raises(InputError) as err:
        plan_of(entries, "plan.json")
    assert err.value.field == named
    assert "\n" not in str(err.value)


def test_from_reads_a_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(EXAMPLE_SP))
    assert detect(path) == "tp-plan"
    args = ["estimate", "--arch", "llama", "--layers", "2", "--hidden", "512", "--heads", "8", "--ffn", "1408"]
    args += ["--vocab", "32000", "--gpus", "2", "--tp", "2", "--strategy", "single", "--format", "json"]
    out = CliRunner().invoke(main, [*args, "--from", str(path)])
    assert out.exit_code == 0, out.output
    layout = json.loads(out.stdout)["estimates"][0]["layout"]
    assert (layout["tp_plan"], layout["sp"]) == ("tutorial", True)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["blocks", "tutorial"])
def test_trace_and_emulate_run_the_plans_alike(plan):
    """calibrate's --mode trace (fake tensors) and --mode emulate (real tensors) wrap a job's plan
    as validation.tp_plan measures it (one ``calibrate.tensor_parallel``): the same peak, to
    emulate's 16-byte device-mesh tensor, and memplan's within the records' tolerance."""
    from calibrate import launch, trace
    from calibrate.runs import plan as plan_runs
    from calibrate.tensor_parallel import refusal

    flags = {"arch": "llama", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 352, "vocab": 8192}
    flags |= {"gpus": 4, "tp": 2, "strategy": "fsdp-full-shard", "precision": "mixed-bf16", "ac": "full"}
    (run,) = plan_runs([tp_plan.job_flags(plan, flags) | {"tp_plan": plan}], mode="emulate")[0]
    assert run.job.layout.tp_plan == plan and refusal(run.job, "trace") is None
    traced = trace.run(run.job, steps=2, warmup=1)
    real = launch.emulate(run.job, world_size=4, steps=2, warmup=1)
    assert traced.peak_allocated_bytes == pytest.approx(real.peak_allocated_bytes, abs=64)
    estimated = memplan.estimate(**tp_plan.job_flags(plan, flags), tp_plan=plan).estimates[0].allocated_bytes
    assert abs(estimated - real.peak_allocated_bytes) <= TOLERANCE * real.peak_allocated_bytes
