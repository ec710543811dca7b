"""Figures of the estimates (matplotlib, the optional ``plot`` extra; Agg backend, no display).

    fig = memplan.plot_breakdown(memplan.estimate(params=13e9, gpus=8, gpu_mem=80), "/tmp/breakdown.png")
    fig = memplan.plot_fits(params=[1e9, 7e9, 70e9], gpus=[1, 8, 64], gpu_mem=80)
    fig = memplan.plot_calibration([{"measured_bytes": ..., "estimated_bytes": ..., "label": "ddp"}])

Each returns the Figure and, given ``path``, also writes it there (PNG, or any format
matplotlib infers from the suffix). Bytes are plotted in GiB.
"""

from __future__ import annotations

from .breakdown import Component
from .errors import MemplanError
from .units import GIB

# one colour per stacked layer, in stacking order; overhead sits on top of allocated
LAYERS = [c.value for c in Component] + ["overhead"]
COLOURS = {
    "params": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "buffers": "#8172b3",
    "overhead": "#b3b3b3",
}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MemplanError("plots need matplotlib: pip install 'memplan[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    if path is not None:
        try:
            fig.savefig(path, dpi=120, bbox_inches="tight")
        except (OSError, ValueError) as exc:
            raise MemplanError(f"cannot write the figure to {str(path)!r}: {exc}") from None
    return fig


def plot_breakdown(result, path=None):
    """Stacked bars of per-GPU GiB by component, one bar per strategy, with the card's capacity
    (dashed) and the usable memory after headroom (dotted). ``result``: what ``memplan.estimate``
    returns, or a list of ``Estimate``."""
    plt = _pyplot()
    estimates = list(getattr(result, "estimates", result))
    if not estimates:
        raise MemplanError("plot_breakdown needs at least one estimate")
    labels = [f"{e.job.plan.strategy}\n{e.phase}" for e in estimates]
    layers = {name: [_layer_bytes(e, name) / GIB for e in estimates] for name in LAYERS}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(estimates) + 3.0), 5.0), layout="constrained")
    bottom = [0.0] * len(estimates)
    for name in LAYERS:
        ax.bar(labels, layers[name], bottom=bottom, color=COLOURS[name], label=name, width=0.7)
        bottom = [b + v for b, v in zip(bottom, layers[name])]
    cluster = estimates[0].job.cluster
    ax.axhline(
        cluster.gpu_mem_bytes / GIB,
        color="black",
        linestyle="--",
        linewidth=1.2,
        label=f"{cluster.gpu_name} capacity {cluster.gpu_mem_bytes / GIB:.0f} GiB",
    )
    ax.axhline(
        cluster.usable_bytes / GIB,
        color="black",
        linestyle=":",
        linewidth=1.0,
        label=f"usable ({cluster.headroom:.0%} headroom)",
    )
    ax.set_ylim(0, 1.08 * max(max(bottom), cluster.gpu_mem_bytes / GIB))
    ax.set_ylabel("per-GPU memory at the peak (GiB)")
    job = estimates[0].job
    ax.set_title(
        f"{job.model.name}: {job.cluster.gpus} GPUs, {job.train.precision}, "
        f"AC {job.train.activation_checkpointing}, micro-batch {job.train.micro_batch}, "
        f"seq {job.train.seq_len}",
        fontsize=10,
    )
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def _layer_bytes(est, name: str) -> int:
    return est.overhead_bytes if name == "overhead" else est.by_component[Component(name)]


