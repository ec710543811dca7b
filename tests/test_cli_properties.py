"""Properties of the product as a user meets it: random valid combinations of every flag of
``memplan estimate`` / ``explain`` / ``recommend``, run through the CLI (click's runner on
``memplan.cli.main`` in-process, plus a few real processes of the installed console script).

Every example is a command line a user could type. The checks are the output contract of
docs/design.md: exit 0, or exit 2 with one line and no traceback; every term and component
>= 0; allocated <= reserved <= total; the table, the JSON and the CSV give the same bytes;
``explain``'s terms sum to its moments; ``--micro-batch max`` fits and one more does not; more
micro-batch, sequence or layers never less memory; more GPUs under full shard never more
state bytes; the recommendation re-asked with ``estimate`` gives the same bytes.

Hypothesis runs derandomized (the same examples on every run, so a CI failure reproduces),
with no example database; a failure prints the command line. ``MEMPLAN_PROPERTY_SCALE=N``
runs N times the examples (``scripts/cli_property_count.py`` counts violations instead of
stopping at the first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, currently_in_test_context, example, given, note, settings
from hypothesis import strategies as st

from memplan import alloctrace, layout, loop, replaycache, specs, totals
from memplan.catalog import models as preset_models
from memplan.checkpointing import offload_stash_blocks
from memplan.cli import main
from memplan.strategies import STRATEGIES

SCALE = float(os.environ.get("MEMPLAN_PROPERTY_SCALE", "1"))
COMPONENTS = ("params", "gradients", "optimizer", "activations", "buffers")
TABLE_COLUMNS = (*COMPONENTS, "allocated", "reserved", "overhead", "total")
GIB = 2**30
PRESETS = tuple(sorted(preset_models()))
MOE_MLA = tuple(p for p in PRESETS if p.startswith(("mixtral", "deepseek", "qwen3-30b")))
GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l40s", "mi300x")
FULL_SHARD = ("fsdp-full-shard", "zero3")


def examples(n: int) -> settings:
    """n examples (times MEMPLAN_PROPERTY_SCALE)."""
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# ----------------------------------------------------------------------------- the flags


_CONFIG_DIR = Path(tempfile.mkdtemp(prefix="memplan-props-"))


def _config_file(cfg: dict) -> str:
    """A config.json of its own for each drawn config (the path is the flag's value)."""
    digest = hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    path = _CONFIG_DIR / digest / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return str(path)


@st.composite
def shape(draw) -> dict:
    heads = draw(st.sampled_from([8, 16, 32]))
    return dict(
        layers=draw(st.integers(2, 40)),
        heads=heads,
        head_dim=draw(st.sampled_from([64, 128])),
        kv_heads=draw(st.sampled_from([k for k in (1, 2, 4, 8, heads) if heads % k == 0])),
        ffn=draw(st.sampled_from([1024, 2816, 5504, 11008, 14336])),
        vocab=draw(st.sampled_from([32000, 50257, 128256, 151936])),
    )


@st.composite
def model_flags(draw, source=None) -> tuple[list[str], dict]:
    """One of the four model sources (--params, --model, --config, --arch with the shape flags),
    and what the other flags must respect: heads, kv heads, MoE, learned positions."""
    source = source or draw(st.sampled_from(["params", "model", "model", "moe", "config", "arch"]))
    if source == "params":
        size = draw(st.sampled_from(["125M", "350m", "1.3e9", "3B", "7e9", "13B", "34b", "70e9"]))
        return ["--params", size], dict(heads=8, kv=8, moe=False, positions=0)
    if source in ("model", "moe"):
        name = draw(st.sampled_from(PRESETS if source == "model" else MOE_MLA))
        m = preset_models()[name]
        positions = m.max_positions if m.arch in ("gpt2", "bert") else 0
        return ["--model", name], dict(
            heads=m.num_heads, kv=m.num_kv_heads, moe=bool(m.num_experts), positions=positions
        )
    s = draw(shape())
    hidden = s["heads"] * s["head_dim"]
    info = dict(heads=s["heads"], kv=s["kv_heads"], moe=False, positions=0)
    if source == "config":
        kind = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "gpt2"]))
        if kind == "gpt2":
            cfg = dict(model_type="gpt2", n_layer=s["layers"], n_embd=hidden, n_head=s["heads"], vocab_size=50257)
            return ["--config", _config_file(cfg)], {**info, "kv": s["heads"], "positions": 1024}
        cfg = dict(
            model_type=kind,
            num_hidden_layers=s["layers"],
            hidden_size=hidden,
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            intermediate_size=s["ffn"],
            vocab_size=s["vocab"],
            tie_word_embeddings=draw(st.booleans()),
        )
        return ["--config", _config_file(cfg)], info
    arch = draw(st.sampled_from(["llama", "llama", "gpt2", "neox"]))
    flags = ["--arch", arch, "--layers", str(s["layers"]), "--hidden", str(hidden), "--heads", str(s["heads"])]
    flags += ["--ffn", str(s["ffn"]), "--vocab", str(s["vocab"])]
    if arch == "llama":
        flags += ["--kv-heads", str(s["kv_heads"])]
    else:
        info["kv"] = s["heads"]
    return flags, info


