"""memplan.readers.torchtitan (issue 27): torchtitan's own job-config TOMLs (tests/data/torchtitan/,
copied from pytorch/torchtitan's llama3 train_configs, the commit on each file's first line) and the
0.2.2 JobConfig schema they follow, read as the job torchtitan runs."""

import ast
import dataclasses
import json
import zipfile
from pathlib import Path

import pytest
import tomllib

from memplan.catalog import model_preset
from memplan.errors import InputError
from memplan.readers import field_table, read
from memplan.readers import torchtitan as titan

DATA = Path(__file__).resolve().parent / "data" / "torchtitan"
SHIPPED = ("llama3_8b.toml", "llama3_70b.toml", "debug_model.toml")
WHEEL = Path("/tmp/tt022/torchtitan-0.2.2-py3-none-any.whl")


def _cli(*args):
    from click.testing import CliRunner

    from memplan.cli import main

    return CliRunner().invoke(main, list(args))


def _toml(tmp_path, data: dict, name: str = "job.toml") -> Path:
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# --- the schema ------------------------------------------------------------------------


def _wheel_fields() -> list[str]:
    """Every leaf field of torchtitan 0.2.2's JobConfig (config/job_config.py, read from the wheel's
    source by its dataclasses' annotations: importing it needs torch)."""
    with zipfile.ZipFile(WHEEL) as wheel:
        tree = ast.parse(wheel.read("torchtitan/config/job_config.py"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def leaves(cls, prefix):
        for node in classes[cls].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                kind = ast.unparse(node.annotation)
                if kind in classes:
                    yield from leaves(kind, f"{prefix}{node.target.id}.")
                else:
                    yield prefix + node.target.id

    return list(leaves("JobConfig", ""))


def _known(field: str) -> bool:
    table = field_table("torchtitan")
    parts = field.split(".")
    return field in table or any(".".join(parts[:i]) + ".*" in table for i in range(1, len(parts)))


@pytest.mark.skipif(not WHEEL.is_file(), reason="torchtitan 0.2.2's wheel is not downloaded")
def test_every_field_of_torchtitan_0_2_2_s_job_config_is_classified():
    fields = _wheel_fields()
    assert len(fields) > 140 and "parallelism.disable_loss_parallel" in fields
    assert [f for f in fields if not _known(f)] == []


def test_each_flavor_s_shapes_are_its_preset_s():
    """The FeedForward rounding (4·dim → 2/3 → × multiplier → up to multiple_of) gives the Llama 3.1
    presets' ffn; the other shapes are the preset's too."""
    for row in titan.flavors().values():
        spec = titan.flavor_spec(row)
        if row["preset"]:
            preset = model_preset(row["preset"])
            keep = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size")
            assert {k: getattr(spec, k) for k in keep} == {k: getattr(preset, k) for k in keep}
    debug = titan.flavor_spec(titan.flavors()[("llama3", "debugmodel")])
    assert debug.ffn_hidden == 768  # int(2·1024/3) = 682, up to a multiple of 256


# --- torchtitan's own files --------------------------------------------------------------


def test_the_8b_file_is_read_as_torchtitan_runs_it():
    got = read(DATA / "llama3_8b.toml")
    assert got.format == "torchtitan" and got.assumed[0][0] == "gpus"
    want = {
        "model": "llama-3.1-8b",
        "gpus": 8,  # run_train.sh NGPU; shard -1 takes all 8
        "strategy": "fsdp-full-shard",
        "seq_len": 8192,
        "micro_batch": 1,  # training.batch_size (before 0.2)
        "grad_accum": 1,
        "precision": "mixed-bf16",  # mixed_precision_param bfloat16 by default, through fully_shard
        "reduce_dtype": "fp32",
        "ac": "op",
        "compile": False,
        "float8": False,
        "zero_grad": "none",
    }
    assert {k: got.inputs[k] for k in want} == want


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_file_estimates_with_no_other_flag(name):
    result = _cli("estimate", "--from", str(DATA / name), "--format", "json", "--calibration", "none")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["estimates"]
    assert row["bytes"]["total"] > 0 if isinstance(row["bytes"], dict) else row["bytes"] > 0
    assert "assumed gpus 8" in result.stderr


def test_the_405b_file_s_float8_all_gather_is_refused_in_one_line():
    result = _cli("estimate", "--from", str(DATA / "llama3_405b.toml"))
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "float8.enable_fsdp_float8_all_gather" in result.output and "llama3_405b.toml" in result.output


FLAGS_8B = (
    "--model llama-3.1-8b --gpus 8 --strategy fsdp-full-shard --seq-len 8192 --micro-batch 1 --grad-accum 1 "
    "--precision mixed-bf16 --reduce-dtype fp32 --recipe torchtitan --ac op --zero-grad none --optimizer adamw "
    "--optimizer-impl fused --no-compile --no-float8"
)
FLAGS_70B_64 = (
    "--model llama-3.1-70b --gpus 64 --strategy fsdp-full-shard --tp 8 --seq-len 8192 --micro-batch 8 "
    "--precision mixed-bf16 --reduce-dtype fp32 --recipe torchtitan --ac full --zero-grad none --optimizer-impl fused"
)


@pytest.mark.parametrize(
    ("name", "extra", "flags"),
    [("llama3_8b.toml", (), FLAGS_8B), ("llama3_70b.toml", ("--gpus", "64"), FLAGS_70B_64)],
)
@pytest.mark.parametrize("command", ["estimate", "explain"])
def test_the_file_s_estimate_is_the_same_job_stated_with_flags_byte_for_byte(name, extra, flags, command):
    """The 8B file at torchrun's 8 GPUs; the 70B at the 64 its comment names (8 × TP 8: FSDP over 8).
    The report of the job is the same to the byte; the recommendation after it searches what the
    flags did not fix (a file's values are searched, as ``recommend --from`` documents)."""
    via_file = _cli(command, "--from", str(DATA / name), *extra)
    via_flags = _cli(command, *flags.split())
    assert via_file.exit_code == 0 and via_flags.exit_code == 0, via_file.output + via_flags.output
    assert via_file.stdout.split("Recommendation")[0] == via_flags.stdout.split("Recommendation")[0]
    assert len(via_file.stdout.split("Recommendation")[0]) > 500


def test_the_70b_file_at_8_gpus_is_tp_alone_in_fp32():
    """tp 8 over 8 ranks leaves shard 1: no FSDP, and maybe_enable_amp turns mixed precision off under TP."""
    got = read(DATA / "llama3_70b.toml").inputs
    assert (got["strategy"], got["tp"], got["precision"]) == ("single", 8, "fp32")
    assert read(DATA / "llama3_70b.toml", gpus=64).inputs["strategy"] == "fsdp-full-shard"


def test_explain_config_lists_the_8b_file_s_fields():
    result = _cli("estimate", "--from", str(DATA / "llama3_8b.toml"), "--explain-config")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert 'model.flavor = "8B" → model' in out and "ignored (no memory effect)" in out
    assert "optimizer.lr" in out and "training.batch_size = 1 → micro_batch" in out


# --- the mapping -------------------------------------------------------------------------

BASE = {"model": {"name": "llama3", "flavor": "8B"}}


@pytest.mark.parametrize(
    ("change", "want"),
    [
        (
            {"parallelism": {"data_parallel_shard_degree": 4, "data_parallel_replicate_degree": 2}},
            {"strategy": "fsdp-hybrid-shard", "gpus": 8, "gpus_per_node": 4},
        ),
        (
            {"parallelism": {"data_parallel_shard_degree": 1, "data_parallel_replicate_degree": 8}},
            {"strategy": "ddp", "precision": "amp-bf16"},
        ),
        ({"parallelism": {"fsdp_reshard_after_forward": "never"}}, {"strategy": "fsdp-shard-grad-op"}),
        (
            {
                "parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "Interleaved1F1B"},
                "training": {"local_batch_size": 4},
            },
            {
                "strategy": "fsdp-shard-grad-op",
                "pp": 2,
                "pp_schedule": "interleaved-1f1b",
                "pp_virtual": 2,
                "micro_batch": 1,
                "pp_microbatches": 4,
            },
        ),
        ({"training": {"dtype": "bfloat16"}}, {"precision": "bf16"}),
        ({"training": {"mixed_precision_param": "float32"}}, {"precision": "fp32"}),
        ({"training": {"local_batch_size": 2, "global_batch_size": 64}}, {"micro_batch": 2, "grad_accum": 4}),
        ({"training": {"enable_cpu_offload": True}}, {"offload": "all"}),
        ({"activation_checkpoint": {"mode": "selective", "selective_ac_option": "3"}}, {"ac": "full", "ac_every": 3}),
        ({"activation_checkpoint": {"mode": "none"}}, {"ac": "none"}),
        ({}, {"ac": "full", "ac_every": 2}),  # JobConfig's default: selective, option "2"
        (
            {
                "compile": {"enable": True},
                "parallelism": {"tensor_parallel_degree": 2, "enable_async_tensor_parallel": True},
            },
            {"compile": True, "async_tp": True, "tp": 2, "sp": True},
        ),
        ({"model": {"name": "llama3", "flavor": "8B", "converters": ["float8"]}}, {"float8": True}),
        (
            {"optimizer": {"name": "Adam", "implementation": "for-loop", "early_step_in_backward": True}},
            {"optimizer": "adam", "optimizer_impl": "single", "optimizer_in_backward": True},
        ),
        ({"parallelism": {"data_parallel_shard_degree": 4, "context_parallel_degree": 2}}, {"cp": 2, "gpus": 8}),
    ],
)
def test_each_memory_field_sets_its_input(tmp_path, change, want):
    got = read(_toml(tmp_path, BASE | change)).inputs
    assert {k: got.get(k) for k in want} == want


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": {"name": "llama3", "flavor": "1B"}}, "model.flavor"),
        ({"model": {"name": "deepseek_v3", "flavor": "16B"}}, "model.name"),
        ({"model": {"name": "llama3", "flavor": "8B", "converters": ["mx"]}}, "model.converters"),
        ({"activation_checkpoint": {"mode": "memory_budget"}}, "activation_checkpoint.mode"),
        (
            {"activation_checkpoint": {"mode": "selective", "selective_ac_option": "layer"}},
            "activation_checkpoint.selective_ac_option",
        ),
        (
            {"parallelism": {"tensor_parallel_degree": 2, "context_parallel_degree": 2, "disable_loss_parallel": True}},
            "parallelism.disable_loss_parallel",
        ),
        ({"parallelism": {"fsdp_reshard_after_forward": "always"}}, "parallelism.fsdp_reshard_after_forward"),
        (
            {"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "DualPipeV"}},
            "parallelism.pipeline_parallel_schedule",
        ),
        ({"parallelism": {"data_parallel_shard_degree": 3}}, "parallelism.data_parallel_shard_degree"),
        (
            {"parallelism": {"tensor_parallel_degree": 2, "enable_async_tensor_parallel": True}},
            "parallelism.enable_async_tensor_parallel",
        ),
        ({"optimizer": {"name": "Muon"}}, "optimizer.name"),
        ({"compile": {"enable": True, "components": ["model"]}}, "compile.components"),
        ({"training": {"dtype": "float16"}}, "training.dtype"),
        ({"training": {"local_batch_size": 3, "global_batch_size": 32}}, "training.global_batch_size"),
        (
            {"quantize.linear.float8": {"enable_fsdp_float8_all_gather": True}},
            "quantize.linear.float8.enable_fsdp_float8_all_gather",
        ),
        ({"validation": {"enable": True}}, "validation.enable"),
        ({"experimental": {"custom_import": "my.module"}}, "experimental.custom_import"),
        ({"training": {"no_such_key": 1}}, "training.no_such_key"),
    ],
)
def test_a_field_memplan_does_not_model_or_an_unknown_value_is_refused_naming_it(tmp_path, change, field):
    path = _toml(tmp_path, BASE | change)
    with pytest.raises(InputError) as err:
        read(path, gpus=8)
    assert err.value.field == field and str(path) in str(err.value)


def test_a_refused_value_is_one_line_and_exit_2(tmp_path):
    path = _toml(tmp_path, BASE | {"activation_checkpoint": {"mode": "sometimes"}})
    result = _cli("estimate", "--from", str(path))
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "activation_checkpoint.mode" in result.output and '"sometimes"' in result.output
    assert "none, full, selective" in result.output and "Traceback" not in result.output


def test_format_is_detected_or_named(tmp_path):
    path = _toml(tmp_path, BASE, "job.cfg")
    assert read(f"torchtitan:{path}").format == "torchtitan"
    assert read(_toml(tmp_path, BASE)).format == "torchtitan"


def test_explicit_gpus_resolve_the_shard_degree_and_no_assumption_is_said():
    via = _cli("estimate", "--from", str(DATA / "llama3_8b.toml"), "--gpus", "16", "--calibration", "none")
    assert via.exit_code == 0, via.output
    assert "assumed" not in via.stderr and "16 ×" in via.stdout


# --- round trip ----------------------------------------------------------------------------

ROUND_TRIP = [
    # (strategy, gpus, precision, layout, ac, ac_every, extra)
    ("fsdp-full-shard", 8, "mixed-bf16", {}, "op", 1, {}),
    ("fsdp-full-shard", 8, "fp32", {}, "full", 1, {"compile": True}),
    ("fsdp-full-shard", 8, "bf16", {"tp": 2}, "full", 2, {"float8": True}),
    ("fsdp-full-shard", 16, "mixed-bf16", {"tp": 2, "cp": 2}, "none", 1, {"offload": "all"}),
    ("fsdp-full-shard", 8, "mixed-bf16", {"tp": 2, "async_tp": True}, "op", 1, {"compile": True}),
    ("fsdp-full-shard", 8, "mixed-bf16", {"tp": 2, "tp_plan": "tutorial"}, "full", 1, {}),
    ("fsdp-shard-grad-op", 8, "mixed-bf16", {}, "full", 1, {"grad_accum": 4}),
    ("fsdp-shard-grad-op", 16, "mixed-bf16", {"pp": 2, "pp_microbatches": 4}, "full", 1, {}),
    (
        "fsdp-shard-grad-op",
        16,
        "mixed-bf16",
        {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual": 2, "pp_microbatches": 4},
        "full",
        1,
        {},
    ),
    ("fsdp-hybrid-shard", 16, "mixed-bf16", {}, "full", 1, {}),
    ("ddp", 8, "amp-bf16", {}, "none", 1, {"optimizer_impl": "foreach"}),
    ("ddp", 8, "fp32", {}, "full", 1, {"optimizer": "adam"}),
    ("single", 1, "amp-bf16", {}, "op", 1, {"optimizer_in_backward": True}),
    ("single", 1, "bf16", {}, "none", 1, {}),
]


@pytest.mark.parametrize("flavor", ["8B", "debugmodel"])
@pytest.mark.parametrize(("strategy", "gpus", "precision", "layout", "ac", "every", "extra"), ROUND_TRIP)
def test_an_emitted_torchtitan_file_reads_back_to_the_same_estimate(
    tmp_path, flavor, strategy, gpus, precision, layout, ac, every, extra
):
    """``--emit torchtitan`` then ``--from``: the same job and the same estimate, for each strategy the
    emitter writes, with the loop torchtitan 0.2.2 runs (its recipe, zero_grad(set_to_none), FSDP's
    fp32 reduction)."""
    from memplan.emit import emit
    from memplan.inputs import build_jobs
    from memplan.memory import estimate
    from memplan.request import Request

    model = titan.model_of(titan.flavors()[("llama3", flavor)])
    sharded = strategy.startswith("fsdp") or layout.get("cp", 1) > 1
    request = Request.of(
        model=model,
        gpus=gpus,
        strategy=strategy,
        precision=precision,
        ac=ac,
        ac_every=every,
        recipe="torchtitan",
        zero_grad="none",
        reduce_dtype="fp32" if sharded else None,
        seq_len=1024,
        **layout,
        **extra,
    )
    (job,) = build_jobs(request)[1]
    text = emit(job, "torchtitan")
    assert "runs this with" not in text and "[model]" in text
    path = tmp_path / "job.toml"
    path.write_text(text)
    (back,) = build_jobs(Request.of(gpus=gpus, **read(path, gpus=gpus).inputs))[1]
    assert back.plan == job.plan and back.train == job.train and back.model == job.model
    assert back.layout.microbatches == job.layout.microbatches
    assert dataclasses.replace(back.layout, pp_microbatches=1) == dataclasses.replace(job.layout, pp_microbatches=1)
    assert estimate(back).allocated_bytes == estimate(job).allocated_bytes
    assert estimate(back).total_bytes == estimate(job).total_bytes


def test_an_emitted_file_uses_only_torchtitan_0_2_2_s_fields():
    from memplan.emit import emit
    from memplan.inputs import build_jobs
    from memplan.request import Request

    request = Request.of(
        model="llama-3.1-8b",
        gpus=16,
        strategy="fsdp-shard-grad-op",
        tp=2,
        pp=2,
        pp_microbatches=4,
        compile=True,
        async_tp=True,
        float8=True,
        ac="op",
    )
    (job,) = build_jobs(request)[1]
    data = tomllib.loads(emit(job, "torchtitan"))
    leaves = [f"{s}.{k}" for s, values in data.items() for k in values]
    assert leaves and all(
        _known(f) and "before 0.2" not in field_table("torchtitan").get(f, {}).get("source", "") for f in leaves
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"ac": "selective"}, "ac selective"),
        ({"sp": False, "tp": 2}, "sequence parallel"),
        ({"tp_plan": "blocks", "tp": 2}, "tp-plan blocks"),
        ({"precision": "mixed-fp16"}, "precision mixed-fp16"),
        ({"pp": 2, "pp_microbatches": 4}, "fsdp-full-shard under PP"),
        ({"optimizer": "lion"}, "optimizer lion"),
    ],
)
def test_a_job_torchtitan_cannot_say_is_refused_by_the_emitter_in_one_line(change, words):
    from memplan.emit import emit
    from memplan.errors import MemplanError
    from memplan.inputs import build_jobs
    from memplan.request import Request

    base = {"model": "llama-3.1-8b", "gpus": 16, "strategy": "fsdp-full-shard"}
    (job,) = build_jobs(Request.of(**(base | change)))[1]
    with pytest.raises(MemplanError) as err:
        emit(job, "torchtitan")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_note_lists_every_torchtitan_field_by_its_status():
    """docs/readers.md's three lists are the table's torchtitan rows, in order."""
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "readers.md").read_text()
    table = field_table("torchtitan")
    for status, label in (
        ("modelled", "modelled"),
        ("default-only", "refused unless at torchtitan's default"),
        ("ignored", "ignored (no memory effect)"),
    ):
        line = next(x for x in text.splitlines() if x.startswith(f"- {label} ("))
        assert re.findall(r"`([^`]+)`", line) == [f for f, row in table.items() if row["status"] == status]