def plot_fits(*, params, gpus, path=None, **sweep_kwargs):
    """Which (model size × GPU count) cells fit, one panel per strategy, from ``memplan.sweep``.

    ``params`` and ``gpus`` are the axes (lists); every other keyword goes to the sweep and must
    hold one value (``gpu_mem=80, micro_batch=1, precision="mixed-bf16", ...``). Each cell
    shows the per-GPU total in GiB; green fits, red does not."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    from .grid import sweep

    swept = [
        k for k, v in sweep_kwargs.items() if isinstance(v, (list, tuple, range)) and len(v) != 1 and k != "strategy"
    ]
    if swept:
        raise MemplanError(f"plot_fits sweeps params and gpus only; give one value for: {', '.join(swept)}")
    params, gpus = _values(params), _values(gpus)
    grid = sweep(params=params, gpus=gpus, **sweep_kwargs)
    # a strategy for one GPU ("single") has no panel on a GPU axis it cannot span
    strategies = [s for s in dict.fromkeys(grid.strategy) if grid[grid.strategy == s].gpus.nunique() == len(gpus)]
    cols = min(4, len(strategies))
    rows = -(-len(strategies) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols + 0.6, 2.9 * rows + 0.8), squeeze=False, layout="constrained"
    )
    size_labels = [f"{p / 1e9:.3g}B" for p in sorted(grid.params.unique())]
    for ax, strategy in zip(axes.flat, strategies):
        part = grid[grid.strategy == strategy]
        fits = part.pivot_table(index="params", columns="gpus", values="fits", aggfunc="first").sort_index()
        total = part.pivot_table(index="params", columns="gpus", values="total_bytes", aggfunc="first").sort_index()
        ax.imshow(
            fits.to_numpy(dtype=float),
            cmap=ListedColormap(["#e8a0a0", "#9fd49f"]),
            vmin=0,
            vmax=1,
            origin="lower",
            aspect="auto",
        )
        for i, row in enumerate(total.to_numpy()):
            for j, num_bytes in enumerate(row):
                ax.text(j, i, f"{num_bytes / GIB:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(strategy, fontsize=9)
        ax.set_xticks(range(len(fits.columns)), [str(g) for g in fits.columns], fontsize=7)
        ax.set_yticks(range(len(fits.index)), size_labels, fontsize=7)
        ax.set_xlabel("GPUs", fontsize=8)
        ax.set_ylabel("model parameters", fontsize=8)
    for ax in list(axes.flat)[len(strategies) :]:
        ax.set_visible(False)
    first = grid.iloc[0]
    fig.suptitle(
        f"fits in {_usable_gib(grid)}: per-GPU total (GiB) per cell, green fits — "
        f"{first.precision}, AC {first.activation_checkpointing}, micro-batch {first.micro_batch}, "
        f"seq {first.seq_len}",
        fontsize=9,
    )
    return _save(fig, path)


def _values(axis) -> list:
    return list(axis) if isinstance(axis, (list, tuple, range)) else [axis]


def _usable_gib(grid) -> str:
    usable = (grid.total_bytes + grid.headroom_bytes).iloc[0]
    return f"{usable / GIB:.1f} GiB usable"


def plot_calibration(records, path=None):
    """Measured against estimated peak bytes, one point per calibration record, with y = x.

    ``records``: dicts with ``measured_bytes`` and ``estimated_bytes`` (integers), and optionally
    ``label`` (a legend group, e.g. the strategy). Records whose measurement is missing (an
    OOM or failed run) are skipped."""
    plt = _pyplot()
    points = [r for r in records if r.get("measured_bytes") is not None and r.get("estimated_bytes") is not None]
    if not points:
        raise MemplanError("plot_calibration needs records with 'measured_bytes' and 'estimated_bytes'")
    fig, ax = plt.subplots(figsize=(6.5, 5.5), layout="constrained")
    groups: dict[str, list] = {}
    for record in points:
        groups.setdefault(str(record.get("label", "run")), []).append(record)
    for label, group in groups.items():
        ax.scatter(
            [r["estimated_bytes"] / GIB for r in group],
            [r["measured_bytes"] / GIB for r in group],
            label=label,
            s=28,
            alpha=0.85,
        )
    top = 1.05 * max(max(r["measured_bytes"], r["estimated_bytes"]) for r in points) / GIB
    ax.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=1.0, label="measured = estimated")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("estimated peak (GiB)")
    ax.set_ylabel("measured peak (GiB)")
    ax.set_title(f"calibration: {len(points)} runs", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)
