"""``memplan calibrate``: run real short training jobs, record them, compare with memplan.

Parses, calls calibrate.runs / cluster / report, renders. Imports no torch: the runs
execute in child processes (``python -m calibrate``); reading records needs none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from memplan.cli import job_options, user_errors
from memplan.errors import MemplanError
from memplan.units import parse_bytes

from .records import MODES, WORKLOADS

RUN_ONLY_FLAGS = (
    "mode",
    "out",
    "steps",
    "warmup",
    "timeout_s",
    "resume",
    "workload",
    "grid",
    "max_host_mem",
    "nodes",
    "layers_scaled",
    "submit",
    "poll_s",
    "quiet",
    "module",
    "step",
    "units",
)


def _sweep_options(f):
    options = [
        click.option(
            "--out",
            required=True,
            type=click.Path(),
            help="Records file (.jsonl) to append to; for --mode cluster a directory.",
        ),
        click.option(
            "--steps", type=int, default=3, show_default=True, help="Training steps per run; the last one is measured."
        ),
        click.option(
            "--warmup",
            type=int,
            default=2,
            show_default=True,
            help="Steps before the measured one (at least 1: optimizer states exist).",
        ),
        click.option(
            "--timeout",
            "timeout_s",
            type=float,
            default=600.0,
            show_default=True,
            help="Seconds a run may take before its processes are killed (status timeout).",
        ),
        click.option("--resume", is_flag=True, help="Skip runs the records file already holds."),
        click.option(
            "--workload",
            type=click.Choice(WORKLOADS),
            default="native",
            show_default=True,
            help="native: calibrate's reference blocks; hf: the transformers model of the same shapes.",
        ),
        click.option(
            "--grid",
            type=click.Path(exists=True, dir_okay=False),
            help="YAML/JSON grid: flag name -> list of values; one run per combination.",
        ),
        click.option(
            "--max-host-mem",
            help="Host memory each run process may take beyond torch's own (RLIMIT_AS), e.g. 4GiB; "
            "a run that needs more is recorded as oom.",
        ),
        click.option("--nodes", type=int, help="Nodes (with --gpus-per-node): sets --gpus to their product."),
        click.option(
            "--layers-scaled",
            is_flag=True,
            help="For a model too big for this device: run it at full width with 2, 3 and 4 blocks and "
            "record the peak extrapolated to its real depth, with the fit's uncertainty.",
        ),
        click.option(
            "-q",
            "--quiet",
            is_flag=True,
            help="No progress (bar, per-run lines, header): only the summary and errors, for scripts.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _user_model_options(f):
    """A model built by its own code (``calibrate.usermodel``), traced: ``calibrate run`` only."""
    options = [
        click.option(
            "--module",
            metavar="PKG.MOD:FACTORY",
            help="With --mode trace: the model is what FACTORY() returns (an nn.Module; imported with the "
            "current directory on sys.path), traced instead of a memplan model; no estimate unless it "
            "carries a Hugging Face config memplan reads.",
        ),
        click.option(
            "--step",
            metavar="PKG.MOD:TRAIN_STEP",
            help="With --module: TRAIN_STEP(model, batch, optimizer) runs each whole step (the user's own loop).",
        ),
        click.option(
            "--units",
            metavar="ATTR.PATH",
            help="With --module: the nn.ModuleList whose items are the FSDP2 units; default: its largest.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _with_user_model(flags: dict, *, mode, machine, module, step, units, layers_scaled):
    """The user model the flags name, checked by building it in the runs' interpreter (its
    units, and its spec where memplan describes it), with the flags planned from; (None, flags)."""
    from dataclasses import replace

    from memplan.specs import ModelSpec

    from . import preflight
    from .runs import user_model

    user, flags = user_model(flags, mode=mode, module=module, step=step, units=units)
    if user is None:
        return None, flags, None
    if layers_scaled:
        raise MemplanError(f"--layers-scaled rebuilds memplan's models at other depths, not {user.name()}")
    found = preflight.check_user(user, machine=machine)
    user = replace(user, units=found.get("units"))
    if found.get("spec"):  # a module with a config memplan reads: estimated as any model
        user, flags = replace(user, no_estimate=""), flags | {"model": ModelSpec(**found["spec"])}
    return user, flags, found.get("no_units")


def _grid_flag_sets(ctx: click.Context, flags: dict, grid_path) -> list[dict]:
    """The command's flags, once per point of the grid (once without a grid)."""
    from .runs import grid_points, load_grid

    if grid_path is None:
        return [flags]
    params = {p.name: p for p in ctx.command.params if p.name not in RUN_ONLY_FLAGS}
    grid = {}
    for key, values in load_grid(grid_path).items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in params:
            raise MemplanError(
                f"grid key {key!r} is not a flag of memplan estimate; use one of: "
                + ", ".join(n.replace("_", "-") for n in params)
            )
        try:
            grid[name] = [v if v is None else params[name].type.convert(v, params[name], ctx) for v in values]
        except click.BadParameter as exc:
            raise MemplanError(f"grid key {key!r}: {exc.format_message()}") from None
    return [flags | point for point in grid_points(grid)]


