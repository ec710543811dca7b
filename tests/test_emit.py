"""Launch configurations parse, compile, and use DeepSpeed's own key names."""

import json

import pytest
import tomllib
import yaml
from click.testing import CliRunner

from memplan.catalog import deepspeed_defaults
from memplan.cli import main
from memplan.emit import KINDS, WRITES, deepspeed_config, emit
from memplan.errors import MemplanError
from memplan.inputs import build_jobs


def job(strategy, **kw):
    args = dict(params="7e9", gpus=8, gpu="a100-80gb", strategy=strategy) | kw
    return build_jobs(**args)[1][0]


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard"])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("offload", ["none", "params"])
def test_fsdp_snippets_compile(strategy, ac, offload):
    j = job(strategy, ac=ac, offload=offload, gpus=16)
    for kind in ("fsdp2", "fsdp1"):
        text = emit(j, kind)
        compile(text, f"<{kind}>", "exec")
        assert ("checkpoint_wrapper" in text) == (ac != "none")
        assert ("isinstance(m, attention_cls)" in text) == (ac == "selective")
    fsdp2 = emit(j, "fsdp2")
    assert ("CPUOffloadPolicy()" in fsdp2.split("offload = ")[1].splitlines()[0]) == (offload == "params")
    assert f"reshard_after_forward={strategy != 'fsdp-shard-grad-op'}" in fsdp2
    assert ('mesh_dim_names=("replicate", "shard")' in fsdp2) == (strategy == "fsdp-hybrid-shard")
    assert "ShardingStrategy." + {
        "fsdp-full-shard": "FULL_SHARD",
        "fsdp-shard-grad-op": "SHARD_GRAD_OP",
        "fsdp-hybrid-shard": "HYBRID_SHARD",
    }[strategy] in emit(j, "fsdp1")


def test_fsdp2_snippet_runs_its_imports_when_torch_is_here():
    pytest.importorskip("torch")
    text = emit(job("fsdp-full-shard", ac="full"), "fsdp2")
    namespace = {}
    exec(compile(text, "<fsdp2>", "exec"), namespace)  # imports resolve, wrap() is defined
    assert callable(namespace["wrap"])


@pytest.mark.parametrize(
    "strategy,offload", [("zero1", "none"), ("zero2", "optimizer"), ("zero3", "all"), ("zero3", "params")]
)
def test_deepspeed_config_keys_and_buckets(strategy, offload):
    config = json.loads(emit(job(strategy, offload=offload, micro_batch=2, grad_accum=4), "deepspeed"))
    zero = config["zero_optimization"]
    ds = deepspeed_defaults()  # the same bucket sizes the memory model charges
    assert zero["stage"] == int(strategy[-1])
    assert zero["reduce_bucket_size"] == ds["reduce_bucket_size"]
    assert config["train_batch_size"] == 2 * 4 * 8
    assert ("offload_optimizer" in zero) == (offload in ("optimizer", "all"))
    assert ("offload_param" in zero) == (offload in ("params", "all"))
    if strategy == "zero3":
        assert zero["stage3_max_live_parameters"] == ds["stage3_max_live_parameters"]


