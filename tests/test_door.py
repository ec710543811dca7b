"""The product as a new user meets it at the door: the README's first command, and each input that
was silently wrong or ignored, through the command itself (a fresh `python -m memplan.cli`
process on this tree's code): a one-line error (exit 2, no traceback) or an assumption stated
in the header."""

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import memplan
from memplan.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def memplan_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def refused(*args: str) -> str:
    """The one line a refused command prints (exit 2, nothing on stdout, no traceback)."""
    proc = memplan_cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("Error: ")
    return line


def _first_command() -> list[str]:
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    install, command = first_block.splitlines()[0].split(" && ")
    assert install == "pip install ."
    return command.split()


def test_the_readmes_first_command_prints_the_table(tmp_path):
    command = _first_command()
    assert command[0] == "memplan"
    proc = memplan_cli(*command[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model    assumed llama-style-13B (inferred)")
    rows = {line.split()[0] for line in lines if line.split() and line.split()[0] in memplan.STRATEGIES}
    assert rows == {s for s in memplan.STRATEGIES if s != "single"}  # every strategy on 8 GPUs
    assert any(line.startswith("Recommendation (speed): ") for line in lines)


def test_the_readmes_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    bash_blocks = [block.split("```", 1)[0] for block in README.split("```bash\n")[1:]]
    [test_block] = [block for block in bash_blocks if "scripts/check.sh" in block]
    assert test_block.rstrip().endswith("&& scripts/check.sh")
    assert re.search(r"^scripts/check\.sh\b", ci, re.MULTILINE)
    assert re.search(r"^time bash \.ci/wheel$", ci, re.MULTILINE)
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    test_extras = cfg["options.extras_require"]["test"].split()
    assert {r.split("==")[0] for r in test_extras if "==" in r} >= {"ruff", "mypy"}  # pinned exactly
    # one -q (setup.cfg's) keeps pytest's closing "N passed" line, which CI's runner reads
    assert "-q" in cfg["tool:pytest"]["addopts"].split()
    assert " -q" not in (ROOT / "scripts" / "check.sh").read_text(encoding="utf-8")


def test_gpt2_beyond_its_positions_is_refused():
    line = refused("estimate", "--model", "gpt2", "--seq-len", "4096")
    assert line == "Error: seq-len 4096 exceeds gpt2's 1024 learned positions; give --seq-len ≤ 1024"


def test_gpt2_default_sequence_is_cut_to_its_positions_and_said():
    proc = memplan_cli("estimate", "--model", "gpt2", "--gpu", "h100", "--strategy", "ddp", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["inputs"]["train"]["seq_len"] == 1024
    assert data["inputs"]["assumptions"] == [
        "seq-len 1024: gpt2's learned positions (the default 2048 is beyond them)",
        "gpu h100 read as h100-sxm; also in tables/gpus.csv: h100-pcie",
    ]
    table = memplan_cli("estimate", "--model", "gpt2", "--gpu", "h100", "--strategy", "ddp").stdout.splitlines()
    assert "training seq 1024 × micro-batch 1" in table[1]
    assert "assumed  gpu h100 read as h100-sxm; also in tables/gpus.csv: h100-pcie" in table


def test_lora_settings_without_lora_are_refused():
    line = refused("estimate", "--model", "gpt2", "--seq-len", "512", "--lora-rank", "64")
    assert line == "Error: --lora-rank applies to --finetune lora or qlora only, got --finetune full"


def test_a_node_of_zero_gpus_is_refused():
    line = refused("estimate", "--params", "7e9", "--gpus", "8", "--gpus-per-node", "0")
    assert line == "Error: gpus-per-node must be a positive integer, got 0"


def test_float8_needs_fp8_tensor_cores():
    line = refused("estimate", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--float8")
    assert line.startswith("Error: a100-80gb has no FP8 tensor cores (tables/gpus.csv), so no float8 training")
    assert "--float8" in line


def test_explain_takes_one_strategy():
    line = refused("explain", "--model", "gpt2", "--strategy", "all")
    assert "Invalid value for '--strategy': 'all' is not one of 'single', 'ddp'" in line


def test_min_gpus_refuses_a_gpu_count():
    line = refused("min-gpus", "--params", "7e9", "--gpus", "8")
    assert line.startswith("Error: min-gpus searches the number of GPUs itself: --gpus 8 does not apply")
    with pytest.raises(InputError, match="gpus 8 does not apply"):  # the API's request, as the command's
        memplan.min_gpus(memplan.Request.of(params=7e9, gpus=8))


def test_config_folder_is_read_as_its_config_json(tmp_path):
    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1000, "n_positions": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--gpus", "1", "--strategy", "single", "--seq-len", "256", "--format", "json", "--calibration", "none"]
    from_folder = memplan_cli("estimate", "--config", str(tmp_path), *args)
    from_file = memplan_cli("estimate", "--config", str(tmp_path / "config.json"), *args)
    assert from_folder.returncode == 0, from_folder.stderr
    assert json.loads(from_folder.stdout)["estimates"] == json.loads(from_file.stdout)["estimates"]


@pytest.mark.parametrize("params,why", [("abc", "not a count"), ("10", "out of range"), ("1e20", "out of range")])
def test_every_bad_parameter_count_states_one_range(params, why):
    line = refused("estimate", "--params", params)
    assert line == f"Error: params {params!r} is {why}; accepted: 1e+06 to 1e+14, written as 13e9, 13B, 7.2b or 350M"