def _apply_nodes(ctx: click.Context, flags: dict, nodes) -> dict:
    if nodes is None:
        return flags
    per_node = flags["gpus_per_node"]
    if nodes <= 0:
        raise MemplanError(f"--nodes must be a positive integer, got {nodes}")
    if per_node is None or per_node <= 0:
        raise MemplanError(f"--nodes {nodes} needs --gpus-per-node G (a positive integer), got {per_node}")
    gpus_given = ctx.get_parameter_source("gpus") != click.core.ParameterSource.DEFAULT
    if gpus_given and flags["gpus"] != nodes * per_node:
        raise MemplanError(f"--gpus {flags['gpus']} disagrees with --nodes {nodes} × --gpus-per-node {per_node}")
    return flags | {"gpus": nodes * per_node}


def _plan(ctx, flags, *, mode, steps, warmup, workload, grid, nodes, layers_scaled, user=None, no_units=None):
    from memplan.strategies import STRATEGIES

    from .runs import plan

    if layers_scaled and mode == "cluster":
        raise MemplanError("--layers-scaled runs here (--mode local or emulate), not as a cluster job")
    flag_sets = [_apply_nodes(ctx, f, nodes) for f in _grid_flag_sets(ctx, flags, grid)]
    runs, skipped = plan(
        flag_sets, mode=mode, steps=steps, warmup=warmup, workload=workload, layers_scaled=layers_scaled, user=user
    )
    if no_units and any(STRATEGIES[r.job.plan.strategy].framework == "fsdp" for r in runs):
        raise MemplanError(no_units)
    for reason, strategies in skipped.items():
        click.echo(f"skipping {', '.join(strategies)}: {reason} (--strategy all)", err=True)
    if not runs:
        raise MemplanError("no runs left to do: --strategy all left out every strategy (see above)")
    return runs


def _machine_and_device(ctx, flags: dict, mode: str):
    """What the runs' interpreter finds here, and the flags with --device defaulted to it
    (cluster mode: the cluster's, cuda, unless given)."""
    from . import preflight

    if mode == "cluster":
        return None, flags
    machine = preflight.probe()
    preflight.check_torch(machine)
    if ctx.get_parameter_source("device") == click.core.ParameterSource.DEFAULT:
        flags = flags | {"device": preflight.default_device(machine)}
    return machine, flags


def _header(ctx, runs, machine, *, mode: str, out) -> str:
    """What runs where: the device each run uses (and whether --device was defaulted), torch."""
    devices = ", ".join(machine.describe(d) for d in sorted({r.job.train.device for r in runs}))
    defaulted = ctx.get_parameter_source("device") == click.core.ParameterSource.DEFAULT
    return (
        f"calibrating {len(runs)} run(s), --mode {mode}, on {devices}"
        f"{' (--device not given: what this machine has)' if defaulted else ''}; records to {out}"
    )


