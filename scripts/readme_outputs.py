"""The pasted command outputs of the README and of every page under docs/, regenerated from the code.

A fenced block whose first line is ``$ memplan ...`` holds that command and its output
(stdout and stderr, as a terminal shows them). ``--write`` reruns every such block's command
in-process and rewrites the block; ``--check`` exits 1 naming the blocks that drifted.
A block whose output depends on the machine or the time is marked by the line
``<!-- readme-outputs: skip -->`` right above its fence, and left alone.

With no path, README.md and every docs/*.md page are read; given paths, only those.

    python scripts/readme_outputs.py --check | --write [PAGE.md ...]
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from click.testing import CliRunner

from memplan.cli import main as memplan

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP = "<!-- readme-outputs: skip -->"
# a fence, the command line, the pasted output (possibly empty), the closing fence
BLOCK = re.compile(
    r"(?P<head>(?P<mark>^[^\n]*\n)?```\n\$ (?P<command>memplan [^\n]*)\n)(?P<output>.*?)^```$", re.MULTILINE | re.DOTALL
)


def run(command: str) -> str:
    """What ``command`` prints, stdout and stderr in order, as a page shows it."""
    result = CliRunner().invoke(memplan, shlex.split(command)[1:], prog_name="memplan")
    if result.exception and not isinstance(result.exception, SystemExit):
        raise RuntimeError(f"a pasted command failed: {command}") from result.exception
    return result.output


def regenerate(text: str) -> tuple[str, list[str]]:
    """The page with every block's output rerun, and the commands whose output changed."""
    drifted = []

    def fresh(match: re.Match) -> str:
        if (match["mark"] or "").strip() == SKIP:
            return match[0]
        output = run(match["command"])
        if output != match["output"]:
            drifted.append(match["command"])
        return match["head"] + output + "```"

    return BLOCK.sub(fresh, text), drifted


def pages() -> list[Path]:
    """The pages checked by default: the README, then docs/*.md in name order."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def shown(path: Path) -> str:
    """A page's name as the messages give it: relative to the checkout, else its file name."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path.name


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("--check", "--write"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    paths = [Path(arg) for arg in argv[1:]] or pages()
    failed = False
    for path in paths:
        text, drifted = regenerate(path.read_text(encoding="utf-8"))
        if argv[0] == "--write":
            path.write_text(text, encoding="utf-8")
            print(f"{shown(path)}: rewrote {len(drifted)} block(s)" + "".join(f"\n  $ {c}" for c in drifted))
            continue
        for command in drifted:
            print(f"{shown(path)}: the output of `$ {command}` drifted; run python scripts/readme_outputs.py --write")
        failed = failed or bool(drifted)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