def _maybe(draw, flag: str, values, p: float = 0.35) -> list[str]:
    """``flag value`` a fraction p of the time (else the default)."""
    if draw(st.floats(0, 1)) >= p:
        return []
    value = draw(values if isinstance(values, st.SearchStrategy) else st.sampled_from(values))
    return [flag, str(value)]


def _toggle(draw, flag: str, p: float = 0.25) -> list[str]:
    """--flag, --no-flag or nothing."""
    if draw(st.floats(0, 1)) >= p:
        return []
    return [draw(st.sampled_from([f"--{flag}", f"--no-{flag}"]))]


@st.composite
def train_flags(draw, info: dict, *, fixed_ac: bool = False) -> list[str]:
    seqs = [s for s in (128, 512, 1024, 2048, 4096, 8192) if not info["positions"] or s <= info["positions"] // 2]
    flags = ["--seq-len", str(draw(st.sampled_from(seqs or [128])))]
    flags += ["--micro-batch", str(draw(st.integers(1, 16)))]
    flags += _maybe(draw, "--grad-accum", st.integers(1, 4), 0.2)
    flags += ["--precision", draw(st.sampled_from(specs.PRECISIONS))]
    flags += _maybe(draw, "--reduce-dtype", specs.REDUCE_DTYPES, 0.1)
    flags += _maybe(draw, "--optimizer", specs.OPTIMIZERS, 0.2)
    flags += _maybe(draw, "--optimizer-impl", specs.OPTIMIZER_IMPLS, 0.2)
    flags += _maybe(draw, "--recipe", loop.RECIPES, 0.6)
    ac = _maybe(draw, "--ac", loop.AC_POLICIES, 1.0 if fixed_ac else 0.6)
    flags += ac
    if ac and ac[1] != "none":
        flags += _maybe(draw, "--ac-every", st.integers(1, 3), 0.2)
    logits = _maybe(draw, "--logits", loop.LOGITS, 0.2)
    flags += logits
    if logits and logits[1] == "held":  # drawn beside held mostly, where it means something
        flags += _toggle(draw, "use-cache", 0.5)
    else:
        flags += _toggle(draw, "use-cache", 0.03)
    flags += _maybe(draw, "--loss", loop.LOSSES, 0.3)
    flags += _maybe(draw, "--loss-chunks", st.sampled_from([4, 8, 16]), 0.1)
    for flag in ("compile", "float8", "offload-activations", "optimizer-in-backward"):
        flags += _toggle(draw, flag, 0.15)
    flags += _maybe(draw, "--zero-grad", loop.ZERO_GRADS, 0.1)
    flags += _maybe(draw, "--attention", specs.ATTENTIONS, 0.15)
    flags += _maybe(draw, "--device", specs.DEVICES, 0.05)
    finetune = draw(st.sampled_from(["full", "full", "full", "lora", "qlora", "frozen:2"]))
    if finetune != "full":
        flags += ["--finetune", finetune]
        if finetune in ("lora", "qlora"):
            flags += _maybe(draw, "--lora-rank", st.sampled_from([8, 16, 64]), 0.4)
            flags += _maybe(draw, "--lora-targets", ["attention", "all-linear", "q,v"], 0.4)
        if finetune == "qlora":
            flags += _toggle(draw, "qlora-double-quant", 0.25)
        if finetune == "lora":
            flags += _toggle(draw, "dora", 0.3)
    return flags


@st.composite
def layout_flags(draw, strategy: str, info: dict, *, with_layout: bool = True) -> tuple[list[str], int]:
    """(flags, GPUs): gpus = dp × tp × cp × pp, as the CLI expects; tp divides the heads."""
    dp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    tp = cp = pp = 1
    flags: list[str] = []
    if with_layout and draw(st.floats(0, 1)) < 0.4:
        tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if info["heads"] % t == 0 and info["kv"] % t == 0]))
        cp = draw(st.sampled_from([1, 1, 2]))
        pp = draw(st.sampled_from([1, 1, 2, 4]))
        flags += ["--tp", str(tp)] if tp > 1 else []
        flags += [draw(st.sampled_from(["--sp", "--no-sp"]))] if tp > 1 else []
        flags += ["--cp", str(cp)] if cp > 1 else []
        if pp > 1:
            flags += ["--pp", str(pp)]
            flags += _maybe(draw, "--pp-schedule", layout.PP_SCHEDULES, 0.5)
            flags += _maybe(draw, "--pp-microbatches", st.sampled_from([pp, 2 * pp, 8]), 0.4)
    if strategy == "single":
        dp = 1
    if info["moe"]:
        ep = draw(st.sampled_from([1, 2, 4]))
        flags += ["--ep", str(ep)] if ep > 1 else []
        dp = dp if dp % ep == 0 or strategy == "single" else ep * dp
    return flags, dp * tp * cp * pp