def _write_cluster(runs, *, out, timeout_s, resume):
    from . import cluster

    plan = cluster.cluster_plan(runs, out_dir=out, timeout_s=timeout_s, resume=resume)
    cluster.write(plan)
    for i, (run, command) in enumerate(zip(plan.runs, cluster.torchrun_commands(plan))):
        click.echo(f"# run {i}: {run.describe()}")
        click.echo(command)
    click.echo(
        f"wrote {plan.runs_path} and {plan.script_path} ({len(runs)} run(s)); "
        f"submit with: sbatch {plan.script_path}; records go to {plan.records_path}",
        err=True,
    )


def _failure_line(run, record) -> str:
    from .progress import cause

    return f"{run.describe()}: {record['status']}: {cause(record)}"


def _show_progress():
    """Print a job's progress line when it changes (rewritten in place on a terminal)."""
    shown = {"line": None}
    tty = sys.stderr.isatty()

    def show(progress):
        line = progress.line()
        if line != shown["line"]:
            click.echo(f"\r\033[K{line}" if tty else line, err=True, nl=not tty)
            shown["line"] = line

    return show


def _submit_cluster(runs, *, out, timeout_s, resume, poll_s):
    from . import cluster, slurm
    from .runs import SweepSummary

    if poll_s <= 0:
        raise MemplanError(f"--poll must be a positive number of seconds, got {poll_s:g}")
    slurm.require("sbatch", "scontrol")
    plan = cluster.cluster_plan(runs, out_dir=out, timeout_s=timeout_s)
    if resume:
        plan = cluster.unsettled(plan)
    if not plan.indices:
        click.echo(f"all {len(plan.runs)} runs are recorded ok or oom in {plan.records_path}; nothing to submit")
        return
    cluster.write(plan)
    job_id = slurm.submit(plan.script_path)
    click.echo(
        f"submitted {plan.script_path} as Slurm job {job_id}: {len(plan.indices)} run(s); "
        f"output in {plan.out_dir / f'slurm-{job_id}.out'}",
        err=True,
    )
    try:
        state = cluster.follow(plan, job_id, poll_s=poll_s, on_progress=_show_progress())
    except KeyboardInterrupt:
        raise MemplanError(
            f"stopped following Slurm job {job_id}; it goes on (scancel {job_id} stops it), "
            f"its runs append to {plan.records_path}"
        ) from None
    if sys.stderr.isatty():
        click.echo(err=True)
    cluster.record_unfinished(plan, state)
    recorded = cluster.job_records(plan, job_id)
    summary = SweepSummary(num_planned=len(plan.runs), num_skipped_recorded=len(plan.runs) - len(plan.indices))
    for i in plan.indices:
        record = recorded[plan.runs[i].key]
        summary.statuses[record["status"]] += 1
        if record["status"] != "ok":
            click.echo(_failure_line(plan.runs[i], record), err=True)
    click.echo(f"{state.describe()}; {summary.line(plan.records_path)}")


def _run_sweep(runs, *, out, timeout_s, resume, max_host_mem_bytes, quiet) -> int:
    """Run the sweep with its progress, print its summary; the exit code (runs.EXIT_*)."""
    from .progress import SweepProgress, summary_table
    from .runs import sweep

    if Path(out).is_dir():
        raise MemplanError(f"--out {out!r} is a directory; local and emulate runs append to a .jsonl file")
    with SweepProgress(runs, quiet=quiet) as progress:
        summary = sweep(
            runs,
            out=out,
            timeout_s=timeout_s,
            resume=resume,
            max_host_mem_bytes=max_host_mem_bytes,
            on_start=progress.start,
            on_end=progress.end,
        )
    if any(record for _, record in progress.ended):
        click.echo(summary_table(progress.ended))
    click.echo(summary.line(out))
    return summary.exit_code


