"""Lightning's own Trainer against memplan's lightning recipe (validation/records/lightning_loop_cpu.jsonl,
``python -m validation.lightning_loop``): its closure clears the gradients between the forward and
the backward, so the step before's live through the forward (``Loop.zero_grad`` after-forward)."""

import json

import pytest

from memplan import api
from validation import lightning_loop

RECORDS = lightning_loop.load()


def test_every_case_recorded():
    assert {r["case"] for r in RECORDS} == set(lightning_loop.CASES)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["case"])
def test_within_two_percent(record):
    # first table, zero_grad none: -3.55, -8.92, -11.70 %; bf16-mixed keeps -0.95 % (1.2 MiB);
    # FSDPStrategy with the blocks as units, held out (never tuned on): -1.33 ... +0.15 %;
    # without auto_wrap_policy (one unit) before --fsdp-wrap none: -12.36, -33.34, -16.67 %
    measured = record["measured_peak_bytes"]
    assert lightning_loop.estimate(record) == pytest.approx(measured, rel=0.02)


def test_the_forward_holds_the_step_befores_gradients():
    def forward_end(zero_grad: str) -> int:
        job = dict(model=lightning_loop._model_spec(), strategy="single", gpus=1, seq_len=128, micro_batch=4)
        job |= dict(precision="fp32")
        (est,) = api.estimate(recipe="lightning", zero_grad=zero_grad, calibration=None, **job).estimates
        return est.moments[0].allocated_bytes

    fp32_grads = 4 * lightning_loop._model_spec().num_params
    assert forward_end("after-forward") - forward_end("none") == fp32_grads


@pytest.mark.slow
def test_a_lightning_run_live():
    pytest.importorskip("lightning")
    (recorded,) = [r for r in RECORDS if r["case"] == "single-fp32-ac"]
    live = lightning_loop.measure("single-fp32-ac")
    assert live is not None
    assert live["measured_peak_bytes"] == pytest.approx(recorded["measured_peak_bytes"], rel=0.001)


@pytest.mark.parametrize(("strategy", "said"), [("fsdp-full-shard", True), ("all", True), ("ddp", False)])
def test_the_cli_says_which_fsdp_units_a_lightning_job_has(strategy, said):
    from click.testing import CliRunner

    from memplan.cli import main

    args = ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-mem", "80", "--recipe", "lightning"]
    result = CliRunner().invoke(main, [*args, "--strategy", strategy])
    assert result.exit_code == 0, result.output
    assumed = [line for line in result.output.splitlines() if line.startswith("assumed  lightning's FSDP units")]
    assert len(assumed) == int(said)


@pytest.mark.slow
def test_lightning_s_one_fsdp_unit_live(tmp_path):
    """Lightning's FSDPStrategy() without a wrapping policy, two gloo ranks under torchrun, again."""
    pytest.importorskip("lightning")
    import os
    import subprocess
    import sys

    name, out = "fsdp-none-bf16-mixed-short", tmp_path / "live.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "validation.lightning_loop"]
    env = os.environ | {"PYTHONPATH": str(lightning_loop.ROOT)}
    subprocess.run([*command, "--case", name, "--out", str(out)], cwd=lightning_loop.ROOT, env=env, check=True)
    (live,) = [json.loads(line) for line in out.read_text().splitlines()]
    (recorded,) = [r for r in RECORDS if r["case"] == name]
    assert live["measured_peak_bytes"] == pytest.approx(recorded["measured_peak_bytes"], rel=0.001)
    assert lightning_loop.estimate(live) == pytest.approx(live["measured_peak_bytes"], rel=0.02)
