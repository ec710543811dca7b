"""memplan.readers: a framework's own config file read into memplan's inputs (issue 27).

The DeepSpeed files in tests/data/deepspeed are Hugging Face's documented ZeRO-2 / ZeRO-3
configs (its DeepSpeed integration guide, without the offload sections) and configs as users write
them; the expected inputs are read off each file by DeepSpeed's own rules (its defaults where the
file is silent), the ``"auto"`` values checked against transformers' own resolution."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from memplan.catalog import model_preset, read_table
from memplan.emit import emit
from memplan.errors import InputError
from memplan.memory import estimate
from memplan.readers import field_table, read
from memplan.request import Request
from memplan.specs import AUTO, ZeroConfig

DATA = Path(__file__).resolve().parent / "data" / "deepspeed"
DS_DEFAULT_BUCKET = 500_000_000  # deepspeed/runtime/zero/config.py reduce_bucket_size / allgather_bucket_size


def _zero(**given) -> ZeroConfig:
    """DeepSpeed's defaults (overlap_comm: stage 3 only) with ``given`` over them."""
    stage = given.pop("stage")
    return ZeroConfig(
        **{
            "reduce_bucket_size": DS_DEFAULT_BUCKET,
            "allgather_bucket_size": DS_DEFAULT_BUCKET,
            "overlap_comm": stage == 3,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_param_persistence_threshold": 100_000,
            **given,
        }
    )


