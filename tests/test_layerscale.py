"""Layer-scaled calibration: a deep model's peak from its 2-, 3- and 4-block copies."""

from dataclasses import replace

import pytest

from calibrate.layerscale import fit_depth, measure_layer_scaled


def test_fit_is_exact_on_a_line_and_widens_with_noise():
    per_block, constant, predicted, se = fit_depth([(1, 110), (2, 120), (4, 140)], 16)
    assert (round(per_block), round(constant), round(predicted), round(se)) == (10, 100, 260, 0)
    _, _, _, se_noisy = fit_depth([(1, 110), (2, 123), (4, 140)], 16)
    _, _, _, se_near = fit_depth([(1, 110), (2, 123), (4, 140)], 5)
    assert se_noisy > se_near > 0


@pytest.mark.slow
def test_sixteen_blocks_predicted_from_one_two_four_within_3_percent():
    pytest.importorskip("torch")
    from calibrate import launch
    from validation.accuracy_matrix import LLAMA, _job

    job = _job(replace(LLAMA, num_layers=16), strategy="fsdp-full-shard", precision="fp32", gpus=4)

    def measure(j):
        return launch.emulate(j, world_size=4, steps=2, warmup=1)

    scaled = measure_layer_scaled(job, measure=measure)
    real = measure(job)
    assert [p[0] for p in scaled.points] == [2, 3, 4]
    assert scaled.peak_allocated_bytes == pytest.approx(real.peak_allocated_bytes, rel=0.03)
    assert scaled.phase == real.phase


def test_depths_must_stay_below_the_model():
    from validation.accuracy_matrix import LLAMA, _job

    with pytest.raises(ValueError, match="below the model's 4 blocks"):
        measure_layer_scaled(_job(LLAMA, strategy="ddp", precision="fp32"), measure=None)


@pytest.mark.slow
def test_calibrate_run_layers_scaled_records_the_full_model(tmp_path):
    pytest.importorskip("torch")
    from click.testing import CliRunner

    from calibrate import records
    from memplan.cli import main

    out = tmp_path / "runs.jsonl"
    flags = [
        "--arch",
        "llama",
        "--layers",
        "12",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--ffn",
        "128",
        "--vocab",
        "256",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--gpus",
        "2",
        "--strategy",
        "fsdp-full-shard",
        "--mode",
        "emulate",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    result = CliRunner().invoke(main, ["calibrate", "run", *flags, "--layers-scaled", "--out", str(out)])
    assert result.exit_code == 0, result.output
    [record] = records.read([out])
    assert record["status"] == "ok" and record["layers_scaled"] is True
    fit = record["measurement"]["layer_scaled"]
    assert [p[0] for p in fit["points"]] == [2, 3, 4]
    assert record["spec"]["model"]["num_layers"] == 12
    # the extrapolated peak is the full model's, which memplan estimates to within its usual error
    assert record["measurement"]["peak_allocated_bytes"] == pytest.approx(
        record["estimate"]["allocated_bytes"], rel=0.03
    )
    again = CliRunner().invoke(main, ["calibrate", "run", *flags, "--layers-scaled", "--out", str(out), "--resume"])
    assert "1 already recorded" in again.output
