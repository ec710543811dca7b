"""The GPU calibration campaign of issue 16 on this machine's CUDA device, in one command.

    python benchmarks/gpu_campaign.py --dry-run                  # the runs, their estimated time, the total
    python benchmarks/gpu_campaign.py --out campaign_out --resume --budget-s 480
    python benchmarks/gpu_campaign.py --out validation/records/gpu/h200-torch2.11.0-cu130 \
        --report tables/calibration/h200-torch2.11.0-cu130.jsonl   # the accuracy table

Every run is a child process killed past its own timeout; its record (or its OOM, crash or
timeout) is appended to OUT/records.jsonl before the next starts. ``--budget-s`` stops
starting runs that would end past that many seconds of this call: run the same command
again with ``--resume`` to go on. validation/records/gpu_campaign.md says how to run it on a lent device
and how its records are shipped. The plan lives in validation/campaign.py.
"""

import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memplan.errors import MemplanError
from validation import campaign


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_dir", default="campaign_out", show_default=True, help="Folder of the records.")
@click.option("--only", help="Run only the cases whose name matches this regular expression.")
@click.option("--resume", is_flag=True, help="Skip the runs and probes OUT already records.")
@click.option("--dry-run", is_flag=True, help="List the runs and their estimated time; run nothing.")
@click.option(
    "--gpu", default="auto", show_default=True, help="tables/gpus.csv name the plan is for (auto: this device)."
)
@click.option("--budget-s", type=float, help="Seconds this call may take (stop starting runs beyond it).")
@click.option("--no-probes", is_flag=True, help="Leave out the CUDA context and cuBLAS probes.")
@click.option(
    "--ship",
    "ship_to",
    type=click.Path(file_okay=False),
    help="Instead of running: copy OUT's records into TABLES/calibration/ and fit their corrections.",
)
@click.option(
    "--report",
    "report_from",
    type=click.Path(exists=True, dir_okay=False),
    help="Instead of running: the accuracy table of a shipped record set (Markdown); "
    "--out names the folder of its snapshot traces.",
)
def main(out_dir, only, resume, dry_run, gpu, budget_s, no_probes, ship_to, report_from):
    """Plan, list or run the GPU calibration campaign."""
    if report_from:
        found = campaign.records.read([Path(report_from)])
        click.echo(campaign.report(found, campaign.replayed_traces(out_dir)), nl=False)
        return
    if ship_to:
        try:
            written = campaign.ship(out_dir, ship_to)
        except MemplanError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo("wrote " + " and ".join(map(str, written)))
        return
    try:
        gpu = campaign.detect_gpu() if gpu == "auto" else gpu
        cases, left_out = campaign.design(gpu)
        cases = campaign.select(cases, only)
    except MemplanError as exc:
        raise click.ClickException(str(exc)) from None
    probes = () if no_probes or only else campaign.PROBES
    if dry_run:
        lines, total = campaign.dry_run(cases, probes=probes, slice_s=budget_s or campaign.SLICE_S)
        click.echo(f"plan for {gpu}:")
        click.echo("\n".join(lines))
        for reason in left_out:
            click.echo(f"left out: {reason}")
        if total > campaign.BUDGET_S:
            raise click.ClickException(f"the plan's {total:.0f} s exceed the {campaign.BUDGET_S} s budget")
        return
    progress = campaign.sweep(
        cases, Path(out_dir), gpu=gpu, resume=resume, probes=probes, budget_s=budget_s, say=click.echo
    )
    click.echo(
        f"{len(progress.done)} run now, {len(progress.skipped)} already recorded, {len(progress.left)} left "
        f"for a next call (--resume): records in {Path(out_dir) / campaign.RECORDS}"
    )


if __name__ == "__main__":
    main()
