"""FSDP2's integer ``reshard_after_forward`` (``--reshard-after-forward N``): memplan against every
case of validation/records/fsdp2_reshard_cpu.jsonl (Hugging Face models under torch's
``fully_shard`` on the fake process group, validation.fsdp2_reshard), the input's checks, what
it changes and what it does not, and one case re-run live."""

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import api
from memplan.cli import main
from memplan.memory import estimate, step_of
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from memplan.throughput import comm_seconds, link_for
from validation import fsdp2_reshard, heldout

TOLERANCE = 0.02


def _records() -> list[dict]:
    return heldout.latest_ok(fsdp2_reshard.OUT)


def test_every_case_is_recorded():
    assert {r["id"] for r in _records()} == {fsdp2_reshard.record_id(c) for c in fsdp2_reshard.CASES}


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["case"])
def test_estimate_within_2_percent_of_fully_shard(record):
    measured = record["measurement"]["peak_allocated_bytes"]
    job = heldout.loop_job(record)
    assert job.plan.reshard_after_forward in (2, 4)
    est = estimate(job)
    assert abs(est.allocated_bytes - measured) / measured <= TOLERANCE, record["case"]
    assert est.phase == record["measurement"]["phase"], record["case"]


def _job(group: int | None, *, gpus: int = 16, layers: int = 8, recipe: str = "plain", tied: bool = False) -> Job:
    model = ModelSpec(
        num_layers=layers, hidden=1024, num_heads=16, ffn_hidden=2816, vocab_size=32000, tied_embeddings=tied
    )
    plan = Plan(strategy="fsdp-full-shard", reshard_after_forward=group)
    train = TrainSpec(seq_len=1024, precision="mixed-bf16", recipe=recipe)
    return Job(model=model, train=train, cluster=ClusterSpec(gpus=gpus), plan=plan)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 12),
    recipe=st.sampled_from(["plain", "hf-trainer", "torchtitan", "torchtune"]),
    tied=st.booleans(),
    groups=st.sampled_from([(2, 4), (2, 8), (4, 8), (8, 16)]),
)
def test_a_smaller_group_never_holds_less_and_the_whole_group_is_full_shard(layers, recipe, tied, groups):
    """The post-forward copies are 1/N of each unit: fewer ranks, larger copies, at every moment;
    N = the shard group is full shard itself (torch turns it into True)."""
    small, large = (estimate(_job(g, layers=layers, recipe=recipe, tied=tied)) for g in groups)
    full = estimate(_job(None, layers=layers, recipe=recipe, tied=tied))
    assert estimate(_job(16, layers=layers, recipe=recipe, tied=tied)).moments == full.moments
    for a, b, c in zip(small.moments, large.moments, full.moments, strict=True):
        assert a.allocated_bytes >= b.allocated_bytes >= c.allocated_bytes, a.label


def test_the_copies_are_every_block_after_the_forward_and_the_blocks_below_in_backward():
    job = _job(4, layers=6)
    est = estimate(job)
    copies = {m.label: sum(t.bytes for t in m.terms if t.key == "fsdp.post_forward") for m in est.moments}
    step = step_of(job)
    one = step.gather_bytes * step.block_params / 4
    assert copies["end of forward (cross-entropy)"] == pytest.approx(6 * one, abs=6)
    assert copies["optimizer step"] == 0
    firsts = [v for label, v in copies.items() if "first block" in label]
    assert firsts and max(firsts) == pytest.approx(one, abs=1)


