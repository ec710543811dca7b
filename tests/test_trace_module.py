"""``--mode trace`` of a model built by its own code (calibrate.usermodel): a user's ``--module``
factory (tests/data/usermodels: a small GPT written here, and transformers' Llama), its own
``--step``, and a ``--config`` of a family memplan does not describe (gemma2); their records
through ``calibrate report`` and ``fit``; bad factories refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from calibrate import records, report, runs, trace, usermodel  # noqa: E402
from calibrate.records import STAND_IN, Run, UserModel  # noqa: E402
from memplan.cli import main  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402
from memplan.hfconfig import model_from_hf_config  # noqa: E402
from memplan.specs import ClusterSpec, Job, Plan, TrainSpec  # noqa: E402

DATA = Path(__file__).parent / "data" / "usermodels"
FULLSIZE = Path(__file__).parent.parent / "validation" / "records" / "trace_fullsize.jsonl"
BATCH, SEQ, WORLD = 2, 32, 4
INT64_BYTES = 8
TINYGPT = UserModel(factory="tinygpt:build", units="blocks", no_estimate="memplan does not describe tinygpt:build")


@pytest.fixture(autouse=True)
def _in_data(monkeypatch):
    """The factories' folder is the current directory, as for `python -m` (usermodel.resolve)."""
    monkeypatch.chdir(DATA)
    monkeypatch.syspath_prepend(str(DATA))


def _job(model=STAND_IN, strategy="fsdp-full-shard", gpus=WORLD, **train) -> Job:
    step = TrainSpec(seq_len=SEQ, micro_batch=BATCH, precision="fp32", device="cpu")
    return Job(model=model, train=replace(step, **train), cluster=ClusterSpec(gpus=gpus), plan=Plan(strategy=strategy))


def _gemma2_config() -> dict:
    """A small gemma2 (transformers' Gemma2Config with 2 layers of width 64, saved)."""
    return json.loads((DATA / "gemma2" / "config.json").read_text(encoding="utf-8"))