@st.composite
def cluster_flags(draw, gpus: int) -> list[str]:
    flags = ["--gpus", str(gpus)]
    if draw(st.booleans()):
        flags += ["--gpu", draw(st.sampled_from(GPUS))]
    else:
        flags += ["--gpu-mem", draw(st.sampled_from(["24", "40", "80", "141", "192"]))]
    flags += _maybe(draw, "--gpus-per-node", st.sampled_from([n for n in (4, 8) if gpus % n == 0] or [gpus]), 0.1)
    flags += _maybe(draw, "--alloc-conf", ["expandable_segments:True", "max_split_size_mb:512"], 0.1)
    return flags


@st.composite
def jobs(draw, *, strategy=None, source=None, with_layout=True, fixed_ac=False) -> list[str]:
    """The job flags of one command line (a fixed --strategy unless ``strategy == "all"``)."""
    strategy = strategy or draw(st.sampled_from(list(STRATEGIES)))
    model, info = draw(model_flags(source))
    lay, gpus = draw(layout_flags(strategy, info, with_layout=with_layout))
    flags = model + draw(train_flags(info, fixed_ac=fixed_ac)) + lay + draw(cluster_flags(gpus))
    if strategy != "all":
        flags += ["--strategy", strategy]
    offloads = ("none", *STRATEGIES[strategy].offloads) if strategy in STRATEGIES else specs.OFFLOADS
    flags += _maybe(draw, "--offload", offloads, 0.15)
    if strategy in ("fsdp-full-shard", "all") and not lay and gpus >= 4:  # FSDP2's post-forward reshard group
        flags += _maybe(draw, "--reshard-after-forward", [g for g in (2, 4, 8) if gpus % g == 0 and g < gpus], 0.2)
    if strategy in (*specs.ONE_UNIT_STRATEGIES, "all") and not lay:  # the whole model one FSDP unit
        flags += _maybe(draw, "--fsdp-wrap", ["none", "blocks"], 0.15)
    return flags


# ----------------------------------------------------------------------------- running


RUNNER = CliRunner()