def _execute(
    ctx,
    *,
    mode,
    out,
    steps,
    warmup,
    timeout_s,
    resume,
    workload,
    grid,
    max_host_mem,
    nodes,
    layers_scaled,
    quiet=False,
    submit=False,
    poll_s=None,
    module=None,
    step=None,
    units=None,
    **flags,
):
    from . import preflight

    if timeout_s <= 0:
        raise MemplanError(f"--timeout must be a positive number of seconds, got {timeout_s:g}")
    machine, flags = _machine_and_device(ctx, flags, mode)
    user, flags, no_units = _with_user_model(
        flags, mode=mode, machine=machine, module=module, step=step, units=units, layers_scaled=layers_scaled
    )
    runs = _plan(
        ctx,
        flags,
        mode=mode,
        steps=steps,
        warmup=warmup,
        workload=workload,
        grid=grid,
        nodes=nodes,
        layers_scaled=layers_scaled,
        user=user,
        no_units=no_units,
    )
    preflight.check_runs(runs, machine=machine or preflight.Machine(python=sys.executable), mode=mode)
    if submit:
        _submit_cluster(runs, out=out, timeout_s=timeout_s, resume=resume, poll_s=poll_s)
        return
    if mode == "cluster":
        _write_cluster(runs, out=out, timeout_s=timeout_s, resume=resume)
        return
    max_host_mem_bytes = parse_bytes(max_host_mem, what="max-host-mem") if max_host_mem else None
    if not quiet:
        click.echo(_header(ctx, runs, machine, mode=mode, out=out), err=True)
    ctx.exit(
        _run_sweep(
            runs, out=out, timeout_s=timeout_s, resume=resume, max_host_mem_bytes=max_host_mem_bytes, quiet=quiet
        )
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def calibrate():
    """Real short training jobs (torch), measured and set beside memplan's estimate.

    Needs torch>=2.4: pip install ".[calibrate]". On a machine without a GPU, install torch's CPU
    build first (the extra would pull the CUDA one, ~3.5 GB), then the extra:

    \b
      pip install torch --index-url https://download.pytorch.org/whl/cpu
      pip install ".[calibrate]"
    """


@calibrate.command()
@job_options
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="local",
    show_default=True,
    help="local: N processes here (gloo on CPU, nccl on GPUs); emulate: one rank on a fake process "
    "group of N; cluster: write a Slurm script and print torchrun commands (dry run); trace: emulate "
    "under fake tensors, at full size with no bytes allocated (FSDP2, DDP, FSDP2 × TP).",
)
@_sweep_options
@_user_model_options
@click.pass_context
@user_errors
def run(ctx, **params):
    """Run, measure and record one job per strategy (or per grid point).

    Checked first (exit 2, one line): torch importable and new enough, a CUDA device for --device
    cuda (which defaults to what this machine has), enough devices for --mode local, a precision
    the strategy runs natively, no DeepSpeed strategy. Each run prints a line as it ends, then a
    summary table. Exit 0: every planned run ok; 3: some were not; 4: none was. Every run is
    recorded either way.

    Example: memplan calibrate run --arch llama --layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 256
    --seq-len 32 --micro-batch 2 --precision fp32 --device cpu --gpus 2 --mode emulate --out runs.jsonl
    """
    _execute(ctx, **params)


def _device_defaults_to_this_machine(command: click.Command) -> click.Command:
    """``calibrate run``'s --device: not given, what this machine has (calibrate.preflight)."""
    option = next(p for p in command.params if p.name == "device")
    assert isinstance(option, click.Option)
    option.show_default = "what this machine has: cuda if torch sees a device, else cpu"
    return command


_device_defaults_to_this_machine(run)


@calibrate.command()
@job_options
@_sweep_options
@click.option(
    "--submit",
    is_flag=True,
    help="Submit the script with sbatch and follow the job until it ends; each run it leaves "
    "unfinished is recorded (cancelled, timeout, failed) with the job id. With --resume: only the "
    "runs without an ok or oom record.",
)
@click.option(
    "--poll",
    "poll_s",
    type=float,
    default=5.0,
    show_default=True,
    help="With --submit: seconds between two looks at the job (scontrol show job).",
)
@click.pass_context
@user_errors
def cluster(ctx, **params):
    """Write DIR/calibrate.sbatch and print the torchrun commands (same as run --mode cluster);
    with --submit, run it on Slurm and gather the records in DIR/records.jsonl.

    Example: memplan calibrate cluster --model llama-2-7b --strategy fsdp-full-shard --nodes 2
    --gpus-per-node 8 --out calib/ --submit
    """
    _execute(ctx, mode="cluster", **params)