EXPECTED = {
    "hf_zero2.json": dict(
        strategy="zero2",
        offload="none",
        optimizer="adamw",
        zero=_zero(stage=2, reduce_bucket_size=200_000_000, allgather_bucket_size=200_000_000, overlap_comm=True),
    ),
    "hf_zero3.json": dict(
        strategy="zero3",
        offload="none",
        optimizer="adamw",
        zero=_zero(
            stage=3,
            reduce_bucket_size=AUTO,
            stage3_prefetch_bucket_size=AUTO,
            stage3_param_persistence_threshold=AUTO,
        ),
    ),
    "zero2_user_buckets.json": dict(
        strategy="zero2",
        offload="none",
        micro_batch=1,
        grad_accum=1,
        precision="mixed-bf16",
        zero=_zero(stage=2, reduce_bucket_size=500_000, allgather_bucket_size=500_000, overlap_comm=False),
    ),
    "zero3_user_buckets.json": dict(
        strategy="zero3",
        offload="none",
        micro_batch=1,
        grad_accum=1,
        precision="mixed-bf16",
        zero=_zero(
            stage=3,
            reduce_bucket_size=1_000_000,
            stage3_prefetch_bucket_size=200_000,
            stage3_param_persistence_threshold=1_000,
        ),
    ),
    "zero2_stage_only.json": dict(
        strategy="zero2", offload="none", micro_batch=1, precision="mixed-bf16", zero=_zero(stage=2)
    ),
    "zero3_stage_only.json": dict(
        strategy="zero3", offload="none", micro_batch=1, precision="mixed-bf16", zero=_zero(stage=3)
    ),
    "zero1_stage_only_fp32.json": dict(
        strategy="zero1", offload="none", micro_batch=1, precision="fp32", zero=_zero(stage=1)
    ),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_each_file_sets_the_inputs_deepspeed_reads_from_it(name):
    assert read(DATA / name).inputs == EXPECTED[name]


def test_the_trainer_s_auto_values_are_left_to_the_flags():
    assert read(DATA / "hf_zero3.json").deferred == ("micro_batch", "grad_accum", "precision")


def test_every_field_of_a_file_is_accounted_for_and_the_ignored_ones_listed():
    config = read(DATA / "hf_zero3.json")
    data = json.loads((DATA / "hf_zero3.json").read_text())
    listed = {f.field.split(".")[0] for f in config.fields}
    assert listed == set(data)
    ignored = {f.field for f in config.ignored()}
    assert {"scheduler", "optimizer.params", "steps_per_print", "fp16.loss_scale"} <= ignored
    text = config.explain()
    assert all(field in text for field in ignored)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("preset", ["llama-2-7b", "gpt2"])
def test_auto_values_resolve_as_the_trainer_resolves_them(preset):
    """transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize on the same file and model."""
    import types

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    model = model_preset(preset)
    hf = HfTrainerDeepSpeedConfig(json.loads((DATA / "hf_zero3.json").read_text()))
    args = types.SimpleNamespace(get_warmup_steps=lambda steps: 0)
    hf.trainer_config_finalize(args, types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=model.hidden)), 10)
    want = hf.config["zero_optimization"]
    got = read(DATA / "hf_zero3.json").inputs["zero"].resolved(model.hidden)
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        assert getattr(got, key) == want[key], key


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_every_field_deepspeed_defines_is_classified():
    """The installed DeepSpeed's own config classes: each zero_optimization field (by its JSON name)
    and each offload field has a row in tables/config_fields.csv."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    table = field_table("deepspeed")
    names = {f"zero_optimization.{f.alias or n}" for n, f in DeepSpeedZeroConfig.model_fields.items()}
    names -= {"zero_optimization.offload_param", "zero_optimization.offload_optimizer"}
    names |= {f"zero_optimization.offload_optimizer.{n}" for n in DeepSpeedZeroOffloadOptimizerConfig.model_fields}
    names |= {f"zero_optimization.offload_param.{n}" for n in DeepSpeedZeroOffloadParamConfig.model_fields}
    assert sorted(names - set(table)) == []


def _write(tmp_path, config: dict) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "zero_optimization.zero_quantized_weights",
        ),
        ({"zero_optimization": {"stage": 3, "sub_group_size": 1e6}}, "zero_optimization.sub_group_size"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            "zero_optimization.offload_optimizer.device",
        ),
        ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": 2}, "communication_data_type": "fp32"}, "communication_data_type"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "OneBitAdam"}}, "optimizer.type"),
        ({"zero_optimization": {"stage": 2}, "zero_optimisation": {}}, "zero_optimisation"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
    ],
)
def test_a_field_memplan_does_not_model_is_refused_naming_it_and_the_file(tmp_path, config, field):
    path = _write(tmp_path, config)
    with pytest.raises(InputError) as err:
        read(path)
    assert err.value.field == field
    assert str(path) in str(err.value) and field in str(err.value)


def test_defaults_of_memory_relevant_fields_are_accepted(tmp_path):
    config = {"zero_optimization": {"stage": 3, "zero_quantized_weights": False, "sub_group_size": 2e9}}
    assert read(_write(tmp_path, config)).inputs["strategy"] == "zero3"


def test_train_batch_size_gives_the_world_size(tmp_path):
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    config["zero_optimization"] = {"stage": 1}
    assert read(_write(tmp_path, config)).inputs["gpus"] == 8


def test_the_format_is_detected_or_named(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 1}})
    assert read(f"deepspeed:{path}").inputs == read(path).inputs
    other = tmp_path / "x.json"
    other.write_text("{}")
    with pytest.raises(InputError, match="deepspeed:"):
        read(other)


def test_the_field_table_uses_known_statuses():
    assert {row["status"] for row in read_table("config_fields.csv")} <= {
        "modelled",
        "ignored",
        "default-only",
        "at-least",
    }


JOBS = [
    dict(strategy=s, precision=p, offload=o)
    for s in ("zero1", "zero2", "zero3")
    for p in ("fp32", "mixed-bf16", "mixed-fp16")
    for o in ("none", "optimizer", "params", "all")
    if o == "none" or (o == "optimizer") or s == "zero3"
]


@pytest.mark.parametrize("inputs", JOBS, ids=lambda j: "-".join(j.values()))
def test_an_emitted_deepspeed_config_reads_back_to_the_same_estimate(tmp_path, inputs):
    """``--emit deepspeed`` then ``--from`` on its output: the same job, the same bytes."""
    from memplan.inputs import build_jobs

    request = Request.of(model="llama-2-7b", gpus=8, micro_batch=2, grad_accum=3, **inputs)
    (job,) = build_jobs(request)[1]
    path = tmp_path / "ds_config.json"
    path.write_text(emit(job, "deepspeed"))
    (back,) = build_jobs(Request.of(model="llama-2-7b", **read(path).inputs))[1]
    assert dataclasses.replace(back.plan, zero=None) == job.plan
    assert back.train == job.train and back.cluster.gpus == job.cluster.gpus
    assert estimate(back).allocated_bytes == estimate(job).allocated_bytes


# --- the command line ----------------------------------------------------------------


def _cli(*args):
    from click.testing import CliRunner

    from memplan.cli import main

    return CliRunner().invoke(main, list(args))


def _json_estimate(*args) -> dict:
    result = _cli("estimate", "--format", "json", "--calibration", "none", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_estimate_from_a_file_is_the_estimate_of_the_job_it_describes():
    """The user-bucket ZeRO-3 file against the same job given as inputs (its ZeroConfig through the API)."""
    from memplan import api

    path = DATA / "zero3_user_buckets.json"
    got = _json_estimate("--model", "llama-2-7b", "--gpus", "8", "--from", str(path))
    want = api.estimate(model="llama-2-7b", gpus=8, calibration=None, **EXPECTED[path.name])
    (row,) = got["estimates"]
    assert row["strategy"] == "zero3"
    assert row["bytes"]["allocated"] == want.estimates[0].allocated_bytes
    # and not the job with the buckets memplan emits (a 5e8-element ipg bucket, 1 GB in bf16)
    emitted = api.estimate(model="llama-2-7b", gpus=8, calibration=None, **(EXPECTED[path.name] | {"zero": None}))
    assert emitted.estimates[0].allocated_bytes - row["bytes"]["allocated"] >= 2 * (500_000_000 - 1_000_000)


def test_explicit_flags_win_over_the_file_and_the_origins_are_said():
    path = DATA / "zero3_user_buckets.json"
    result = _cli("estimate", "--model", "gpt2", "--micro-batch", "4", "--from", str(path))
    assert result.exit_code == 0, result.output
    assert "micro-batch 4" in result.stdout
    assert "explicit flags win: micro-batch" in result.stderr


def test_explain_config_lists_the_ignored_fields_and_stops():
    result = _cli("estimate", "--model", "gpt2", "--from", str(DATA / "hf_zero2.json"), "--explain-config")
    assert result.exit_code == 0, result.output
    assert "ignored (no memory effect)" in result.stdout and "scheduler" in result.stdout
    assert "peak" not in result.stdout


def test_a_refused_field_is_one_line_and_exit_2(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    result = _cli("estimate", "--model", "gpt2", "--from", str(path))
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "zero_optimization.zero_quantized_gradients" in result.output
    assert str(path) in result.output and "Traceback" not in result.output


def test_explain_config_without_a_file_is_refused():
    result = _cli("estimate", "--model", "gpt2", "--explain-config")
    assert result.exit_code == 2 and "--from" in result.output


def test_zero_config_defaults_are_the_table_s():
    """ZeroConfig() is the config --emit deepspeed writes: tables/deepspeed.csv, overlap_comm on."""
    from memplan.catalog import deepspeed_defaults
    from memplan.frameworks.deepspeed import zero_config

    table = deepspeed_defaults()
    default = ZeroConfig()
    assert {k: getattr(default, k) for k in table if hasattr(default, k)} == {
        k: v for k, v in table.items() if hasattr(default, k)
    }
    from memplan.inputs import build_jobs

    (job,) = build_jobs(Request.of(model="gpt2", strategy="zero3"))[1]
    assert zero_config(job) == default and default.overlap_comm and default.contiguous_gradients