def _on_real_tensors(job: Job, user: UserModel):
    """The same job on real tensors, rank 0 of a fake process group (``--mode emulate``'s world)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from calibrate import measure

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        return measure.run(job, steps=2, warmup=1, emulated=True, user=usermodel.UserWorkload(user))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("nosuch:build", "module 'nosuch' cannot be imported"),
        ("tinygpt:missing", "has no 'missing'"),
        ("tinygpt:not_a_module", "returned a tensor, not a torch nn.Module"),
        ("tinygpt:VOCAB", "is not a function"),
        ("tinygpt", "is not package.module:function"),
        ("tinygpt:no_input", "has no nn.Embedding to draw token ids for: define example_input(batch, seq)"),
    ],
)
def test_a_bad_factory_is_refused_in_one_line(factory, words):
    found = usermodel.probe(UserModel(factory=factory))
    assert words in found["error"] and factory in found["error"] and "\n" not in found["error"]


def test_a_config_transformers_cannot_build_is_refused_in_one_line():
    found = usermodel.probe(UserModel(config={"model_type": "nosuchmodel", "hidden_size": 64}))
    assert found["error"].startswith("--config model_type 'nosuchmodel': transformers builds no causal LM of it (")
    assert "\n" not in found["error"]


def test_the_probe_finds_the_units_and_a_spec_where_memplan_reads_the_config():
    gpt = usermodel.probe(UserModel(factory="tinygpt:build"))
    assert gpt == {"model": "TinyGPT", "units": "blocks", "spec": None}
    llama = usermodel.probe(UserModel(factory="hfllama:build"))
    assert llama["units"] == "model.layers" and llama["spec"]["num_layers"] == 2
    flat = usermodel.probe(UserModel(factory="tinygpt:flat"))
    assert "no nn.ModuleList" in flat["no_units"] and "--units" in flat["no_units"]
    wrong = usermodel.probe(UserModel(factory="tinygpt:build", units="norm"))
    assert wrong == {"error": "--units 'norm' is not an nn.ModuleList of TinyGPT"}


def test_the_flags_name_a_user_model_only_under_trace():
    user, flags = runs.user_model({"model": None}, mode="trace", module="tinygpt:build")
    assert user is not None and user.factory == "tinygpt:build" and flags["model"] is STAND_IN
    for flags, mode, module, step, words in [
        ({}, "emulate", "tinygpt:build", None, "runs under --mode trace, not --mode emulate"),
        ({"model": "llama-3.1-8b"}, "trace", "tinygpt:build", None, "drop --model"),
        ({"config": None}, "trace", None, "tinygpt:train_step", "--step goes with --module"),
        ({"grad_accum": 2}, "trace", "tinygpt:build", "tinygpt:train_step", "drop --grad-accum 2"),
    ]:
        with pytest.raises(MemplanError, match=words):
            runs.user_model(flags, mode=mode, module=module, step=step)
    gemma2 = _gemma2_config()
    user, flags = runs.user_model({"config": gemma2}, mode="trace", module=None)
    assert user.config == gemma2 and "gemma2" in user.no_estimate and flags["config"] is None
    with pytest.raises(MemplanError, match="gemma2"):  # the same words memplan refuses it with
        model_from_hf_config(gemma2)
    assert runs.user_model({"config": gemma2}, mode="emulate", module=None) == (None, {"config": gemma2})


def test_a_user_models_record_has_no_estimate_and_report_and_fit_read_it():
    run = Run(job=_job(), mode="trace", steps=2, warmup=1, user=TINYGPT)
    measurement = {"device": trace.DEVICE, "torch_version": torch.__version__, "peak_allocated_bytes": 1 << 20}
    record = records.make_record(run, status="ok", measurement=measurement, error=None, wall_s=1.0)
    assert record["estimate"] is None and record["estimate_error"] == TINYGPT.no_estimate
    assert record["user"] == {"factory": "tinygpt:build", "units": "blocks", "no_estimate": TINYGPT.no_estimate}
    assert Run.from_dict(record).key == run.key == records.record_key(record)
    assert "user" not in Run(job=_job(), mode="trace").to_dict()  # other runs keep their keys
    (row,) = report.rows([record])
    assert row["measured_bytes"] == 1 << 20 and row["estimated_bytes"] is None and row["error_pct"] is None
    assert "module tinygpt:build" in row["run"]


def test_fit_says_it_skips_a_record_without_an_estimate(tmp_path):
    run = Run(job=_job(), mode="trace", steps=2, warmup=1, user=TINYGPT)
    measurement = {"device": trace.DEVICE, "torch_version": "2.13.0+cpu", "peak_allocated_bytes": 1 << 20}
    path = tmp_path / "user.jsonl"
    records.append(path, records.make_record(run, status="ok", measurement=measurement, error=None, wall_s=1.0))
    alone = CliRunner().invoke(main, ["calibrate", "fit", str(path), "-o", str(tmp_path / "c.json")])
    assert alone.exit_code == 2 and "nothing to fit" in alone.output
    both = CliRunner().invoke(main, ["calibrate", "fit", str(path), str(FULLSIZE), "-o", str(tmp_path / "c.json")])
    assert both.exit_code == 0, both.output
    assert f"skipping 1 ok record(s) without an estimate, nothing to fit against (first: {TINYGPT.no_estimate})" in (
        both.output
    )
    assert f"{len(records.read([FULLSIZE]))} records" in both.output


@pytest.mark.parametrize("step", [None, pytest.param("tinygpt:train_step", marks=pytest.mark.slow)])
def test_a_traced_module_agrees_with_the_same_module_on_real_tensors(step):
    user = replace(TINYGPT, step=step)
    traced = trace.run(_job(), user=user)
    real = _on_real_tensors(_job(), user)
    # emulate's device-mesh tensor (int64), built outside the fake mode in trace (test_trace.py)
    assert traced.peak_allocated_bytes == pytest.approx(real.peak_allocated_bytes, abs=64)
    assert traced.phase == real.phase == ("step" if step else traced.phase)
    for category, nbytes in real.categories.items():
        assert traced.categories[category] == pytest.approx(nbytes, abs=64)
    assert traced.peak_reserved_bytes >= traced.peak_allocated_bytes


def test_a_module_makes_its_own_input_and_without_units_runs_unsharded_only():
    from regressor import FEATURES, build  # tests/data/usermodels

    regressor = UserModel(factory="regressor:build")
    assert "no nn.ModuleList" in usermodel.probe(regressor)["no_units"]
    traced = trace.run(_job(strategy="single", gpus=1), user=regressor)
    # fp32 parameters with their gradients and AdamW's two moments at the optimizer step, and
    # the input made by example_input (b × s × FEATURES fp32), live through the step
    param_bytes = 4 * sum(p.numel() for p in build().parameters())
    assert traced.peak_allocated_bytes >= 4 * param_bytes + 4 * BATCH * SEQ * FEATURES
    with pytest.raises(usermodel.UserModelError, match=r"Sequential has no nn\.ModuleList"):
        trace.run(_job(), user=regressor)


def test_transformers_llama_as_a_module_traces_as_its_config_does():
    from hfllama import CONFIG  # tests/data/usermodels

    spec = model_from_hf_config({"model_type": "llama", **CONFIG})
    by_config = trace.run(_job(spec), workload="hf")
    by_module = trace.run(_job(spec), user=UserModel(factory="hfllama:build"))
    # the one difference: the module's input ids (int64, b × s) are drawn after it is built
    # (their vocabulary is its embedding's), inside the tracker; the spec's before it
    assert by_module.peak_allocated_bytes - by_config.peak_allocated_bytes == INT64_BYTES * BATCH * SEQ
    assert by_module.peak_reserved_bytes == by_config.peak_reserved_bytes
    assert by_module.phase == by_config.phase
    assert {k: v for k, v in by_module.categories.items() if k != "Activation"} == {
        k: v for k, v in by_config.categories.items() if k != "Activation"
    }


def test_a_gemma2_config_traces_though_memplan_does_not_describe_it():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _gemma2_config()
    # under full AC: transformers' KV cache, which a recomputed block would grow, is off
    traced = trace.run(_job(activation_checkpointing="full"), user=UserModel(config=config, no_estimate="gemma2"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    # fp32 parameters and AdamW's two moments, sharded over the world, are live at the peak
    assert traced.peak_allocated_bytes > 3 * param_bytes / WORLD
    assert traced.categories["Optstate"] >= 2 * param_bytes / WORLD


def test_the_cli_refuses_a_factory_it_cannot_import_in_one_line():
    result = CliRunner().invoke(
        main,
        ["calibrate", "run", "--module", "nosuch:factory", "--mode", "trace", "--device", "cpu", "--out", "x.jsonl"],
    )
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: --module 'nosuch:factory': module 'nosuch' cannot be imported (No module named 'nosuch')"
    ]


@pytest.mark.slow
def test_the_cli_traces_a_module_and_a_gemma2_config_and_report_and_fit_read_them(tmp_path):
    out, config = tmp_path / "runs.jsonl", DATA / "gemma2"
    common = ["--seq-len", SEQ, "--micro-batch", BATCH, "--precision", "fp32", "--device", "cpu", "--gpus", WORLD]
    common += ["--strategy", "fsdp-full-shard", "--mode", "trace", "--steps", 2, "--warmup", 1, "--out", out]
    for source in (["--module", "tinygpt:build"], ["--config", config]):
        result = CliRunner().invoke(main, ["calibrate", "run", *map(str, source + common)])
        assert result.exit_code == 0, result.output
    recorded = records.read([out])
    assert [r["status"] for r in recorded] == ["ok", "ok"]
    assert [r["user"]["units"] for r in recorded] == ["blocks", "model.layers"]
    assert all(r["estimate"] is None for r in recorded)
    table = CliRunner().invoke(main, ["calibrate", "report", str(out)])
    assert table.exit_code == 0 and "module tinygpt:build" in table.output and "gemma2 (config)" in table.output
    fit = CliRunner().invoke(main, ["calibrate", "fit", str(out), str(FULLSIZE), "-o", str(tmp_path / "c.json")])
    assert fit.exit_code == 0 and "skipping 2 ok record(s) without an estimate" in fit.output