@pytest.mark.parametrize("strategy,offload", [("zero1", "none"), ("zero2", "optimizer"), ("zero3", "all")])
def test_deepspeed_accepts_the_config(strategy, offload):
    """DeepSpeed's own pydantic models (extra='forbid') validate the keys and values."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = deepspeed_config(job(strategy, offload=offload))
    zero = DeepSpeedZeroConfig(**config["zero_optimization"])
    assert int(zero.stage) == int(strategy[-1])
    top = {
        constants.TRAIN_BATCH_SIZE,
        constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
        constants.GRADIENT_ACCUMULATION_STEPS,
        constants.BFLOAT16,
        constants.FP16,
        "zero_optimization",
        "activation_checkpointing",
    }
    assert set(config) <= top


def test_accelerate_yaml_parses():
    for strategy, kind in (("fsdp-full-shard", "FSDP"), ("zero3", "DEEPSPEED"), ("ddp", "MULTI_GPU")):
        text = emit(job(strategy, gpus=16), "accelerate")
        config = yaml.safe_load(text)
        assert config["distributed_type"] == kind and config["num_machines"] == 2 and config["num_processes"] == 16


def test_torchrun_one_node_and_srun_several():
    assert "torchrun --standalone --nproc_per_node=8 train.py" in emit(job("ddp"), "torchrun")
    multi = emit(job("fsdp-hybrid-shard", gpus=32), "torchrun")
    assert "srun --nodes=4 --ntasks-per-node=1 --gpus-per-node=8" in multi and "--nnodes=4" in multi


def test_emit_refuses_what_does_not_apply():
    with pytest.raises(MemplanError, match=r"^emit deepspeed does not apply to strategy ddp"):
        emit(job("ddp"), "deepspeed")
    with pytest.raises(MemplanError, match=r"^emit fsdp2 does not apply to strategy zero3"):
        emit(job("zero3"), "fsdp2")
    with pytest.raises(MemplanError, match="emit 'yaml' is not one of"):
        emit(job("ddp"), "yaml")
    assert set(KINDS) == {"fsdp2", "fsdp1", "accelerate", "deepspeed", "torchrun", "torchtitan"}


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1", "accelerate", "deepspeed"])
def test_a_form_that_writes_data_parallel_alone_refuses_a_layout_and_torchrun_says_it(kind):
    """Each of these forms lays its strategy over every GPU: a TP job's file would be another job."""
    args = ["recommend", "--model", "llama-3.1-8b", "--gpus", "16", "--gpu", "h100-sxm", "--tp", "2"]
    strategy = "zero3" if kind == "deepspeed" else "fsdp-full-shard"
    result = CliRunner().invoke(main, [*args, "--strategy", strategy, "--emit", kind])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        f"Error: --emit {kind} writes {strategy} over all 16 GPUs, not the layout TP 2 + SP × dp 8: "
        "use --emit torchtitan (or torchrun, whose script applies it)"
    )
    line = CliRunner().invoke(main, [*args, "--emit", "torchrun"])
    assert line.exit_code == 0 and line.stdout.rstrip().endswith("# the script lays out TP 2 + SP × dp 8")


def test_a_data_parallel_form_takes_data_parallels_pick_where_a_layout_would_win():
    """64 GPUs search the layouts by default; --emit fsdp2 can only write data parallel, so its pick stays."""
    args = ["recommend", "--model", "llama-3.1-70b", "--gpus", "64", "--gpu", "h100-sxm"]
    assert "Recommended layout: TP" in CliRunner().invoke(main, args).stdout
    result = CliRunner().invoke(main, [*args, "--emit", "fsdp2"])
    assert result.exit_code == 0 and "fully_shard(" in result.stdout
    assert "Recommendation (speed): fsdp-" in result.stderr


def test_cli_recommend_emit():
    result = CliRunner().invoke(
        main, ["recommend", "--params", "7e9", "--gpus", "8", "--gpu", "a100-40gb", "--emit", "fsdp2"]
    )
    assert result.exit_code == 0, result.output
    compile(result.stdout, "<cli>", "exec")


RECOMMEND = ["recommend", "--model", "gpt2", "--gpus", "8", "--gpu", "a100-80gb"]


def _emitted(kind: str, *extra: str) -> str:
    """What ``--emit kind`` writes for RECOMMEND's job, from the library (not from the command)."""
    import memplan

    _, rec = memplan.api.recommend(model="gpt2", gpus=8, gpu="a100-80gb", strategies=WRITES.get(kind))
    return emit(rec.best.job, kind)


PARSERS = {
    "deepspeed": json.loads,
    "accelerate": yaml.safe_load,
    "torchtitan": tomllib.loads,
    "fsdp2": lambda text: compile(text, "<fsdp2>", "exec"),
    "fsdp1": lambda text: compile(text, "<fsdp1>", "exec"),
    "torchrun": lambda text: text.splitlines(),
}
"""How each framework reads the file (torchrun's: a shell script's lines)."""


@pytest.mark.parametrize("kind", KINDS)
def test_with_emit_stdout_is_the_file_alone_and_the_report_goes_to_stderr(kind):
    """``recommend --emit X > file``: stdout is exactly what the framework reads; the reasoning
    is on stderr, ending with where the file went."""
    result = CliRunner().invoke(main, [*RECOMMEND, "--emit", kind])
    assert result.exit_code == 0, result.output
    assert result.stdout == _emitted(kind)
    assert PARSERS[kind](result.stdout)
    assert "Recommendation (speed): " in result.stderr
    assert result.stderr.endswith(f"\n\nLaunch configuration ({kind}): on stdout\n")


