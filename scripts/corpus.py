"""A fixed corpus of command lines, and their outputs: what a refactoring must leave byte-identical.

``tests/data/corpus/commands.txt`` holds command lines drawn once from the property suite's job
strategies (``--generate N`` redraws them, derandomized) plus the README's commands. ``--write OUT``
runs each in-process and writes one JSON line per command: the command, its exit code, the
SHA-256 of what it printed (stdout, NUL, stderr; the checkout's path written ``<checkout>``) and
the text itself; ``--check OUT`` reruns them and names each whose exit or output changed.

    python scripts/corpus.py --write corpus.jsonl | --check corpus.jsonl | --generate N
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

from click.testing import CliRunner

from memplan.cli import main as memplan

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ROOT / "tests" / "data" / "corpus" / "commands.txt"
CONFIGS = ROOT / "tests" / "data" / "corpus" / "configs"
README_COMMAND = re.compile(r"^\$ (memplan (?:estimate|explain|recommend|min-gpus) [^\n]*)$", re.MULTILINE)


def run(command: str) -> dict:
    """The command's exit code and the digest of everything it printed."""
    result = CliRunner().invoke(memplan, shlex.split(command)[1:], prog_name="memplan")
    # the checkout's own path (a calibration file's, in notes) is not part of the output
    printed = (result.stdout + "\0" + result.stderr).replace(f"{ROOT}/", "<checkout>/")
    digest = hashlib.sha256(printed.encode()).hexdigest()
    return {"command": command, "exit": result.exit_code, "sha256": digest, "printed": printed}


def generate(n: int) -> list[str]:
    """Up to n distinct command lines drawn (derandomized) from the property suite's job
    strategies, then the README's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sys.path.insert(0, str(ROOT / "tests"))
    import test_cli_properties
    from test_cli_properties import jobs

    test_cli_properties._CONFIG_DIR = CONFIGS  # the drawn config.json files, kept beside the commands

    drawn: list[str] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["estimate", "estimate", "explain", "recommend", "min-gpus"]), st.data())
    def collect(command, data):
        searched = command in ("recommend", "min-gpus") or data.draw(st.booleans())
        flags = data.draw(jobs(strategy="all" if searched else None))
        formats = {"estimate": ["table", "json", "csv"], "recommend": ["table", "json"], "min-gpus": ["table", "json"]}
        fmt = ["--format", data.draw(st.sampled_from(formats[command]))] if command in formats else []
        drawn.append(shlex.join(["memplan", command, *flags, *fmt]).replace(f"{ROOT}/", ""))

    collect()
    return list(dict.fromkeys(drawn + README_COMMAND.findall((ROOT / "README.md").read_text())))


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # the commands name their config files relative to the checkout
    if len(argv) != 2 or argv[0] not in ("--write", "--check", "--generate"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    if argv[0] == "--generate":
        COMMANDS.write_text("\n".join(generate(int(argv[1]))) + "\n")
        return 0
    commands = COMMANDS.read_text().splitlines()
    if argv[0] == "--write":
        with open(argv[1], "w") as out:
            for command in commands:
                out.write(json.dumps(run(command)) + "\n")
                out.flush()
        return 0
    before = {r["command"]: r for r in map(json.loads, Path(argv[1]).read_text().splitlines())}
    drifted = []
    for command in commands:
        now, then = run(command), before.get(command, {})
        if (now["exit"], now["sha256"]) != (then.get("exit"), then.get("sha256")):
            drifted.append(command)
            print(f"changed: {command}")
    print(f"{len(drifted)} of {len(commands)} changed")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
