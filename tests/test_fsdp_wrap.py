"""``--fsdp-wrap none``: the whole model as one FSDP1 unit (Lightning's ``FSDPStrategy()`` default,
accelerate's ``NO_WRAP``), measured by validation.lightning_loop (its records are compared in
tests/test_lightning_loop.py); here its input, refusals, launch forms and step time."""

import json

import pytest
from click.testing import CliRunner

from memplan import api
from memplan.cli import main
from memplan.errors import InputError
from memplan.inputs import build_jobs
from memplan.memory import estimate
from memplan.throughput import _ring, comm_seconds, link_for, step_time

JOB = dict(model="llama-3.1-8b", gpus=8, gpu_mem=80, precision="mixed-bf16", ac="none")


def _job(**changes):
    (job,) = build_jobs(**(JOB | {"strategy": "fsdp-full-shard"} | changes))[1]
    return job


def test_the_peak_holds_the_model_gathered_and_its_gradients_twice():
    """ROOT_BACKWARD: the gathered model, each parameter's unsharded gradient and their flat
    concatenation, in the gathered dtype (bf16: 2 bytes each), beside the sharded states."""
    job = _job(fsdp_wrap="none")
    est = estimate(job)
    P = job.model.num_params
    moment = max(est.moments, key=lambda m: m.allocated_bytes)
    assert moment.label.startswith("backward of the input embedding")
    keys = {t.key: 0 for t in moment.terms}
    for t in moment.terms:
        keys[t.key] += t.bytes
    assert keys["fsdp.whole_model"] == 2 * P
    assert keys["fsdp.unit_grads"] == 2 * (2 * P)


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard"])
def test_one_unit_holds_more_than_the_blocks(strategy):
    blocks, one = (estimate(_job(strategy=strategy, fsdp_wrap=w)).allocated_bytes for w in ("blocks", "none"))
    assert one > blocks


def test_one_unit_gathers_once_and_hides_nothing():
    blocks, one = _job(), _job(fsdp_wrap="none")
    link = link_for(one)
    n, P = one.dp, one.model.num_params
    # mixed-bf16: the parameters gathered and the gradients reduced in bf16
    assert comm_seconds(one, link) == pytest.approx(_ring(n) * (2 * P + 2 * P) / link.intra_node_bytes_s)
    assert comm_seconds(blocks, link) == pytest.approx(_ring(n) * (2 * 2 * P + 2 * P) / link.intra_node_bytes_s)
    timed = step_time(one, link)
    assert timed.exposed_comm_s == pytest.approx(timed.comm_s)


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        (dict(strategy="ddp"), "strategy ddp has no FSDP units"),
        (dict(strategy="fsdp-no-shard"), "strategy fsdp-no-shard has no FSDP units"),
        (dict(tp=2), "tensor, context or pipeline parallel"),
        (dict(offload="params"), "offload params"),
        (dict(reshard_after_forward=2), "no reshard-after-forward group"),
        (dict(finetune="lora"), "finetune lora"),
        (dict(grad_accum=2), "grad-accum 2"),
    ],
)
def test_what_was_not_measured_is_refused_in_one_line(changes, said):
    args = ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-mem", "80", "--fsdp-wrap", "none"]
    args += ["--strategy", changes.pop("strategy", "fsdp-full-shard")]
    for key, value in changes.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if x.strip()]
    assert said in line and "--fsdp-wrap none" in line
    with pytest.raises(InputError):
        build_jobs(**(JOB | {"strategy": "fsdp-full-shard", "fsdp_wrap": "none"} | changes | {"strategy": args[-1]}))


def test_the_cli_api_and_json_say_the_same_bytes():
    args = ["--model", "llama-3.1-8b", "--gpus", "8", "--gpu-mem", "80", "--strategy", "fsdp-full-shard"]
    result = CliRunner().invoke(main, ["estimate", *args, "--fsdp-wrap", "none", "--format", "json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["estimates"]
    (est,) = api.estimate(
        model="llama-3.1-8b", gpus=8, gpu_mem=80, strategy="fsdp-full-shard", fsdp_wrap="none"
    ).estimates
    assert row["bytes"]["allocated"] == est.allocated_bytes


def test_search_options_that_cannot_be_one_unit_are_skipped_not_refused():
    _, rec = api.recommend(model="llama-3.1-8b", gpus=8, gpu_mem=80, strategy="fsdp-full-shard", fsdp_wrap="none")
    assert rec.best is not None and rec.best.job.one_fsdp_unit
    (skipped,) = [r for r in rec.reasons if r.code == "skipped"]
    assert "--fsdp-wrap none" in str(skipped.why) or "fsdp_wrap none" in str(skipped.why)


@pytest.mark.parametrize(("kind", "ok"), [("fsdp1", True), ("accelerate", True), ("fsdp2", False)])
def test_launch_forms(kind, ok):
    args = ["recommend", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-mem", "80"]
    result = CliRunner().invoke(main, [*args, "--strategy", "fsdp-full-shard", "--fsdp-wrap", "none", "--emit", kind])
    assert result.exit_code == (0 if ok else 2), result.output
    if kind == "fsdp1":
        assert "auto_wrap_policy=" not in result.stdout and "use_orig_params=True" in result.stdout
    if kind == "accelerate":
        assert "fsdp_auto_wrap_policy: NO_WRAP" in result.stdout and "fsdp_version: 1" in result.stdout
