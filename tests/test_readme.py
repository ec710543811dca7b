"""The pasted command outputs of the README and of the docs/ pages are what the commands print now."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "readme_outputs.py"
BLOCK = "```\n$ memplan estimate --params 13e9 --gpu tpu-v9\n{}```\n"


def check(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", *map(str, paths)], capture_output=True, text=True)


def script():
    spec = importlib.util.spec_from_file_location("readme_outputs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_and_every_docs_page_are_checked_by_default():
    pages = script().pages()
    assert pages[0] == ROOT / "README.md"
    assert pages[1:] == sorted((ROOT / "docs").glob("*.md"))
    blocks = [p for p in pages if "```\n$ memplan " in p.read_text(encoding="utf-8")]
    assert ROOT / "README.md" in blocks and len(blocks) > 1  # the pages hold pasted outputs too


def test_readme_and_docs_outputs_have_not_drifted():
    result = check()  # no path: the README and every docs/*.md page
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


def test_each_page_given_is_checked_and_named(tmp_path):
    fresh, stale = tmp_path / "fresh.md", tmp_path / "stale.md"
    stale.write_text(BLOCK.format("old output\n"))
    subprocess.run([sys.executable, str(SCRIPT), "--write", str(stale)], check=True, capture_output=True)
    fresh.write_text(stale.read_text())
    stale.write_text(BLOCK.format("old output\n"))
    result = check(fresh, stale)
    assert result.returncode == 1
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == ["stale.md"]
    assert check(fresh).returncode == 0