class Run:
    def __init__(self, args: list[str]):
        if currently_in_test_context():
            note("memplan " + " ".join(args))
        result = RUNNER.invoke(main, args)
        self.args, self.code, self.out = args, result.exit_code, result.stdout
        self.err = result.stderr
        self.exception = result.exception if not isinstance(result.exception, SystemExit) else None

    @property
    def ok(self) -> bool:
        """Exit 0; else the refusal is checked to be a one-line exit 2, and False returned."""
        check_refusal(self)
        return self.code == 0

    def json(self) -> dict:
        return json.loads(self.out)


def check_refusal(run: Run) -> None:
    """Exit 0, or exit 2 with exactly one line on stderr and no traceback."""
    assert run.exception is None, f"{type(run.exception).__name__}: {run.exception}"
    assert run.code in (0, 2), f"exit {run.code}: {run.err}"
    if run.code == 2:
        lines = run.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), run.err
        assert "Traceback" not in run.err


def estimate_json(args: list[str]) -> dict | None:
    """``estimate --format json`` of the job, or None where memplan refuses it (checked)."""
    run = Run(["estimate", *args, "--format", "json"])
    return run.json() if run.ok else None


def with_flag(args: list[str], flag: str, value) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (replaced where given)."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = str(value)
        return out
    return [*out, flag, str(value)]


def flag_value(args: list[str], flag: str, default=None):
    return args[args.index(flag) + 1] if flag in args else default


# ----------------------------------------------------------------------------- checks


def check_bytes(b: dict) -> None:
    for key in (*COMPONENTS, "allocated", "reserved", "overhead", "total"):
        assert b[key] >= 0, f"bytes.{key} = {b[key]:,} < 0"
    assert b["allocated"] == sum(b[c] for c in COMPONENTS), "allocated is not the sum of the components"
    assert b["allocated"] <= b["reserved"] <= b["total"], (
        f"allocated {b['allocated']:,} <= reserved {b['reserved']:,} <= total {b['total']:,} broken"
    )
    assert b["total"] == b["allocated"] + b["overhead"], "total != allocated + overhead"


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The estimate table's rows by strategy: column -> cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strategy ") and "peak in" in line)
    header, dashes = lines[start], lines[start + 1]
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", dashes)]
    names = [header[a:b].strip() for a, b in spans[:-1]] + [header[spans[-1][0] :].strip()]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in spans[:-1]] + [line[spans[-1][0] :].strip()]
        row = dict(zip(names, cells, strict=True))
        rows[row["strategy"]] = row
    return rows


MOMENT = re.compile(r"^\[(\w+)\] (.*): (-?[\d.]+) GiB(  <- peak)?$")
TERM = re.compile(r"^  (params|gradients|optimizer|activations|buffers) .* (-?[\d,]+) B +(-?[\d.]+) GiB$")
ALLOCATED = re.compile(r"^allocated \(peak\) = ([\d,-]+) B")
TOTAL = re.compile(r"^total = ([\d,-]+) B")
OVERHEAD = re.compile(r"^  \+ .* (-?[\d,]+) B$")
RESERVED = re.compile(r"^reserved .* = ([\d,-]+) B")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def explain_moments(text: str) -> tuple[list[tuple[str, float, bool, list[int]]], dict[str, int]]:
    """([(label, GiB, is peak, term bytes)], {allocated, reserved, total, overhead}) of explain's text."""
    moments: list[tuple[str, float, bool, list[int]]] = []
    totals = {"overhead": 0}
    for line in text.splitlines():
        if m := MOMENT.match(line):
            moments.append((m[2], float(m[3]), bool(m[4]), []))
        elif (m := TERM.match(line)) and moments:
            moments[-1][3].append(_int(m[2]))
        elif m := ALLOCATED.match(line):
            totals["allocated"] = _int(m[1])
        elif m := RESERVED.match(line):
            totals["reserved"] = _int(m[1])
        elif m := OVERHEAD.match(line):
            totals["overhead"] += _int(m[1])
        elif m := TOTAL.match(line):
            totals["total"] = _int(m[1])
    return moments, totals


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f}"


# ----------------------------------------------------------------------------- properties


