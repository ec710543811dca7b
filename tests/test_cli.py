"""The CLI: exit codes, output shapes, one-line errors."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.strategies import strategies_on


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_main_job_prints_a_table_and_the_fits_line():
    result = run("estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80")
    assert result.exit_code == 0, result.output
    assert "assumed llama-style-13B" in result.output
    for strategy in strategies_on(8):
        assert strategy in result.output
    assert "Fits:" in result.output


def test_json_follows_the_output_contract():
    result = run("estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"inputs", "estimates", "calibration", "recommendation"}
    assert data["inputs"]["model"]["num_params"] == 6738415616
    est = data["estimates"][0]
    for key in (
        "strategy",
        "precision",
        "activation_checkpointing",
        "offload",
        "micro_batch",
        "phase",
        "bytes",
        "fits",
        "headroom_bytes",
        "relative_throughput",
        "notes",
    ):
        assert key in est
    b = est["bytes"]
    assert b["params"] + b["gradients"] + b["optimizer"] + b["activations"] + b["buffers"] == b["allocated"]
    assert b["allocated"] + b["overhead"] == b["total"]
    assert all(isinstance(v, int) for v in b.values())


def test_csv_has_one_row_per_strategy():
    result = run("estimate", "--params", "7B", "--gpus", "8", "--format", "csv")
    assert result.exit_code == 0
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("strategy,precision")
    assert len(lines) == 1 + len(strategies_on(8))


def test_explain_shows_every_term_and_the_peak():
    result = run("explain", "--model", "gpt2", "--strategy", "ddp", "--micro-batch", "8", "--seq-len", "1024")
    assert result.exit_code == 0, result.output
    assert "<- peak" in result.output
    assert "DDP gradient buckets" in result.output
    assert "4·b·s·V" in result.output


def test_every_command_has_help():
    for command in main.commands:
        result = run(command, "--help")
        assert result.exit_code == 0 and "Usage" in result.output


BAD = [
    (["--params", "0"], "params"),
    (["--params", "-5e9"], "params"),
    (["--params", "nan"], "params"),
    (["--params", "1e30"], "params"),
    (["--params", "13e9", "--gpus", "0"], "gpus"),
    (["--params", "13e9", "--gpus", "-8"], "gpus"),
    (["--params", "13e9", "--gpu-mem", "eighty"], "gpu-mem"),
    (["--params", "13e9", "--gpu-mem", "0"], "gpu-mem"),
    (["--params", "13e9", "--seq-len", "0"], "seq-len"),
    (["--params", "13e9", "--micro-batch", "99999999"], "micro-batch"),
    (["--params", "13e9", "--headroom", "1.5"], "headroom"),
    (["--params", "13e9", "--headroom", "nan"], "headroom"),
    (["--model", "llama-9000"], "llama-9000"),
    (["--params", "13e9", "--gpu", "tpu-v9"], "tpu-v9"),
    (["--params", "13e9", "--model", "gpt2"], "exactly one"),
    (["--params", "13e9", "--gpu", "h100-sxm", "--gpu-mem", "80"], "not both"),
    (["--params", "13e9", "--precision", "fp8"], "fp8"),
    (["--params", "13e9", "--strategy", "ddp", "--offload", "optimizer"], "offload"),
    (["--params", "13e9", "--gpus", "12", "--gpus-per-node", "8"], "gpus-per-node"),
    (["--arch", "llama", "--layers", "4"], "--hidden"),
    (
        ["--arch", "llama", "--layers", "4", "--hidden", "100", "--heads", "3", "--ffn", "64", "--vocab", "10"],
        "divisible",
    ),
    (["--params", "13e9", "--gpu", "v100-32gb"], "bf16"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(args, needle):
    result = run("estimate", *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert needle.lower() in lines[0].lower()
    assert "Traceback" not in result.output


def test_malformed_config_files(tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    unsupported = tmp_path / "t5.json"
    unsupported.write_text(json.dumps({"model_type": "t5"}))
    for path, needle in ((broken, "json"), (unsupported, "supported"), (tmp_path / "missing.json", "missing")):
        result = run("estimate", "--config", str(path))
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1
        assert needle in result.output.lower()


def test_console_script_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "memplan.cli", "estimate", "--params", "zero"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("Error:") and "Traceback" not in proc.stderr


def test_console_script_flushes_its_whole_output_before_it_ends():
    """``cli.run`` ends the process without tearing its heap down: what it printed must all arrive,
    with main's exit code, and a reader that leaves early gets no traceback."""
    args = [sys.executable, "-m", "memplan.cli", "estimate", "--model", "gpt2", "--gpus", "2", "--format", "json"]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == ""
    assert json.loads(proc.stdout)["estimates"]
    head = subprocess.run(f"{' '.join(args)} | head -c 10", shell=True, capture_output=True, text=True)
    assert len(head.stdout) == 10 and "Traceback" not in head.stderr


def test_the_table_names_rows_whose_framework_has_no_built_in_form_of_the_precision():
    mixed = run("estimate", "--params", "1e9", "--gpus", "1", "--gpu-mem", "80")
    assert "single and ddp have no built-in mixed-bf16: the row is what it would take" in mixed.output
    amp = run("estimate", "--params", "1e9", "--gpus", "8", "--gpu-mem", "80", "--precision", "amp-bf16")
    assert "zero1, zero2 and zero3 have no built-in amp-bf16" in amp.output
    fsdp = run("estimate", "--params", "1e9", "--gpus", "8", "--gpu-mem", "80", "--strategy", "fsdp-full-shard")
    assert "built-in" not in fsdp.output


def test_the_command_prints_what_memplan_estimate_returns():
    """One API call per command: flags given explicitly are the axes the recommendation keeps."""
    import memplan
    from memplan import report

    result = memplan.estimate(model="llama-2-7b", gpus=8, gpu="a100-80gb", ac="full")
    printed = run(
        "estimate", "--model", "llama-2-7b", "--gpus", "8", "--gpu", "a100-80gb", "--ac", "full", "--format", "json"
    )
    assert result.decision.fixed == ("ac",)
    assert (
        printed.output
        == report.render_json(
            result.choice,
            list(result.estimates),
            result.applied,
            list(result.relative_throughputs),
            result.recommendation,
        )
        + "\n"
    )


def test_the_version_needs_no_installed_metadata(monkeypatch):
    """``memplan --version`` from a checkout that was never installed printed a traceback (click
    asked importlib.metadata for the distribution): it prints memplan.version's, which setup.cfg
    also reads, so the installed metadata says the same."""
    import importlib.metadata

    import memplan

    installed = importlib.metadata.version("memplan")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    result = CliRunner().invoke(main, ["--version"])
    assert (result.exit_code, result.output) == (0, f"memplan, version {memplan.__version__}\n")
    assert installed == memplan.__version__
