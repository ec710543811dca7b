"""The `memplan` command: parse flags, call the library, render. Nothing else.

The job options are built from the request's fields (``memplan.request``, ``memplan.settings``).
The commands import the library inside their bodies, so that ``memplan --help`` and a bad flag
load no estimate code (start-up time): those are this package's deferred imports."""

from __future__ import annotations

import functools
import gc
import importlib
import importlib.util
import os
import sys
from dataclasses import Field
from typing import ClassVar

import click

from .errors import FLAGS, MemplanError
from .request import FIELDS, PARTS, Request
from .settings import DEFAULT_HELP, choices, field_docs
from .strategies import STRATEGIES
from .version import __version__


class OneLineError(click.ClickException):
    """A bad value: one line on stderr, exit code 2, no traceback."""

    exit_code = 2


def _choice(values):
    return click.Choice(list(values), case_sensitive=False)


class MicroBatch(click.ParamType):
    """A positive integer, or ``max``: the largest that fits (searched per strategy)."""

    name = "N|max"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or str(value).strip().lower() == "max":
            return value if isinstance(value, int) else "max"
        try:
            return int(value)
        except ValueError:
            self.fail(f"micro-batch {value!r} is not a positive integer or 'max'", param, ctx)


_TYPES = (("str", str), ("float", float), ("int", int))
"""The types a flag's text converts to, by the field's annotation: a union holding str takes the
text as given ("13B", "80GB": the request part parses it)."""


class _FieldOption(click.Option):
    """An option whose help is its request field's docstring (``settings.field_docs``), read when
    help is shown rather than at start-up."""

    def __init__(self, *args, part: type, default_help: str = "", **kwargs):
        self._doc_of, self._default_help = part, default_help
        super().__init__(*args, **kwargs)

    @property
    def help(self) -> str:
        doc = field_docs(self._doc_of)[self.name or ""]
        return f"{doc} [default: {self._default_help}]" if self._default_help else doc

    @help.setter
    def help(self, value) -> None:
        """Click sets it from ``help=``, which these options do not take."""


def _option(keyword: str, f: Field, part: type):
    """The option of one request field: its flag, type, choices, default and help, all read off
    the field (``settings.setting``) and its docstring."""
    flag, kind, accepted = "--" + keyword.replace("_", "-"), str(f.type), choices(f)
    default_help = f.metadata.get(DEFAULT_HELP, "")
    shown = f.default is not None and f.default != "" and not default_help
    common = {"cls": _FieldOption, "part": part, "default_help": default_help, "show_default": shown}
    if kind.startswith("bool"):
        return click.option(f"{flag}/--no-{flag[2:]}", keyword, default=f.default, **common)
    if accepted:
        kind_of = _choice(accepted)
    elif "Literal" in kind:
        kind_of = MicroBatch()
    else:
        kind_of = next(t for name, t in _TYPES if name in kind)
    return click.option(flag, keyword, type=kind_of, default=f.default, **common)


def _request_options(strategy=None) -> list:
    """Every request field the command line can spell (text, a number, a switch), as options in
    field order (``strategy``: the command's own --strategy in place of the field's)."""
    options = []
    for keyword, (part, f) in FIELDS.items():
        if not any(name in str(f.type) for name in ("str", "float", "int", "bool")):
            continue  # a Python value (a ZeroConfig): the API's alone
        options.append(strategy if keyword == "strategy" and strategy else _option(keyword, f, PARTS[part]))
    return options


ONE_STRATEGY_OPTION = click.option(
    "--strategy", type=_choice(STRATEGIES), default="fsdp-full-shard", show_default=True, help="The one explained."
)

FROM_OPTIONS = [
    click.option(
        "--from",
        "from_file",
        help="A framework's own config file read as the job (format detected, or named: "
        "deepspeed:ds_config.json); the flags given explicitly win over the file.",
    ),
    click.option(
        "--explain-config",
        is_flag=True,
        help="With --from: list every field of the file (modelled, at its default, ignored) and stop.",
    ),
]