@examples(620)
@given(args=jobs())
def test_estimate_exits_cleanly_and_its_bytes_are_coherent(args):
    """Any combination: exit 0 or a one-line exit 2; every component >= 0, allocated <= reserved <= total."""
    out = estimate_json(args)
    if out is None:
        return
    for est in out["estimates"]:
        check_bytes(est["bytes"])
        assert est["micro_batch"] >= 1


@examples(60)
@given(args=jobs(strategy="all", with_layout=False))
def test_table_json_and_csv_give_the_same_bytes(args):
    """The three formats of one estimate: the CSV's bytes are the JSON's, the table its GiB."""
    out = estimate_json(args)
    assume(out is not None)
    csv_run, table_run = Run(["estimate", *args, "--format", "csv"]), Run(["estimate", *args])
    assert csv_run.code == 0 and table_run.code == 0
    csv_lines = csv_run.out.strip().splitlines()
    fields = csv_lines[0].split(",")
    csv_rows = [dict(zip(fields, line.split(","), strict=True)) for line in csv_lines[1:]]
    rows = table_rows(table_run.out)
    assert len(csv_rows) == len(out["estimates"]) == len(rows)
    for est, c in zip(out["estimates"], csv_rows, strict=True):
        name = est["strategy"] + ("" if est["offload"] == "none" else f" +{est['offload']}")
        t = rows[name]
        assert c["strategy"] == est["strategy"] and c["phase"] == est["phase"] == t["peak in"]
        assert int(c["micro_batch"]) == est["micro_batch"]
        for key in TABLE_COLUMNS:
            assert int(c[f"{key}_bytes"]) == est["bytes"][key], key
            assert t[key] == _gib(est["bytes"][key]), f"{key}: table {t[key]}, JSON {_gib(est['bytes'][key])}"
        assert int(c["headroom_bytes"]) == est["headroom_bytes"]
        assert (c["fits"] == "True") == est["fits"]


# found by this suite or issue 28, kept as explicit examples of every run
ITEM4 = "--model llama-3.1-8b --gpus 8 --gpu h100-sxm --seq-len 4096 --micro-batch 8 --precision fp32 --ac selective"
ITEM4 += " --recipe torchtitan --tp 4 --sp --strategy fsdp-full-shard"
SMALL = "--arch llama --layers 3 --hidden 512 --heads 8 --ffn 1024 --vocab 32000"
FOUND = [
    ITEM4.split(),  # the root unit's remainder negative (the whole model's V·h taken from a TP rank's units)
    ITEM4.replace("--tp 4 --sp", "--pp 2").split(),  # a stage's units: the head unit counted on the first stage
    (ITEM4.replace("llama-3.1-8b", "llama-3.2-3b") + " --pp 2 --tp 2").split(),  # tied, TP × PP
    # zero-filled (torchtitan's) or accumulated gradients and ac-every's last checkpointed block: KeyError
    shlex.split(SMALL + " --recipe torchtitan --ac-every 2 --gpus 1 --gpu-mem 80"),
    shlex.split(SMALL + " --ac full --ac-every 2 --grad-accum 2 --gpus 1 --gpu-mem 80"),
]


def _found(test):
    for args in FOUND:
        test = example(args=args)(test)
    return test


@_found
@examples(600)
@given(args=jobs())
def test_explain_terms_are_positive_and_sum_to_their_moments(args):
    """``explain``: every term >= 0; each moment's terms sum to its GiB; the peak's to allocated,
    which is the estimate's; total = allocated + the overhead lines."""
    run = Run(["explain", *args])
    if not run.ok:
        return
    moments, totals = explain_moments(run.out)
    assert moments and "allocated" in totals
    for label, gib, _, terms in moments:
        for b in terms:
            assert b >= 0, f"a term of {label!r} is {b:,} B"
        assert _gib(sum(terms)) == f"{gib:.2f}", f"{label}: terms sum to {_gib(sum(terms))}, header {gib:.2f}"
    peaks = [m for m in moments if m[2]]
    if len(peaks) == 1 and "--pp" not in args:  # under PP the moments shown are the worst stage's
        assert sum(peaks[0][3]) == totals["allocated"]
    assert all(sum(m[3]) <= totals["allocated"] for m in moments if "--pp" not in args)
    assert totals["allocated"] <= totals["reserved"] <= totals["total"]
    assert totals["total"] == totals["allocated"] + totals["overhead"]