def test_the_backward_gathers_within_the_node_are_faster_than_full_shard_across_nodes():
    link = link_for(_job(None))
    assert comm_seconds(_job(8), link) < comm_seconds(_job(None), link)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--reshard-after-forward", "3"],
            "--reshard-after-forward 3: it must divide the 8 ranks full shard shards over",
        ),
        (
            ["--reshard-after-forward", "1"],
            "--reshard-after-forward must be an integer of at least 2 (the ranks a unit reshards to after "
            "forward; 1 keeps it unsharded: strategy fsdp-shard-grad-op), got 1",
        ),
        (
            ["--reshard-after-forward", "2", "--strategy", "zero3"],
            "--reshard-after-forward 2 is FSDP2 full shard's; strategy zero3 has no post-forward reshard group "
            "(use fsdp-full-shard, or all)",
        ),
        (
            ["--reshard-after-forward", "2", "--strategy", "fsdp-full-shard", "--tp", "2"],
            "--reshard-after-forward 2: torch reshards DTensor (tensor-parallel) parameters to the whole group only",
        ),
    ],
)
def test_what_torch_or_the_measurements_do_not_cover_is_refused_in_one_line(flags, message):
    result = CliRunner().invoke(main, ["estimate", "--params", "7e9", "--gpus", "8", "--gpu-mem", "80", *flags])
    assert result.exit_code == 2
    assert result.stderr == f"Error: {message}\n"


def test_the_flag_moves_the_full_shard_row_alone_and_every_command_agrees():
    args = ["--params", "7e9", "--gpus", "16", "--gpu", "h100-sxm", "--seq-len", "4096"]
    table = json.loads(CliRunner().invoke(main, ["estimate", *args, "--format", "json"]).stdout)["estimates"]
    flagged = json.loads(
        CliRunner().invoke(main, ["estimate", *args, "--reshard-after-forward", "8", "--format", "json"]).stdout
    )["estimates"]
    before = {e["strategy"]: e["bytes"]["allocated"] for e in table}
    after = {e["strategy"]: e["bytes"]["allocated"] for e in flagged}
    assert after.pop("fsdp-full-shard") > before.pop("fsdp-full-shard")
    assert after == before
    one = api.estimate(
        params=7e9, gpus=16, gpu="h100-sxm", seq_len=4096, strategy="fsdp-full-shard", reshard_after_forward=8
    )
    row = next(e for e in flagged if e["strategy"] == "fsdp-full-shard")
    assert one.estimates[0].allocated_bytes == row["bytes"]["allocated"]


def test_emit_fsdp2_writes_the_group_and_the_configs_that_cannot_say_it_refuse():
    args = ["recommend", "--params", "7e9", "--gpus", "16", "--gpu", "h100-sxm", "--strategy", "fsdp-full-shard"]
    args += ["--reshard-after-forward", "8", "--no-search-layout"]
    snippet = CliRunner().invoke(main, [*args, "--emit", "fsdp2"])
    assert snippet.exit_code == 0 and "reshard_after_forward=8)" in snippet.stdout
    for kind in ("accelerate", "torchtitan"):
        refused = CliRunner().invoke(main, [*args, "--emit", kind])
        assert refused.exit_code == 2
        assert refused.stderr.strip().splitlines() == [
            f"Error: --emit {kind} cannot say --reshard-after-forward 8 (its config takes no reshard group): "
            "use --emit fsdp2"
        ]


@pytest.mark.slow
def test_one_case_live():
    """Torch's fully_shard with reshard_after_forward=4 on one rank of 8: the recorded peak, and memplan within 2 %."""
    case = fsdp2_reshard.BY_ID["llama-h512-l6-plain-kept-fsdp-fp32-acnone-w8-b2s256-raf4"]
    outcome = heldout.execute_child(case, fsdp2_reshard.TIMEOUT_S, module="validation.fsdp2_reshard")
    assert outcome["status"] == "ok", outcome["error"]
    measured = outcome["measurement"]["peak_allocated_bytes"]
    recorded = next(r for r in _records() if r["id"] == fsdp2_reshard.record_id(case))
    assert measured == recorded["measurement"]["peak_allocated_bytes"]
    est = estimate(heldout.loop_job(recorded)).allocated_bytes
    assert abs(est - measured) / measured <= TOLERANCE
