"""A calibration moves the recommendation: corrected totals decide what fits, measured speed
replaces the throughput defaults — and on real CPU records that speed predicts held-out runs."""

import statistics

import pytest
from click.testing import CliRunner

from calibrate import fit as fitting
from calibrate.records import job_from_spec
from memplan import api
from memplan import calibration as cal
from memplan.cli import main
from memplan.decide import Basis, basis_for
from memplan.throughput import flops_per_token, link_for, step_time

THIRTEEN_B = dict(params="13e9", gpus=8, gpu="h100-sxm")


def _correction(*, offset_bytes=0, throughput=()):
    return cal.Correction(
        device="NVIDIA H100 80GB HBM3",
        torch_version="2.13.0",
        scales=dict.fromkeys(cal.GROUPS, 1.0),
        offset_bytes=offset_bytes,
        residual_pct=1.0,
        num_records=10,
        before_median_abs_pct=2.0,
        after_median_abs_pct=0.5,
        throughput=tuple(throughput),
    )


def _saved(tmp_path, correction) -> str:
    path = tmp_path / "h100.json"
    cal.Calibration(corrections=(correction,)).save(path)
    return str(path)


def test_corrected_totals_decide_what_fits_in_the_recommendation(tmp_path):
    _, plain = api.recommend(**THIRTEEN_B, calibration="none")
    # a correction that adds the plain winner's headroom plus 1 GiB to every estimate
    extra = plain.best.headroom_bytes + 2**30
    path = _saved(tmp_path, _correction(offset_bytes=extra))
    _, rec = api.recommend(**THIRTEEN_B, calibration=path)
    assert rec.basis.correction is not None and rec.basis.device_matches
    for option in rec.options:
        corrected = cal.apply(option.estimate, rec.basis.correction, device_matches=True)
        assert option.total_bytes == corrected.total_bytes
        assert option.fits == corrected.fits
    assert rec.best is not None and rec.best.fits
    assert rec.best.key != plain.best.key  # the plain winner no longer fits once corrected
    assert any(r.code == "calibrated" and r.basis is rec.basis for r in rec.reasons)


def test_measured_mfu_replaces_the_default_and_unmeasured_strategies_take_the_mean(tmp_path):
    fsdp = cal.ThroughputFit(
        strategy="fsdp-full-shard", num_records=3, achieved_flops=1.0, mfu=0.2, exposed_comm_fraction=0.5
    )
    ddp = cal.ThroughputFit(strategy="ddp", num_records=1, achieved_flops=1.0, mfu=0.6, exposed_comm_fraction=None)
    path = _saved(tmp_path, _correction(throughput=(fsdp, ddp)))
    _, rec = api.recommend(
        **THIRTEEN_B, calibration=path, micro_batch=1, precision="amp-bf16", ac="none", offload="none"
    )
    by = {o.job.plan.strategy: o for o in rec.options}
    peak = rec.link.gpu.peak_flops("amp-bf16")
    for strategy, mfu in (("fsdp-full-shard", 0.2), ("ddp", 0.6), ("fsdp-shard-grad-op", (3 * 0.2 + 0.6) / 4)):
        job = by[strategy].job
        flops = flops_per_token(job) * job.train.seq_len
        assert by[strategy].step.compute_s == pytest.approx(flops / (peak * mfu), rel=1e-9)
    fsdp_step = by["fsdp-full-shard"].step
    assert fsdp_step.exposed_comm_s == pytest.approx(0.5 * fsdp_step.comm_s)


def test_estimate_and_recommend_take_the_calibration_flag(tmp_path):
    path = _saved(tmp_path, _correction(offset_bytes=10 * 2**30))
    runner = CliRunner()
    flags = ["--params", "13e9", "--gpus", "8", "--gpu", "h100-sxm", "--calibration", path]
    out = runner.invoke(main, ["recommend", *flags])
    assert out.exit_code == 0, out.output
    assert "calibrated by" in out.output
    table = runner.invoke(main, ["estimate", *flags])
    assert table.exit_code == 0 and "; calibrated" in table.output
    bad = runner.invoke(main, ["recommend", "--params", "13e9", "--calibration", str(tmp_path / "missing.json")])
    assert bad.exit_code != 0 and "no such file" in bad.output and "Traceback" not in bad.output


def test_speed_fitted_on_half_the_real_cpu_records_predicts_the_other_half(shipped_cpu_records):
    """The shipped CPU record set (real emulated FSDP/DDP steps): achieved FLOP/s per strategy
    fitted on one half predicts the other half's step times far better than the defaults (which
    assume an H100)."""
    ok = [r for r in shipped_cpu_records if r["status"] == "ok"]
    for train, test in ((ok[0::2], ok[1::2]), (ok[1::2], ok[0::2])):
        calibration = fitting.fit_records(train)
        [correction] = calibration.corrections
        calibrated, default = [], []
        for record in test:
            job = job_from_spec(record["spec"])
            measured = record["measurement"]["step_time_s"]
            basis = Basis(link=link_for(job), calibration=calibration, correction=correction, device_matches=True)
            calibrated.append(abs(basis.step(job).step_s / measured - 1))
            default.append(abs(step_time(job, link_for(job)).step_s / measured - 1))
        assert statistics.median(calibrated) < 0.5 < 0.99 < statistics.median(default)


def test_the_shipped_cpu_calibration_applies_to_a_cpu_job_by_default(shipped_cpu_records):
    ok = next(r for r in shipped_cpu_records if r["status"] == "ok")
    job = job_from_spec(ok["spec"])
    assert basis_for(job, calibration="auto").correction is not None
    assert basis_for(job, calibration="none").correction is None


def test_min_gpus_counts_with_the_corrected_totals(tmp_path):
    flags = dict(params="70e9", gpu="h100-sxm", ac="full")
    _, plain = api.min_gpus(**flags, calibration="none")
    assert plain.corrected is None
    path = _saved(tmp_path, _correction(offset_bytes=plain.estimate.headroom_bytes + 2**30))
    _, corrected = api.min_gpus(**flags, calibration=path)
    assert corrected.gpus > plain.gpus and corrected.corrected.fits
    out = CliRunner().invoke(
        main, ["min-gpus", "--params", "70e9", "--gpu", "h100-sxm", "--ac", "full", "--calibration", path]
    )
    assert out.exit_code == 0 and f"Fewest GPUs: {corrected.gpus} with" in out.output and "calibrated" in out.output