def test_a_deepspeed_config_on_stdout_through_a_real_pipe_is_json():
    """The same through the process's own streams (``memplan … --emit deepspeed > ds_config.json``)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "memplan.cli", *RECOMMEND, "--emit", "deepspeed"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == json.loads(_emitted("deepspeed"))
    assert "Recommendation (speed): " in run.stderr


@pytest.mark.parametrize("kind", ["deepspeed", "accelerate"])
def test_output_writes_the_file_and_the_report_goes_to_stdout(tmp_path, kind):
    path = tmp_path / "launch.out"
    path.write_text("an older file, replaced")
    result = CliRunner().invoke(main, [*RECOMMEND, "--emit", kind, "-o", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_text() == _emitted(kind) and PARSERS[kind](path.read_text())
    assert result.stderr == "" and "Recommendation (speed): " in result.stdout
    assert result.stdout.endswith(f"\n\nLaunch configuration ({kind}): written to {path}\n")


def test_format_json_keeps_one_document_on_stdout_with_the_file_as_its_launch_field(tmp_path):
    """``--format json`` asks for memplan's document: the file is its ``launch`` field (a string,
    as for every kind), and ``--output`` writes it as well."""
    path = tmp_path / "ds_config.json"
    result = CliRunner().invoke(main, [*RECOMMEND, "--emit", "deepspeed", "--format", "json", "--output", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["launch"] == path.read_text() == _emitted("deepspeed") and result.stderr == ""


def test_the_layout_search_emits_a_file_too(tmp_path):
    result = CliRunner().invoke(main, [*RECOMMEND, "--search-layout", "--emit", "torchtitan"])
    assert result.exit_code == 0, result.output
    toml = PARSERS["torchtitan"](result.stdout)
    assert toml["parallelism"]["data_parallel_shard_degree"] * toml["parallelism"]["tensor_parallel_degree"] <= 8
    assert "Recommended layout: " in result.stderr


@pytest.mark.parametrize(
    ("where", "args", "message"),
    [
        (
            "a directory",
            ["--emit", "deepspeed", "-o", "{tmp}"],
            "--output '{tmp}' is a directory; name the file to write",
        ),
        (
            "a missing directory",
            ["--emit", "deepspeed", "-o", "{tmp}/nowhere/ds.json"],
            "--output '{tmp}/nowhere/ds.json': directory '{tmp}/nowhere' does not exist",
        ),
        ("no --emit", ["-o", "{tmp}/ds.json"], "--output writes the launch configuration: it needs --emit KIND"),
    ],
)
def test_output_refuses_in_one_line(tmp_path, where, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    result = CliRunner().invoke(main, [*RECOMMEND, *args])
    assert result.exit_code == 2, where
    assert result.stderr == f"Error: {message.format(tmp=tmp_path)}\n" and result.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", sorted(WRITES))
@pytest.mark.parametrize("model", [("params", "7e9", "a100-40gb"), ("model", "gpt2", "a100-80gb")])
def test_recommend_emit_searches_only_what_it_writes(kind, model):
    """Bug 5: `--emit deepspeed` when the best option overall is FSDP failed ("does not apply to
    strategy fsdp-full-shard"), and `--emit fsdp2` when it is fsdp-no-shard (which fsdp2 does not
    write). Asking for a launch form chooses its framework: the search keeps to what it writes."""
    import memplan

    source, name, gpu = model
    args = [f"--{source}", name, "--gpus", "8", "--gpu", gpu]
    result = CliRunner().invoke(main, ["recommend", *args, "--emit", kind, "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["strategy"] in WRITES[kind] and sorted(data["searched_strategies"]) == sorted(WRITES[kind])
    restricted = next(r for r in data["reason_details"] if r["code"] == "restricted")
    assert restricted["strategies"] == data["searched_strategies"] and restricted["restricted_by"] == f"--emit {kind}"
    _, rec = memplan.api.recommend(**{source: name}, gpus=8, gpu=gpu, strategies=WRITES[kind])
    assert data["launch"] == emit(rec.best.job, kind)
    text = CliRunner().invoke(main, ["recommend", *args, "--emit", kind]).output
    # all of a framework's strategies by its name (fsdp2 does not write fsdp-no-shard: by theirs)
    own = {"deepspeed": "deepspeed strategies", "fsdp1": "fsdp strategies"}
    name = own.get(kind, ", ".join(data["searched_strategies"]))
    assert f"  - searched only {name} (--emit {kind})\n" in text


def test_recommend_framework_flag():
    args = ["recommend", "--params", "7e9", "--gpus", "8", "--gpu", "a100-40gb"]
    ok = CliRunner().invoke(main, [*args, "--framework", "deepspeed", "--format", "json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["strategy"] in ("zero1", "zero2", "zero3")
    clash = CliRunner().invoke(main, [*args, "--framework", "fsdp", "--emit", "deepspeed"])
    assert clash.exit_code == 2 and "framework fsdp runs none of: zero1, zero2, zero3" in clash.output
    fixed = CliRunner().invoke(main, [*args, "--strategy", "ddp", "--emit", "deepspeed"])
    assert fixed.exit_code == 2 and "strategy ddp is not among the strategies searched" in fixed.output
    plain = CliRunner().invoke(main, [*args, "--emit", "accelerate", "--format", "json"])
    assert json.loads(plain.output)["searched_strategies"] is None  # accelerate launches every framework


def test_one_gpu_without_a_wrapper_launches_plainly_and_has_nothing_to_wrap():
    j = job("single", params="1e9", gpus=1)
    assert "\npython train.py --micro-batch 1" in emit(j, "torchrun")
    assert yaml.safe_load(emit(j, "accelerate"))["distributed_type"] == "NO"
    for kind in ("fsdp2", "fsdp1", "deepspeed"):
        with pytest.raises(MemplanError, match=rf"^emit {kind} does not apply to strategy single"):
            emit(j, kind)
    out = CliRunner().invoke(
        main, ["recommend", "--params", "1e9", "--gpus", "1", "--gpu", "a100-80gb", "--emit", "torchrun"]
    )
    assert out.exit_code == 0 and "Recommendation (speed): single" in out.output and "python train.py" in out.output
    bad = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--gpus", "8", "--strategy", "single"])
    assert bad.exit_code != 0 and "runs on at most 1 GPU, got gpus=8" in bad.output
    assert "Traceback" not in bad.output


def test_accelerate_keeps_autocast_under_fsdp_out_of_its_mixed_precision_policy():
    amp = emit(job("fsdp-full-shard", precision="amp-bf16"), "accelerate")
    assert yaml.safe_load(amp)["mixed_precision"] == "no" and "torch.autocast('cuda', dtype=torch.bfloat16)" in amp
    mixed = emit(job("fsdp-full-shard", precision="mixed-bf16"), "accelerate")
    assert yaml.safe_load(mixed)["mixed_precision"] == "bf16" and "autocast" not in mixed
    assert yaml.safe_load(emit(job("ddp", precision="amp-bf16"), "accelerate"))["mixed_precision"] == "bf16"


@pytest.mark.parametrize("precision,dtype", [("amp-bf16", "torch.bfloat16"), ("amp-fp16", "torch.float16")])
def test_fsdp_snippets_for_autocast_keep_fp32_parameters_and_autocast_the_forward(precision, dtype):
    """Bug 3: amp-* was estimated as fp32 parameters + autocast, but the snippet set a
    param_dtype mixed policy (mixed-*): no param_dtype now, and a forward under autocast."""
    j = job("fsdp-full-shard", precision=precision)
    for kind in ("fsdp2", "fsdp1"):
        text = emit(j, kind)
        compile(text, f"<{kind}>", "exec")
        assert "param_dtype" not in text and "MixedPrecision" not in text
        assert f'with torch.autocast("cuda", dtype={dtype}):' in text
    # an explicit reduce dtype is still a mixed policy, on the reduction alone
    reduced = emit(job("fsdp-full-shard", precision=precision, reduce_dtype="bf16"), "fsdp2")
    assert "MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)" in reduced and "param_dtype" not in reduced
    mixed = emit(job("fsdp-full-shard", precision=precision.replace("amp", "mixed")), "fsdp2")
    assert f"MixedPrecisionPolicy(param_dtype={dtype}" in mixed and "autocast" not in mixed


def test_fsdp2_autocast_snippet_runs_when_torch_is_here():
    pytest.importorskip("torch")
    namespace = {}
    exec(compile(emit(job("fsdp-full-shard", precision="amp-bf16"), "fsdp2"), "<fsdp2>", "exec"), namespace)
    assert callable(namespace["wrap"]) and callable(namespace["forward"])
