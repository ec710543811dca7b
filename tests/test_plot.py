"""Each figure renders a non-empty PNG with the bars, points and capacity line it should have."""

import pytest

pytest.importorskip("matplotlib")

import memplan
from memplan.breakdown import Component
from memplan.errors import MemplanError
from memplan.units import GIB

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png(path) -> bytes:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    return data


def test_breakdown_bars_stack_to_total_under_a_capacity_line(tmp_path):
    result = memplan.estimate(params=13e9, gpus=8, gpu="a100-80gb", calibration=None)
    fig = memplan.plot_breakdown(result, tmp_path / "breakdown.png")
    _png(tmp_path / "breakdown.png")
    ax = fig.axes[0]
    layers = len(Component) + 1  # the components and the overhead on top
    assert len(ax.patches) == layers * len(result.estimates)
    tops = [
        max(p.get_y() + p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 0.01)
        for i in range(len(result.estimates))
    ]
    assert tops == pytest.approx([e.total_bytes / GIB for e in result.estimates])
    capacity = result.estimates[0].job.cluster.gpu_mem_bytes / GIB
    usable = result.estimates[0].job.cluster.usable_bytes / GIB
    assert sorted(line.get_ydata()[0] for line in ax.lines) == pytest.approx([usable, capacity])
    assert "GiB" in ax.get_ylabel()


def test_fits_map_has_one_panel_per_strategy_and_a_cell_per_configuration(tmp_path):
    fig = memplan.plot_fits(
        params=[1e9, 7e9, 70e9], gpus=[1, 8, 64], gpu_mem=80, strategy=["ddp", "zero3"], path=tmp_path / "fits.png"
    )
    _png(tmp_path / "fits.png")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["ddp", "zero3"]
    grid = memplan.sweep(params=[1e9, 7e9, 70e9], gpus=[1, 8, 64], gpu_mem=80, strategy=["ddp", "zero3"])
    for ax in panels:
        cells = ax.images[0].get_array()
        assert cells.shape == (3, 3) and len(ax.texts) == 9
        expected = grid[grid.strategy == ax.get_title()].pivot(index="params", columns="gpus", values="fits")
        assert (cells.astype(bool) == expected.to_numpy()).all()
    with pytest.raises(MemplanError, match="micro_batch"):
        memplan.plot_fits(params=[7e9], gpus=[8], micro_batch=[1, 2])


def test_calibration_scatter_has_a_point_per_measured_record(tmp_path):
    records = [
        {"measured_bytes": 3 * GIB, "estimated_bytes": 3 * GIB + 2**28, "label": "ddp"},
        {"measured_bytes": 9 * GIB, "estimated_bytes": 8 * GIB, "label": "fsdp-full-shard"},
        {"measured_bytes": 5 * GIB, "estimated_bytes": 5 * GIB, "label": "ddp"},
        {"measured_bytes": None, "estimated_bytes": 40 * GIB, "label": "zero3"},
    ]  # an OOM run
    fig = memplan.plot_calibration(records, tmp_path / "calibration.png")
    _png(tmp_path / "calibration.png")
    ax = fig.axes[0]
    points = sorted(tuple(float(v) for v in xy) for c in ax.collections for xy in c.get_offsets())
    assert points == [(3.25, 3.0), (5.0, 5.0), (8.0, 9.0)]
    assert "GiB" in ax.get_xlabel() and "GiB" in ax.get_ylabel()
    with pytest.raises(MemplanError, match="measured_bytes"):
        memplan.plot_calibration([{"label": "x"}])


def test_estimate_plot_flag_writes_the_breakdown_and_rejects_a_bad_path(tmp_path):
    from click.testing import CliRunner

    from memplan.cli import main

    out = tmp_path / "breakdown.png"
    result = CliRunner().invoke(
        main, ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80", "--plot", str(out)]
    )
    assert result.exit_code == 0 and "Recommendation" in result.output
    _png(out)
    bad = CliRunner().invoke(main, ["estimate", "--params", "13e9", "--plot", str(tmp_path / "no" / "b.png")])
    assert bad.exit_code != 0 and "cannot write the figure" in bad.output
