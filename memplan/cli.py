"""The `memplan` command: parse flags, call the library, render. Nothing else."""
from __future__ import annotations

import functools

import click

from . import specs
from .errors import MemplanError
from .strategies import STRATEGIES


class InputError(click.ClickException):
    """A bad value: one line on stderr, exit code 2, no traceback."""

    exit_code = 2


def _choice(values):
    return click.Choice(list(values), case_sensitive=False)


MODEL_OPTIONS = [
    click.option("--params", help="Parameter count (13e9, 13B, 7.2b): memplan assumes a llama-style architecture."),
    click.option("--model", "model", help="A preset from tables/models.csv (e.g. llama-2-13b)."),
    click.option("--config", type=click.Path(dir_okay=False), help="A Hugging Face config.json."),
    click.option("--arch", type=_choice(specs.ARCHS), help="Explicit architecture family (with the shape flags)."),
    click.option("--layers", type=int), click.option("--hidden", type=int), click.option("--heads", type=int),
    click.option("--kv-heads", type=int), click.option("--ffn", type=int), click.option("--vocab", type=int),
]
TRAIN_OPTIONS = [
    click.option("--seq-len", type=int, default=2048, show_default=True),
    click.option("--micro-batch", type=int, default=1, show_default=True),
    click.option("--grad-accum", type=int, default=1, show_default=True),
    click.option("--precision", type=_choice(specs.PRECISIONS), default="mixed-bf16", show_default=True),
    click.option("--reduce-dtype", type=_choice(specs.REDUCE_DTYPES), help="Gradient reduction dtype."),
    click.option("--optimizer", type=_choice(specs.OPTIMIZERS), default="adamw", show_default=True),
    click.option("--optimizer-impl", type=_choice(specs.OPTIMIZER_IMPLS),
                 help="foreach | fused | single [default: foreach on cuda, single on cpu, as torch]"),
    click.option("--ac", type=_choice(specs.AC_MODES), default="none", show_default=True,
                 help="Activation checkpointing."),
    click.option("--attention", type=_choice(specs.ATTENTIONS), default="sdpa", show_default=True),
    click.option("--device", type=_choice(specs.DEVICES), default="cuda", show_default=True,
                 help="cpu estimates what the same job allocates on CPU (no CUDA-side overhead)."),
]
CLUSTER_OPTIONS = [
    click.option("--gpus", type=int, default=1, show_default=True),
    click.option("--gpus-per-node", type=int, default=0, help="[default: min(gpus, 8)]"),
    click.option("--gpu-mem", help="GPU memory: GiB (80) or with a unit (80GB, 81559MiB)."),
    click.option("--gpu", help="A GPU from tables/gpus.csv (h100-sxm, a100-80gb, ...)."),
    click.option("--headroom", type=float, default=0.05, show_default=True, help="Fraction of memory kept free."),
]
PLAN_OPTIONS = [
    click.option("--strategy", type=_choice(("all", *STRATEGIES)), default="all", show_default=True),
    click.option("--offload", type=_choice(specs.OFFLOADS), default="none", show_default=True),
]


def _apply(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


def job_options(f):
    return _apply(MODEL_OPTIONS + TRAIN_OPTIONS + CLUSTER_OPTIONS + PLAN_OPTIONS)(f)


def user_errors(f):
    """Turn the library's MemplanError into a one-line click error."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except MemplanError as exc:
            raise InputError(str(exc)) from None
    return wrapper


class _OneLineErrors(click.Group):
    """Every user error, click's own included, as one line on stderr (no usage dump)."""

    def main(self, args=None, prog_name=None, **extra):
        extra["standalone_mode"] = False
        try:
            result = super().main(args=args, prog_name=prog_name, **extra)
        except click.exceptions.Exit as exc:
            raise SystemExit(exc.exit_code) from None
        except click.ClickException as exc:
            click.echo(f"Error: {exc.format_message()}", err=True)
            raise SystemExit(exc.exit_code) from None
        except click.Abort:
            click.echo("Aborted.", err=True)
            raise SystemExit(1) from None
        raise SystemExit(result if isinstance(result, int) else 0)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
def main():
    """Per-GPU memory planner for PyTorch training: will it fit, under which strategy?"""


@main.command()
@job_options
@click.option("--format", "fmt", type=_choice(("table", "json", "csv")), default="table", show_default=True)
@click.option("--calibration", default="auto", show_default=True,
              help="Corrections from `memplan calibrate fit` (FILE); auto: those shipped for --gpu NAME "
                   "(or --device cpu) if any; none: the analytic model alone.")
@user_errors
def estimate(fmt, calibration, **flags):
    """Peak per-GPU memory of a training step under each strategy.

    Example: memplan estimate --params 13e9 --gpus 8 --gpu-mem 80
    """
    from . import api, report

    choice, estimates = api.estimate_all(**flags)
    applied = api.calibrated(estimates, calibration)
    if fmt == "json":
        click.echo(report.render_json(choice, estimates, applied))
    elif fmt == "csv":
        click.echo(report.render_csv(estimates, applied), nl=False)
    else:
        click.echo(report.render_table(choice, estimates, applied))


@main.command()
@job_options
@user_errors
def explain(**flags):
    """Every term of the estimate with its formula and value, for one strategy."""
    from . import api, report

    if flags["strategy"] == "all":
        flags["strategy"] = "fsdp-full-shard"
    choice, estimates = api.estimate_all(**flags)
    click.echo(report.render_explain(choice, estimates[0]))


try:  # the calibrate package (torch imported lazily, inside its commands)
    from calibrate.cli import calibrate as _calibrate
except ImportError:
    pass
else:
    main.add_command(_calibrate)


if __name__ == "__main__":
    main()