@calibrate.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(("table", "json", "csv")), default="table", show_default=True)
@user_errors
def report(files, fmt):
    """Measured against estimated peak memory, per run, with a summary.

    Example: memplan calibrate report runs.jsonl --format json
    """
    from . import records
    from .report import render_csv, render_json, render_table, rows, summary_lines

    table = rows(records.read(files, warn=lambda message: click.echo(f"warning: {message}", err=True)))
    if fmt == "json":
        click.echo(render_json(table))
    elif fmt == "csv":
        click.echo(render_csv(table), nl=False)
        for line in summary_lines(table):
            click.echo(line, err=True)
    else:
        click.echo(render_table(table))


@calibrate.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="Corrections file to write (JSON), for memplan estimate --calibration.",
)
@user_errors
def fit(files, output):
    """Fit per-device corrections from ok records; print the fit's quality.

    Example: memplan calibrate fit runs.jsonl -o corrections.json
    """
    from . import records
    from .fit import TERMS, fit_records

    ok = records.read(files, warn=lambda m: click.echo(f"warning: {m}", err=True))
    unestimated = [r for r in ok if r["status"] == "ok" and not r.get("estimate")]
    if unestimated:
        why = unestimated[0].get("estimate_error") or "no estimate recorded"
        click.echo(
            f"skipping {len(unestimated)} ok record(s) without an estimate, nothing to fit against (first: {why})",
            err=True,
        )
    calibration = fit_records(ok, sources=files)
    if not calibration.corrections:
        raise MemplanError(f"no ok records with an estimate in {', '.join(files)}: nothing to fit")
    try:
        calibration.save(output)
    except OSError as exc:
        raise MemplanError(f"-o {output!r} cannot be written: {exc.strerror or exc}") from None
    for c in calibration.corrections:
        fitted = ", ".join(
            f"offset {c.offset_bytes:+,} B" if t == "offset" else f"{t} ×{c.scales[t]:.4f}" for t in c.terms or ()
        )
        click.echo(
            f"{c.device} (torch {c.torch_version}), {c.num_records} records: {len(c.terms or ())} of "
            f"{len(TERMS)} free parameters fitted" + (f" ({fitted})" if fitted else "; memplan's arithmetic kept")
        )
        click.echo(
            f"  held out (each record judged by a fit made without it): median |error| "
            f"{c.before_median_abs_pct:.3f} % unfitted -> {c.after_median_abs_pct:.3f} %; band ±{c.residual_pct:.3f} %"
        )
        for note in c.notes:
            click.echo(f"  {note}")
        for t in c.throughput:
            mfu = f", MFU {t.mfu:.1%}" if t.mfu is not None else ""
            hidden = (
                f", {t.exposed_comm_fraction:.0%} of modelled communication exposed"
                if t.exposed_comm_fraction is not None
                else ""
            )
            click.echo(
                f"  {t.strategy}: {t.achieved_flops / 1e9:,.1f} GFLOP/s achieved{mfu}{hidden} ({t.num_records} runs)"
            )
        if c.context_bytes is not None:
            per = "tabled" if c.communicator_bytes is None else f"{c.communicator_bytes / 2**20:,.0f} MiB"
            click.echo(
                f"  outside the allocator: CUDA context {c.context_bytes / 2**20:,.0f} MiB, "
                f"per communicator {per} (the allocator's reserved is replayed, not fitted)"
            )
    click.echo(f"wrote {output}")


def _register_with_memplan() -> None:
    """memplan.cli adds this group when it is imported first; when this module is, memplan.cli
    found it half-initialised, so add it here."""
    from memplan import cli as memplan_cli

    if "calibrate" not in memplan_cli.main.commands:
        memplan_cli.main.add_command(calibrate)


_register_with_memplan()
