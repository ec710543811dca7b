"""Tables print as tabulate's "simple" format draws them, every cell as written (no number
parsing); the planner's commands never import tabulate (calibrate's report does)."""

import subprocess
import sys

from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from tabulate import tabulate

from memplan.cli import main
from memplan.report import simple_table


def _modules_after(args) -> set[str]:
    code = (
        "import sys; from memplan.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sys.modules))"
    )
    return set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split())


def test_the_estimate_table_keeps_cells_as_written_and_left_aligned():
    out = CliRunner().invoke(main, ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]).output
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("strategy"))
    header, rule, first = lines[at : at + 3]
    widths = [len(dashes) for dashes in rule.split("  ")]
    starts = [sum(widths[:i]) + 2 * i for i in range(len(widths))]
    assert [header[x : x + w].strip() for x, w in zip(starts, widths)][:2] == ["strategy", "peak in"]
    cells = [first[x : x + w] for x, w in zip(starts, widths)]
    # left-aligned: no cell starts with padding; a GiB cell keeps its two decimals ("4.00", not "4")
    assert all(not c.startswith(" ") for c in cells if c.strip())
    assert all("." in c for c in cells[2:6])


def test_no_command_of_the_planner_imports_tabulate():
    assert "tabulate" not in _modules_after(["--help"])
    assert "tabulate" not in _modules_after(["estimate", "--params", "13e9", "--gpus", "8", "--format", "json"])
    assert "tabulate" not in _modules_after(["estimate", "--params", "13e9", "--gpus", "8"])


# what the table's cells are made of: strategy names, GiB, "yes"/"NO", the seeds' claims
# ("0.75–0.85, 0.80"), calibrated bands ("61.20 ± 0.80"), offload suffixes, and spaces
_CELL = st.text(alphabet="abcdefghijklmnopqrstuvwxyzNOS0123456789.-+,–±× ", max_size=24)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 9).flatmap(
        lambda n: st.tuples(
            st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=14), min_size=n, max_size=n),
            st.lists(st.lists(_CELL, min_size=n, max_size=n), min_size=1, max_size=10),
        )
    )
)
def test_the_table_is_tabulates_simple_format_character_for_character(table):
    headers, rows = table
    headers = [h.strip() or "x" for h in headers]  # the table's headers are words
    assert simple_table(rows, headers) == tabulate(rows, headers, tablefmt="simple", disable_numparse=True)


def test_the_calibration_report_is_a_markdown_table_of_the_records_as_written(shipped_cpu_records):
    from calibrate import report

    table = report.rows(shipped_cpu_records)
    lines = report.render_table(table).splitlines()[: len(table) + 2]
    assert lines[0].startswith("| id ") and set(lines[1]) == {"|", "-"}
    widths = {len(line) for line in lines}
    assert len(widths) == 1  # every row padded to the same columns
    first = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert first[:3] == [table[0]["id"], table[0]["run"], table[0]["status"]]
    assert first[5] == report._pct(table[0]["error_pct"])  # "-0.01", signed and two decimals, not parsed