def _apply(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


DECISION_OPTIONS = [
    click.option(
        "--priority",
        type=_choice(("speed", "memory", "simplicity")),
        default="speed",
        show_default=True,
        help="What the recommendation optimizes among the options that fit.",
    ),
    click.option(
        "--interconnect",
        type=_choice(("nvlink", "infiniband", "ethernet", "pcie")),
        help="Link between nodes (on one node: between GPUs) [default: infiniband across nodes, "
        "the GPU's own link within one].",
    ),
    click.option(
        "--bw",
        type=click.FloatRange(min=0, min_open=True),
        help="Bandwidth of that link in GB/s per direction (overrides --interconnect's table value).",
    ),
    click.option(
        "--calibration",
        default="auto",
        show_default=True,
        help="Corrections from `memplan calibrate fit` (FILE); auto: those shipped for --gpu NAME "
        "(or --device cpu) if any; none: the analytic model alone. They move what fits and, "
        "with measured step times, the predicted speed. A FILE applies only to the device and torch "
        "major version it was fitted on; force:FILE applies it anyway.",
    ),
]


def job_options(f, strategy=None):
    """The options of every request field (``memplan.request``: each declared once, there)."""
    return _apply(_request_options(strategy))(f)


def from_options(f):
    """--from FILE and --explain-config (memplan.readers), read by ``_request``."""
    return _apply(FROM_OPTIONS)(f)


def decision_options(f):
    return _apply(DECISION_OPTIONS)(f)


def _request(flags: dict):
    """The request the job flags describe (each flag is the input of the same name), over the
    ``--from`` file's inputs where one is given (the flags given explicitly win)."""
    source, explain = flags.pop("from_file", None), flags.pop("explain_config", False)
    if source is None:
        if explain:
            raise MemplanError(lambda n: f"{n('explain_config')} needs {n('from')} FILE")
        return Request.of(**flags)
    from click.core import ParameterSource

    from .readers import read

    ctx = click.get_current_context()
    explicit = {k for k in flags if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}
    config = read(source, gpus=flags.get("gpus") if "gpus" in explicit else None)
    if explain:
        click.echo(config.explain())
        raise click.exceptions.Exit(0)
    request = Request.of(**{**flags, **config.inputs, **{k: flags[k] for k in explicit}})
    click.echo(f"memplan: {config.describe(explicit)}", err=True)
    return request


def _fixed() -> tuple[str, ...]:
    """The axes recommend keeps: the fixable flags the user gave."""
    from click.core import ParameterSource

    from .api import FIXABLE

    ctx = click.get_current_context()
    return tuple(
        a for a in FIXABLE if ctx.get_parameter_source(a) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
    )


def user_errors(f):
    """Turn the library's MemplanError into a one-line click error naming the flags."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except MemplanError as exc:
            raise OneLineError(exc.render(FLAGS)) from None

    return wrapper


class _OneLineErrors(click.Group):
    """Every user error, click's own included, as one line on stderr (no usage dump); the
    `calibrate` commands (package calibrate, torch behind them) load only when used."""

    LAZY: ClassVar[dict[str, str]] = {"calibrate": "calibrate.cli"}

    def list_commands(self, ctx):
        found = [name for name, module in self.LAZY.items() if importlib.util.find_spec(module.split(".")[0])]
        return sorted({*super().list_commands(ctx), *found})

    def get_command(self, ctx, name):
        command = super().get_command(ctx, name)
        if command is None and name in self.LAZY:
            try:
                command = getattr(importlib.import_module(self.LAZY[name]), name)
            except ImportError:
                return None
        return command

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
@click.version_option(version=__version__, prog_name="memplan")
def main():
    """Per-GPU memory planner for PyTorch training: will it fit, under which strategy?"""


@main.command()
@job_options
@from_options
@decision_options
@click.option("--format", "fmt", type=_choice(("table", "json", "csv")), default="table", show_default=True)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Also write stacked bars of GiB per component per strategy (PNG; needs memplan[plot]).",
)
@user_errors
def estimate(fmt, calibration, plot_path, priority, interconnect, bw, **flags):
    """Peak per-GPU memory of a training step under each strategy, the predicted throughput
    relative to DDP, and the recommendation.

    Example: memplan estimate --params 13e9 --gpus 8 --gpu-mem 80
    """
    from . import api, report

    result = api.estimate(
        _request(flags), calibration=calibration, priority=priority, interconnect=interconnect, bw=bw, fixed=_fixed()
    )
    if plot_path:
        from .plot import plot_breakdown

        plot_breakdown(result, plot_path)
    estimates = list(result.estimates)
    if fmt == "csv":
        click.echo(report.render_csv(estimates, result.applied), nl=False)
        return
    shown = (result.choice, estimates, result.applied, list(result.relative_throughputs), result.recommendation)
    if fmt == "json":
        click.echo(report.render_json(*shown))
    else:
        click.echo(report.render_table(*shown, whatifs=result.whatifs))


@main.command()
@job_options
@from_options
@decision_options
@click.option(
    "--emit",
    type=_choice(("fsdp2", "fsdp1", "accelerate", "deepspeed", "torchrun", "torchtitan")),
    help="Write the launch configuration of the recommendation in this form: the file alone on stdout "
    "and the report on stderr, or the file to --output (fsdp2, fsdp1 and deepspeed search only the "
    "strategies they write; --format json: the file is the document's launch field).",
)
@click.option(
    "-o",
    "--output",
    help="With --emit: write the launch configuration to this file; the report then goes to stdout.",
)
@click.option(
    "--framework",
    type=_choice(("single", "ddp", "fsdp", "deepspeed")),  # = decide.FRAMEWORKS
    help="Search only this framework's strategies [default: all; with --emit fsdp2|fsdp1|deepspeed, "
    "the ones it writes].",
)
@click.option("--format", "fmt", type=_choice(("table", "json")), default="table", show_default=True)
@click.option(
    "--search-layout/--no-search-layout",
    default=None,
    help="Search the mesh too: tp within the node, pp and its schedule, the dp strategy, AC, micro-batch "
    "[default: where a layout can matter (more than one node, or data parallel alone keeps less than the "
    "safe margin free) and no --tp/--cp/--pp is given; the layout is then picked where it beats data "
    "parallel's pick, the safe margin of headroom first, then tokens/s].",
)
@user_errors
def recommend(priority, interconnect, bw, calibration, emit, output, framework, fmt, search_layout, **flags):
    """The best option that fits (strategy, precision, AC, offload, micro-batch), why, what was
    rejected, and which documented rules the arithmetic agrees with or contradicts.

    Flags given explicitly (--strategy, --precision, --ac, --offload, --micro-batch) stay fixed.

    Example: memplan recommend --params 70e9 --gpus 8 --gpu a100-80gb --emit fsdp2
    """
    import json

    from . import api, report
    from .emit import DATA_PARALLEL_KINDS, WRITES, check_destination

    if output is not None:
        if not emit:
            raise MemplanError(lambda n: f"{n('output')} writes the launch configuration: it needs {n('emit')} KIND")
        check_destination(output)
    if search_layout:
        _deliver(*_layout_pick(flags, interconnect, bw, emit, fmt), emit, output, fmt)
        return
    writes = WRITES.get(emit)  # --emit fsdp2 | fsdp1 | deepspeed: search only what it writes
    source = ", ".join([f"--framework {framework}"] * bool(framework) + [f"--emit {emit}"] * bool(writes)) or None
    choice, rec = api.recommend(
        _request(flags),
        priority=priority,
        interconnect=interconnect,
        bw=bw,
        calibration=calibration,
        fixed=_fixed(),
        framework=framework,
        strategies=writes,
    )
    # a form that writes data parallel alone takes data parallel's pick (the layouts searched on --search-layout)
    if search_layout is None and emit not in DATA_PARALLEL_KINDS and _layout_wins(flags, rec, interconnect, bw):
        _deliver(*_layout_pick(flags, interconnect, bw, emit, fmt), emit, output, fmt)
        return
    launch = _launch(rec.best, emit)
    if fmt == "json":
        text = json.dumps({**report.recommendation_dict(rec, source), "launch": launch}, indent=2)
    else:
        text = report.render_recommendation(choice, rec, source)
    _deliver(text, launch, emit, output, fmt)


def _launch(best, emit: str | None) -> str | None:
    """The launch configuration of the pick in the form ``--emit`` names (None without --emit)."""
    from .emit import emit as emit_text

    if not emit:
        return None
    if best is None:
        raise MemplanError(
            "nothing fits, so there is nothing to --emit; apply one of the changes listed "
            "(run without --emit to see them)"
        )
    return emit_text(best.job, emit)


def _deliver(text: str, launch: str | None, emit: str | None, output: str | None, fmt: str) -> None:
    """The report and the emitted file. With --emit the file is a file: alone on stdout (what the
    framework reads, ``> ds_config.json``) with the report on stderr, or written to --output with
    the report on stdout. --format json keeps one JSON document on stdout, the file as its
    ``launch`` field (and written to --output where given)."""
    if launch is None:
        click.echo(text)
        return
    if output is not None:
        from .emit import write_file

        write_file(output, launch)
    where = f"written to {output}" if output is not None else "on stdout"
    if fmt != "json":
        text += f"\n\nLaunch configuration ({emit}): {where}"
    if output is not None or fmt == "json":
        click.echo(text)
        return
    click.echo(text, err=True)
    click.echo(launch if launch.endswith("\n") else launch + "\n", nl=False)


def _layout_wins(flags: dict, rec, interconnect, bw) -> bool:
    """Where a layout can matter and none was given: whether the layout search's pick beats
    ``rec``'s. A search the model cannot run on the user's choices (an offload FSDP does not run,
    say) is skipped: only the choices themselves are refused, and ``rec`` answered them."""
    from .decide.layouts import layout_matters, prefer_layout, search_layouts, tight
    from .inputs import build_jobs
    from .throughput import link_for

    try:
        _, jobs = build_jobs(_request({**flags, "strategy": "fsdp-full-shard"}))
        job = jobs[0]
        if not job.layout.is_data_parallel or job.plan.ep > 1 or not layout_matters(job):
            return False
        pick = search_layouts(job, link_for(job, interconnect=interconnect, bw_gbs=bw))
    except MemplanError:
        return False
    best = rec.best
    return prefer_layout(pick, best and best.step.tokens_per_s, best is not None and tight(best.final))


def _layout_pick(flags: dict, interconnect, bw, emit, fmt) -> tuple[str, str | None]:
    """``recommend --search-layout``: the layout search's pick and why, and its launch form."""
    from . import report
    from .decide.layouts import search_layouts
    from .inputs import build_jobs
    from .throughput import link_for

    choice, jobs = build_jobs(_request({**flags, "strategy": "fsdp-full-shard"}))
    pick = search_layouts(jobs[0], link_for(jobs[0], interconnect=interconnect, bw_gbs=bw))
    launch = _launch(pick.best, emit)
    return report.render_layout_pick(choice, pick, launch, fmt), launch


@main.command("min-gpus")
@job_options
@from_options
@click.option("--format", "fmt", type=_choice(("table", "json")), default="table", show_default=True)
@click.option(
    "--calibration",
    default="auto",
    show_default=True,
    help="Corrections from `memplan calibrate fit` (FILE), auto or none, as for estimate.",
)
@user_errors
def min_gpus(fmt, gpus_per_node, calibration, **flags):
    """The fewest GPUs (1-8, then whole nodes of --gpus-per-node) on which some strategy fits.

    Example: memplan min-gpus --params 70e9 --gpu a100-80gb --ac full
    """
    import json

    from . import api, report

    choice, result = api.min_gpus(_request(flags), gpus_per_node=gpus_per_node, calibration=calibration)
    if fmt == "json":
        click.echo(json.dumps(report.min_gpus_dict(choice, result), indent=2))
    else:
        click.echo(report.render_min_gpus(choice, result))


@main.command()
@functools.partial(job_options, strategy=ONE_STRATEGY_OPTION)
@from_options
@user_errors
def explain(**flags):
    """Every term of the estimate with its formula and value, for one strategy."""
    from . import api, report

    result = api.estimate(_request(flags), calibration=None)
    click.echo(report.render_explain(result.choice, result.estimates[0], result.whatifs))


def run() -> None:
    """The console script: ``main``, then the process ends without tearing its heap down (the
    caches of estimates and replays; ~0.1 s of the main job's 0.6 s, benchmarks/cli_startup.py),
    its output flushed first. A command that imported torch (``calibrate``) exits as usual: its
    threads and process groups shut down at exit. The cyclic collector leaves the modules'
    objects alone and passes ten times less often: its passes over the caches of estimates took
    0.09 s of the 405B layout search's 0.9 s, 0.03 s so (benchmarks/layout_405b.py's command)."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    code: int | str | None = 0
    try:
        main()
    except SystemExit as exc:
        if "torch" in sys.modules:
            raise
        code = exc.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left (``memplan sweep ... | head``): nothing more to say
        pass
    os._exit(code if isinstance(code, int) else int(code is not None))


if __name__ == "__main__":
    run()
