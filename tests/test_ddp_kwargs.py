"""DistributedDataParallel's keywords as inputs (``gradient_as_bucket_view``, ``bucket_cap_mb``,
``static_graph``): memplan against every case of validation/records/ddp_kwargs_cpu.jsonl (tiny
Hugging Face Llamas under real DDP on 2 gloo ranks, validation.ddp_kwargs), the inputs' checks,
and one case re-run live."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import api
from memplan.cli import main
from memplan.memory import estimate
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from validation import ddp_kwargs

TOLERANCE = 0.02
RECORDS = Path(__file__).resolve().parent.parent / ddp_kwargs.OUT
GPT2 = dict(model="gpt2", gpus=2, strategy="ddp", precision="fp32", seq_len=128, calibration=None)


def _records() -> list[dict]:
    return [r for r in ddp_kwargs.load() if r["case"] in ddp_kwargs.BY_ID]


def test_every_case_is_recorded():
    assert {r["case"] for r in _records()} == set(ddp_kwargs.BY_ID)


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["case"])
def test_estimate_within_2_percent_of_real_ddp(record):
    measured = record["measurement"]["peak_allocated_bytes"]
    est = estimate(ddp_kwargs.record_job(record))
    assert abs(est.allocated_bytes - measured) / measured <= TOLERANCE, record["case"]
    assert est.phase == record["measurement"]["phase"], record["case"]


def _ddp(**inputs):
    return api.estimate(**GPT2, **inputs).estimates[0]


def test_bucket_cap_and_static_graph_change_no_byte():
    """The buckets hold every gradient whatever their size; static_graph bucketizes only the first step."""
    base = _ddp()
    for inputs in ({"bucket_cap_mb": 1}, {"bucket_cap_mb": 100.5}, {"static_graph": True}):
        assert _ddp(**inputs).moments == base.moments, inputs


@pytest.mark.parametrize("zero_grad", ["none", "zeros"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_bucket_views_free_the_second_copy_of_the_gradients_at_the_optimizer_step(zero_grad, grad_accum):
    """At the step the gradients are the buckets: exactly one copy of them less; never more anywhere."""
    copies = _ddp(zero_grad=zero_grad, grad_accum=grad_accum)
    views = _ddp(zero_grad=zero_grad, grad_accum=grad_accum, gradient_as_bucket_view=True)
    step = [next(m for m in e.moments if m.phase == "optimizer") for e in (copies, views)]
    grads = sum(t.bytes for t in step[0].terms if t.key == "grads")
    assert grads == 4 * copies.job.model.num_params
    assert step[0].allocated_bytes - step[1].allocated_bytes == grads
    for before, after in zip(copies.moments, views.moments, strict=True):
        assert after.label == before.label and after.allocated_bytes <= before.allocated_bytes, before.label


@settings(max_examples=100, deadline=None)
@given(
    layers=st.integers(1, 48),
    heads=st.sampled_from([4, 8, 16]),
    ffn=st.integers(64, 20_000),
    vocab=st.integers(256, 150_000),
    tied=st.booleans(),
    seq=st.integers(1, 8192),
    accum=st.integers(1, 3),
    precision=st.sampled_from(["fp32", "amp-bf16", "mixed-bf16", "bf16"]),
    ac=st.sampled_from(["none", "selective", "full"]),
    zero_grad=st.sampled_from(["none", "zeros"]),
    cap=st.sampled_from([None, 1, 25, 512.5]),
    static=st.booleans(),
)
def test_bucket_views_never_add_and_the_other_keywords_change_nothing(
    layers, heads, ffn, vocab, tied, seq, accum, precision, ac, zero_grad, cap, static
):
    model = ModelSpec(
        num_layers=layers, hidden=64 * heads, num_heads=heads, ffn_hidden=ffn, vocab_size=vocab, tied_embeddings=tied
    )
    train = TrainSpec(
        seq_len=seq, grad_accum=accum, precision=precision, activation_checkpointing=ac, zero_grad=zero_grad
    )

    def ddp(**keywords):
        plan = Plan(strategy="ddp", **keywords)
        return estimate(Job(model=model, train=train, cluster=ClusterSpec(gpus=4), plan=plan))

    plain = ddp()
    assert ddp(bucket_cap_mb=cap, static_graph=static).moments == plain.moments
    views = ddp(gradient_as_bucket_view=True, bucket_cap_mb=cap, static_graph=static)
    assert views.allocated_bytes <= plain.allocated_bytes
    # the buckets stay at every moment: each gradient lives in one
    for before, after in zip(plain.moments, views.moments, strict=True):
        assert [t.bytes for t in after.terms if t.key == "ddp.buckets"] == [
            t.bytes for t in before.terms if t.key == "ddp.buckets"
        ]


def test_the_harness_passes_the_keywords_ddp_takes():
    assert Plan(strategy="ddp").ddp_kwargs() == {}
    given = {"gradient_as_bucket_view": True, "bucket_cap_mb": 1, "static_graph": True}
    assert Plan(strategy="ddp", **given).ddp_kwargs() == given


@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_a_bucket_size_that_is_not_positive_is_refused_in_one_line(value):
    result = CliRunner().invoke(main, ["estimate", "--model", "gpt2", "--strategy", "ddp", "--bucket-cap-mb", value])
    assert result.exit_code == 2
    assert result.stderr == f"Error: --bucket-cap-mb must be a positive number of MiB, got {float(value)!r}\n"


@pytest.mark.parametrize("strategy", ["zero2", "fsdp-full-shard", "single"])
def test_bucket_views_under_another_strategy_are_refused_in_one_line(strategy):
    """Only DistributedDataParallel takes the keyword; stated with another strategy it would change nothing."""
    args = ["estimate", "--model", "gpt2", "--gpus", "1" if strategy == "single" else "2", "--strategy", strategy]
    result = CliRunner().invoke(main, [*args, "--gradient-as-bucket-view"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: --gradient-as-bucket-view is DistributedDataParallel's keyword; strategy {strategy} has no such "
        "keyword (it applies to strategy ddp, or all: the search's DDP options)\n"
    )


def test_the_flag_moves_the_ddp_row_alone_of_an_estimate_of_every_strategy():
    args = ["estimate", "--model", "gpt2", "--gpus", "2", "--precision", "fp32", "--seq-len", "64", "--format", "json"]
    plain, views = (
        {e["strategy"]: e["bytes"]["allocated"] for e in json.loads(CliRunner().invoke(main, a).stdout)["estimates"]}
        for a in (args, [*args, "--gradient-as-bucket-view"])
    )
    assert views.pop("ddp") < plain.pop("ddp")
    assert views == plain and len(plain) > 1


@pytest.mark.slow
def test_one_case_live():
    """The optimizer-step shape with bucket views on 2 gloo ranks: the recorded peak, within 2 % of memplan."""
    case = ddp_kwargs.BY_ID["llama-h384-l6-v2k-bucket_cap_mb=25-gradient_as_bucket_view=True-accum1-zgnone"]
    record = ddp_kwargs.measure(case)
    recorded = next(r for r in _records() if r["case"] == case.id)
    measured = record["measurement"]["peak_allocated_bytes"]
    assert measured == pytest.approx(recorded["measurement"]["peak_allocated_bytes"], rel=1e-3)
    est = estimate(ddp_kwargs.record_job(record)).allocated_bytes
    assert abs(est - measured) / measured <= TOLERANCE