def test_fsdp_units_under_tp_are_the_ranks_local_shards():
    """Issue 28 item 4 through the CLI: under TP 4, FSDP2 gathers each unit's DTensor local shard,
    so torchtitan's head unit is the whole final norm and 1/4 of the vocabulary-parallel head,
    the input embedding unit 1/4 of the embedding, and no root remainder is left (llama: no
    learned positions); fp32 gathers 4 bytes a parameter."""
    run = Run(["explain", *ITEM4.split()])
    assert run.code == 0, run.err
    h, v, tp = 4096, 128256, 4
    units = {}
    for line in run.out.splitlines():
        if m := re.match(r"^  buffers\s+(unsharded \w+(?: \w+)? unit)\b.*?(-?[\d,]+) B ", line):
            units.setdefault(m[1], _int(m[2]))
    assert units["unsharded head unit"] == 4 * (h + v * h // tp)
    assert units["unsharded input embedding unit"] == 4 * (v * h // tp)
    assert "unsharded root unit" not in units
    out = estimate_json(ITEM4.split())
    assert out is not None and out["estimates"][0]["bytes"]["buffers"] >= 0


@examples(60)
@given(args=jobs())
def test_explain_and_estimate_give_the_same_bytes(args):
    """The job ``explain`` answers, ``estimate`` answers too, with its allocated and total."""
    run = Run(["explain", *args])
    if not run.ok:
        return
    _, totals = explain_moments(run.out)
    out = estimate_json(args)
    assert out is not None, "estimate refuses what explain answers"
    assert out["estimates"][0]["bytes"]["allocated"] == totals["allocated"]
    assert out["estimates"][0]["bytes"]["total"] == totals["total"]


def _stash_blocks(out: dict) -> int:
    """The blocks torchtune's activation offloading keeps on the GPU (``offload_stash_blocks``):
    more tokens can mean fewer, by its own rule (a LayerNorm's statistics pass min_offload_size and
    take stash ids the blocks' inputs held), so memory may fall as tokens grow; 0 without offloading."""
    inputs = out["inputs"]
    if not any(c["setting"] == "offload_activations" and c["value"] == "true" for c in inputs["loop"]):
        return 0
    model = specs.ModelSpec(**{k: v for k, v in inputs["model"].items() if k != "num_params"})
    return offload_stash_blocks(model, inputs["train"]["seq_len"] * inputs["train"]["micro_batch"])


def _monotone(args: list[str], flag: str, larger) -> None:
    small = estimate_json(args)
    value = int(flag_value(args, flag))
    big = estimate_json(with_flag(args, flag, larger(value))) if small else None
    assume(small is not None and big is not None)
    assert small and big
    assume(_stash_blocks(small) <= _stash_blocks(big))
    a, b = _most_allocated(small), _most_allocated(big)
    # allocated, the tensors: the caching allocator's replayed reserved may hold a few MiB less for
    # more (a different split of its segments), so it is not held to this
    assert b >= a, f"{flag} {value} -> {larger(value)}: allocated {a:,} -> {b:,}"


def _most_allocated(out: dict) -> int:
    """The tensors of the rank holding most: under pipeline stages the estimate reports the worst stage
    by total (reserved included), so a larger job's report may be another stage's, holding fewer
    tensors (found: --cp 2 --pp 4 zero2, seq 512 → 1024, stage 0 then stage 3); no stage holds less."""
    est = out["estimates"][0]
    return max((stage["allocated"] for stage in est.get("stages") or ()), default=est["bytes"]["allocated"])


@examples(150)
@given(args=jobs(fixed_ac=True))
def test_more_micro_batch_never_less_memory(args):
    _monotone(args, "--micro-batch", lambda m: m + 1)


@examples(150)
@given(args=jobs(fixed_ac=True))
def test_longer_sequence_never_less_memory(args):
    _monotone(args, "--seq-len", lambda s: 2 * s)


_OFFLOADED_EVERY_2 = shlex.split(
    "--arch llama --layers 9 --hidden 512 --heads 8 --ffn 1024 --vocab 32000 --kv-heads 1 --seq-len 128 "
    "--micro-batch 2 --precision fp32 --ac selective --ac-every 2 --offload-activations --optimizer-in-backward "
    "--gpus 1 --gpu-mem 24 --strategy single"
)


@examples(120)
@given(args=jobs(source="arch", fixed_ac=True))
@example(args=_OFFLOADED_EVERY_2)  # found by this test: the last checkpointed block held every block offloaded
def test_more_layers_never_less_memory(args):
    _monotone(args, "--layers", lambda n: n + 1)


@examples(120)
@given(args=jobs(strategy="fsdp-full-shard", with_layout=False), shard=st.sampled_from(FULL_SHARD))
def test_more_gpus_under_full_shard_never_more_state_bytes(args, shard):
    args = with_flag(args, "--strategy", shard)
    small = estimate_json(args)
    assume(small is not None)
    gpus = int(flag_value(args, "--gpus"))
    big = estimate_json(with_flag(args, "--gpus", 2 * gpus))
    assume(big is not None)
    a, b = small["estimates"][0]["bytes"], big["estimates"][0]["bytes"]
    states = ("params", "gradients", "optimizer")
    assert sum(b[k] for k in states) <= sum(a[k] for k in states)


@examples(50)
@given(args=jobs(with_layout=False))
def test_micro_batch_max_fits_and_one_more_does_not(args):
    """``--micro-batch max``: the micro-batch it names fits (unless none does: then 1), one more does not."""
    out = estimate_json(with_flag(args, "--micro-batch", "max"))
    if out is None:
        return
    est = out["estimates"][0]
    m = est["micro_batch"]
    again = estimate_json(with_flag(args, "--micro-batch", m))
    assert again is not None, f"micro-batch {m}, the max, is refused"
    assert again["estimates"][0]["bytes"] == est["bytes"], f"micro-batch {m}: other bytes than max's"
    assert again["estimates"][0]["fits"] == est["fits"]
    if not est["fits"]:
        assert m == 1, f"max names micro-batch {m}, which does not fit"
        return
    more = estimate_json(with_flag(args, "--micro-batch", m + 1))
    if more is not None:  # a micro-batch beyond what some term allows is refused: it does not fit either
        assert not more["estimates"][0]["fits"], f"micro-batch {m + 1} fits too"


def _option_flags(option: dict) -> list[str]:
    return [
        "--strategy",
        option["strategy"],
        "--precision",
        option["precision"],
        "--ac",
        option["activation_checkpointing"],
        "--offload",
        option["offload"],
        "--micro-batch",
        str(option["micro_batch"]),
    ]


def _without(args: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _decided_total(row: dict) -> int:
    """The total a row's fit is decided on: the calibrated one where a calibration applies (the
    recommendation's total is that one), else the estimate's."""
    return row["calibrated"]["total"] if row.get("calibrated") else row["bytes"]["total"]


@examples(40)
@given(args=jobs(strategy="all", with_layout=False))
def test_recommendation_reasked_with_estimate_gives_the_same_bytes(args):
    """``recommend``'s pick, given back to ``estimate`` as flags: the same total."""
    run = Run(["recommend", *args, "--format", "json"])
    if not run.ok:
        return
    rec = run.json()
    assume(rec.get("strategy"))
    # the post-forward reshard group is full shard's keyword: the option's own, as its strategy
    own = () if rec["strategy"] == "fsdp-full-shard" else ("--reshard-after-forward",)
    own += () if rec["strategy"] in specs.ONE_UNIT_STRATEGIES else ("--fsdp-wrap",)
    asked = _without(args, "--strategy", "--precision", "--ac", "--offload", "--micro-batch", *own) + _option_flags(rec)
    out = estimate_json(asked)
    assert out is not None, "estimate refuses the recommended option"
    total = _decided_total(out["estimates"][0])
    assert total == rec["total_bytes"], f"recommend says {rec['total_bytes']:,} B, estimate {total:,} B"


@examples(40)
@given(args=jobs(strategy="all", with_layout=False))
def test_estimate_table_and_its_recommendation_give_the_same_bytes(args):
    """The recommendation under ``estimate``'s table, where it picks a row's option: that row's total."""
    out = estimate_json(args)
    if out is None or not out["recommendation"] or not out["recommendation"].get("strategy"):
        return
    rec = out["recommendation"]
    same = [
        e
        for e in out["estimates"]
        if all(e[k] == rec[k] for k in ("strategy", "precision", "activation_checkpointing", "offload", "micro_batch"))
    ]
    if same:
        total = _decided_total(same[0])
        assert total == rec["total_bytes"], f"the row says {total:,} B, the recommendation {rec['total_bytes']:,} B"


@examples(40)
@given(args=jobs(strategy="all", with_layout=False))
def test_the_layout_search_refuses_nothing_data_parallel_answers(args):
    """A search skips what it cannot model: ``recommend`` with its layout search (the default,
    which runs it over more than one node or where data parallel is tight) answers wherever
    ``--no-search-layout`` does; only the user's own choices are refused."""
    plain = Run(["recommend", *args, "--no-search-layout", "--format", "json"])
    if not plain.ok:
        return
    searched = Run(["recommend", *args, "--format", "json"])
    assert searched.ok, f"the layout search refuses what data parallel answers: {searched.err.strip()}"


# ----------------------------------------------------------------------------- answers kept on disk


@contextlib.contextmanager
def _replays_kept_in(folder: str):
    """The replays' answers kept in ``folder`` (memplan.replaycache), and none held in this
    process: each run under it starts as a new process would."""
    os.environ[replaycache.ENV] = folder
    try:
        yield
    finally:
        os.environ[replaycache.ENV] = "none"


def _as_a_new_process() -> None:
    for cached in (totals.final, totals.bound, alloctrace.reserved):
        cached.cache_clear()
    alloctrace.forget_answers()


@examples(100)
@given(args=jobs())
def test_a_later_run_reading_the_kept_replays_answers_the_same(args):
    """The recommendation with every option it weighed, rejected ones included: its first run
    replays and keeps each answer; a later one reads them back and prints the same bytes."""
    with tempfile.TemporaryDirectory() as folder, _replays_kept_in(folder):
        _as_a_new_process()
        first = Run(["recommend", *args, "--format", "json"])
        _as_a_new_process()
        again = Run(["recommend", *args, "--format", "json"])
        kept = list(Path(folder).glob("replay-*/*"))
    _as_a_new_process()
    assert (again.code, again.out, again.err) == (first.code, first.out, first.err)
    assert kept or not first.ok or flag_value(args, "--device") == "cpu"  # a CPU job replays no CUDA allocator


# ----------------------------------------------------------------------------- the installed script


def _console_script() -> str | None:
    beside = Path(sys.executable).parent / "memplan"
    return str(beside) if beside.exists() else shutil.which("memplan")


SCRIPT_CASES = [
    ["estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"],
    ["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--gpu", "h100-sxm", "--ep", "2", "--format", "json"],
    ["explain", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-sxm", "--tp", "4", "--sp"],
    ["estimate", "--model", "gpt2", "--gpus", "2", "--gpu", "a100-80gb", "--format", "csv"],
    ["estimate", "--params", "-5", "--gpus", "8", "--gpu-mem", "80"],
    ["estimate", "--model", "no-such-model", "--gpus", "8", "--gpu-mem", "80"],
]


@pytest.mark.parametrize("args", SCRIPT_CASES, ids=lambda a: " ".join(a[:3]))
def test_the_console_script_exits_cleanly(args):
    """The same contract through the installed ``memplan`` command, in its own process."""
    script = _console_script()
    if script is None:
        pytest.skip("the memplan console script is not installed")
    proc = subprocess.run([script, *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode in (0, 2), proc.stderr
    assert "Traceback" not in proc.stderr
    if proc.returncode == 2:
        assert len(proc.stderr.strip().splitlines()) == 1
    elif "json" in args:
        for est in json.loads(proc.stdout)["estimates"]:
            check_bytes(est["bytes"])
