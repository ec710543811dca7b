"""The README's pasted command outputs are what the commands print now."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "readme_outputs.py"
BLOCK = "```\n$ memplan estimate --params 13e9 --gpu tpu-v9\n{}```\n"


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", str(path)], capture_output=True, text=True)


def test_readme_outputs_have_not_drifted():
    result = check(ROOT / "README.md")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_drifted_block_is_named_and_a_skipped_one_left_alone(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "Error:\n\n"
        + BLOCK.format("old output\n")
        + "\n<!-- readme-outputs: skip -->\n"
        + BLOCK.format("machine-dependent\n")
    )
    result = check(readme)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "README.md: the output of `$ memplan estimate --params 13e9 --gpu tpu-v9` "
        "drifted; run python scripts/readme_outputs.py --write"
    ]
    subprocess.run([sys.executable, str(SCRIPT), "--write", str(readme)], check=True, capture_output=True)
    text = readme.read_text()
    assert "old output" not in text and "Error: --gpu 'tpu-v9' is not a known GPU" in text
    assert "machine-dependent" in text and check(readme).returncode == 0
