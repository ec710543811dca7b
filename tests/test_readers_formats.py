"""memplan.readers beyond DeepSpeed (issue 27): torchtune's recipe YAML and Hugging Face's
TrainingArguments JSON, read against the frameworks' own files and sources.

torchtune: every config its 0.6.1 wheel ships for the four fine-tuning recipes (its recipe registry,
read from the installed file) is read, or refused naming a field; the fields its recipes read
(``cfg.X`` / ``cfg.get("X")`` in their source) are all classified; each model builder the table maps
is built on the meta device and has its preset's shapes and parameter count."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from memplan.catalog import model_preset
from memplan.errors import InputError
from memplan.readers import field_table, read
from memplan.readers import torchtune as tt

TORCHTUNE = importlib.util.find_spec("torchtune")
SITE = Path(TORCHTUNE.origin).parent.parent if TORCHTUNE else None
CONFIGS = SITE / "recipes" / "configs" if SITE else None
needs_torchtune = pytest.mark.skipif(TORCHTUNE is None, reason="torchtune is not installed")
FINETUNE_RECIPES = (
    "full_finetune_single_device",
    "full_finetune_distributed",
    "lora_finetune_single_device",
    "lora_finetune_distributed",
)


def _registry():
    """torchtune/_recipe_registry.py, loaded alone (importing torchtune needs torch)."""
    spec = importlib.util.spec_from_file_location("_tt_registry", SITE / "torchtune" / "_recipe_registry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(r.name, c.file_path) for r in module.get_all_recipes() if r.name in FINETUNE_RECIPES for c in r.configs]


def _shipped():
    return _registry() if TORCHTUNE else []


@needs_torchtune
@pytest.mark.parametrize(("recipe", "config"), _shipped(), ids=lambda x: x)
def test_every_shipped_torchtune_config_is_read_or_refused_naming_a_field(recipe, config):
    """Read: the strategy it infers is the registry's recipe's (or left to --strategy). Refused:
    the field is one the table says memplan does not model, or a builder/optimizer it lacks."""
    import yaml

    data = yaml.safe_load((CONFIGS / config).read_text())
    try:
        got = read(CONFIGS / config)
    except InputError as err:
        table = field_table("torchtune")
        assert err.field in table and str(CONFIGS / config) in str(err)
        row = table[err.field]
        assert row["status"] in ("default-only", "at-least") or err.field.endswith("_component_"), err
        return
    want = "single" if recipe.endswith("single_device") else "fsdp-full-shard"
    assert got.inputs.get("strategy", want) == want
    assert ("strategy" in got.deferred) == ("strategy" not in got.inputs)
    assert got.inputs["micro_batch"] == data["batch_size"]
    assert got.inputs["grad_accum"] == data["gradient_accumulation_steps"]
    assert got.inputs["ac"] == ("full" if data.get("enable_activation_checkpointing") else "none")
    assert got.inputs["finetune"] if recipe.startswith("lora") else "finetune" not in got.inputs


@needs_torchtune
def test_most_shipped_torchtune_configs_are_read():
    read_ok = 0
    for _, config in _registry():
        try:
            read(CONFIGS / config)
            read_ok += 1
        except InputError:
            pass
    assert read_ok >= 40


@needs_torchtune
def test_every_field_the_torchtune_recipes_read_is_classified():
    """``cfg.X`` and ``cfg.get("X", ...)`` in the installed recipes' source."""
    names = set()
    for recipe in FINETUNE_RECIPES:
        text = (SITE / "recipes" / f"{recipe}.py").read_text()
        names |= set(re.findall(r"\bcfg\.get\(\s*\"([a-z_]+)\"", text))
        names |= {n for n in re.findall(r"\bcfg\.([a-z_]+)\b", text) if n != "get"}
    table = field_table("torchtune")
    top = {f.split(".")[0] for f in table}
    assert sorted(names - top) == []


@needs_torchtune
def test_each_mapped_builder_has_its_preset_s_shapes():
    """The builder built on the meta device: layers, hidden, heads, kv heads, ffn, vocab, parameters."""
    import importlib

    import torch

    from calibrate.loops import import_torchtune

    import_torchtune()
    families = ("llama3_1", "llama3_2", "llama3_3", "llama3", "llama2", "mistral", "qwen2_5", "phi3", "phi4")
    for component, preset in tt.presets().items():
        family = next(f for f in families if component.startswith(f + "_"))
        with torch.device("meta"):
            model = getattr(importlib.import_module(f"torchtune.models.{family}"), component)()
        spec, block = model_preset(preset), model.layers[0]
        shapes = (
            len(model.layers),
            model.tok_embeddings.embedding_dim,
            block.attn.num_heads,
            block.attn.num_kv_heads,
            block.mlp.w1.out_features,
            model.tok_embeddings.num_embeddings,
            sum(p.numel() for p in model.parameters()),
        )
        want = (
            spec.num_layers,
            spec.hidden,
            spec.num_heads,
            spec.num_kv_heads or spec.num_heads,
            spec.ffn_hidden,
            spec.vocab_size,
            spec.num_params,
        )
        assert shapes == want, component


def _yaml(tmp_path, data: dict, name="my_config.yaml") -> Path:
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


LORA = {
    "model": {
        "_component_": "torchtune.models.llama3_2.lora_llama3_2_1b",
        "lora_attn_modules": ["q_proj", "k_proj", "v_proj"],
        "apply_lora_to_mlp": False,
        "lora_rank": 16,
        "lora_alpha": 32,
    },
    "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer", "max_seq_len": 1024},
    "batch_size": 3,
    "gradient_accumulation_steps": 2,
    "dtype": "bf16",
    "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4, "foreach": False},
    "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", "num_output_chunks": 4},
    "enable_activation_checkpointing": True,
    "enable_activation_offloading": True,
    "compile": True,
    "fsdp_cpu_offload": True,
}


def test_a_torchtune_lora_config_sets_each_input_it_names(tmp_path):
    got = read(_yaml(tmp_path, LORA))
    assert got.format == "torchtune" and got.deferred == ()
    assert got.inputs == {
        "recipe": "torchtune",
        "model": "llama-3.2-1b",
        "finetune": "lora",
        "lora_targets": "q,k,v",
        "lora_rank": 16,
        "lora_alpha": 32,
        "strategy": "fsdp-full-shard",  # fsdp_cpu_offload: the distributed recipe's key
        "seq_len": 1024,
        "micro_batch": 3,
        "grad_accum": 2,
        "precision": "bf16",
        "optimizer": "adamw",
        "optimizer_impl": "single",
        "loss": "chunked-ce",
        "loss_chunks": 4,
        "compile": True,
        "offload_activations": True,
        "optimizer_in_backward": False,
        "ac": "full",
        "offload": "all",
    }


def test_the_file_s_job_is_the_estimate_of_the_same_flags(tmp_path):
    from memplan import api

    path = _yaml(tmp_path, LORA | {"fsdp_cpu_offload": False, "enable_activation_offloading": False})
    inputs = read(path).inputs
    via_file = api.estimate(gpus=4, calibration=None, **inputs)
    flags = dict(inputs, optimizer_impl="single")
    assert (
        via_file.estimates[0].allocated_bytes
        == api.estimate(gpus=4, calibration=None, **flags).estimates[0].allocated_bytes
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": {"_component_": "torchtune.models.gemma.gemma_2b"}}, "model._component_"),
        ({"model": LORA["model"] | {"use_dora": True}}, "model.use_dora"),
        ({"model": LORA["model"] | {"apply_lora_to_output": True}}, "model.apply_lora_to_output"),
        ({"model": LORA["model"] | {"lora_attn_modules": ["qkv"]}}, "model.lora_attn_modules"),
        ({"custom_sharded_layers": ["tok_embeddings", "output"]}, "custom_sharded_layers"),
        ({"fsdp_reshard_after_forward": False}, "fsdp_reshard_after_forward"),
        ({"tensor_parallel_dim": 2}, "tensor_parallel_dim"),
        ({"dtype": "fp16"}, "dtype"),
        ({"optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW"}}, "optimizer._component_"),
        ({"loss": {"_component_": "torchtune.modules.loss.ForwardKLLoss"}}, "loss._component_"),
        ({"ac_mode": "selective"}, "ac_mode"),
        ({"no_such_key": 1}, "no_such_key"),
    ],
)
def test_a_torchtune_field_memplan_does_not_model_is_refused_naming_it(tmp_path, change, field):
    path = _yaml(tmp_path, LORA | change)
    with pytest.raises(InputError) as err:
        read(path)
    assert err.value.field == field and str(path) in str(err.value)


def test_the_strategy_comes_from_the_config_s_name_or_is_left_to_the_flags(tmp_path):
    plain = {k: v for k, v in LORA.items() if k != "fsdp_cpu_offload"}
    assert read(_yaml(tmp_path, plain, "8B_lora_single_device.yaml")).inputs["strategy"] == "single"
    other = read(_yaml(tmp_path, plain, "mine.yaml"))
    assert "strategy" not in other.inputs and "strategy" in other.deferred


def test_torchtune_format_is_detected_or_named(tmp_path):
    path = _yaml(tmp_path, LORA)
    assert read(f"torchtune:{path}").inputs == read(path).inputs


# --- the command line ----------------------------------------------------------------


def _cli(*args):
    from click.testing import CliRunner

    from memplan.cli import main

    return CliRunner().invoke(main, list(args))


@needs_torchtune
def test_explain_config_of_a_shipped_torchtune_config():
    result = _cli("estimate", "--from", str(CONFIGS / "llama3_1" / "8B_lora_single_device.yaml"), "--explain-config")
    assert result.exit_code == 0, result.output
    assert "model._component_" in result.stdout and "→ model" in result.stdout
    assert "ignored (no memory effect)" in result.stdout and "profiler" in result.stdout


@needs_torchtune
def test_a_shipped_single_device_config_estimates_with_the_sequence_length_alone():
    result = _cli(
        "estimate",
        "--format",
        "json",
        "--calibration",
        "none",
        "--seq-len",
        "2048",
        "--from",
        str(CONFIGS / "llama3_2" / "1B_full_single_device.yaml"),
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["estimates"]
    assert row["strategy"] == "single"
    assert "seq-len" in result.stderr


def test_a_refused_torchtune_field_is_one_line_and_exit_2(tmp_path):
    path = _yaml(tmp_path, LORA | {"fsdp_reshard_after_forward": False})
    result = _cli("estimate", "--from", str(path))
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "fsdp_reshard_after_forward" in result.output and "Traceback" not in result.output


# --- Hugging Face TrainingArguments JSON ---------------------------------------------

TRANSFORMERS = importlib.util.find_spec("transformers")
needs_transformers = pytest.mark.skipif(TRANSFORMERS is None, reason="transformers is not installed")
HF = Path(__file__).resolve().parent / "data" / "hf_trainer"


def _args(tmp_path, **kwargs) -> Path:
    """A TrainingArguments JSON as transformers writes it (to_json_string), on the CPU (this machine's
    transformers refuses bf16 without a GPU unless use_cpu)."""
    from transformers import TrainingArguments

    path = tmp_path / "args.json"
    kwargs = {"use_cpu": True} | kwargs
    path.write_text(TrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs).to_json_string())
    return path


@needs_transformers
def test_every_training_arguments_field_is_classified():
    """The installed transformers' own dataclass: each field has a row in tables/config_fields.csv."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert sorted(names - set(field_table("hf-trainer"))) == []


@needs_transformers
def test_default_training_arguments_are_the_trainer_s_defaults(tmp_path):
    got = read(_args(tmp_path))
    assert got.format == "hf-trainer" and got.deferred == ("strategy",)
    assert got.inputs == {
        "recipe": "hf-trainer",
        "micro_batch": 8,
        "grad_accum": 1,
        "precision": "fp32",
        "ac": "none",
        "compile": False,
        "optimizer": "adamw",
        "optimizer_impl": "fused",  # optim adamw_torch_fused, transformers 5's default
        "device": "cpu",
    }


@needs_transformers
@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        (dict(bf16=True), {"precision": "amp-bf16"}),
        (dict(fp16=True), {"precision": "amp-fp16", "device": "cpu"}),
        (dict(gradient_checkpointing=True), {"ac": "full"}),
        (dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False}), {"ac": "full"}),
        (dict(optim="adafactor"), {"optimizer": "adafactor"}),
        (dict(optim="paged_adamw_8bit"), {"optimizer": "paged-adamw8bit"}),
        (dict(torch_compile=True), {"compile": True}),
        (dict(per_device_train_batch_size=3, gradient_accumulation_steps=5), {"micro_batch": 3, "grad_accum": 5}),
        (dict(ddp_bucket_cap_mb=100, ddp_static_graph=True), {"bucket_cap_mb": 100, "static_graph": True}),
    ],
)
def test_each_memory_field_of_the_arguments_sets_its_input(tmp_path, kwargs, want):
    got = read(_args(tmp_path, **kwargs)).inputs
    assert {k: got[k] for k in want} == want


@needs_transformers
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (
            dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
            "activation_checkpointing_kwargs.use_reentrant",
        ),
        (dict(fsdp="full_shard auto_wrap"), "fsdp"),
        (dict(ddp_bucket_cap_mb=-1), "ddp_bucket_cap_mb"),
        (dict(use_liger_kernel=True), "use_liger_kernel"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
        (dict(optim="galore_adamw", optim_target_modules=["attn"]), "optim_target_modules"),
        (dict(optim="rmsprop"), "optim"),
        (dict(use_cache=True), "use_cache"),
    ],
)
def test_an_arguments_field_memplan_does_not_model_is_refused_naming_it(tmp_path, kwargs, field):
    path = _args(tmp_path, **kwargs)
    with pytest.raises(InputError) as err:
        read(path)
    assert err.value.field == field and str(path) in str(err.value)


@needs_transformers
def test_the_deepspeed_file_the_arguments_name_is_read_with_their_auto_values(tmp_path):
    """hf_zero3.json's "auto" batch and precision are the arguments' (HfTrainerDeepSpeedConfig)."""
    ds = Path(__file__).resolve().parent / "data" / "deepspeed" / "hf_zero3.json"
    got = read(_args(tmp_path, deepspeed=str(ds), bf16=True, per_device_train_batch_size=2)).inputs
    want = read(ds).inputs
    assert {k: got[k] for k in want} == want
    assert (got["strategy"], got["micro_batch"], got["precision"]) == ("zero3", 2, "mixed-bf16")


def test_arguments_format_is_detected_or_named():
    path = HF / "fp32_adamw.json"
    assert read(f"hf-trainer:{path}").inputs == read(path).inputs


RECORDS = Path(__file__).resolve().parent.parent / "validation" / "records" / "hf_trainer_args_matrix_cpu.jsonl"


@pytest.mark.parametrize(
    "record", [json.loads(line) for line in RECORDS.read_text().splitlines()], ids=lambda r: r["case"]
)
def test_the_recorded_trainer_runs_are_estimated_from_their_files(record):
    """validation/hf_trainer_args.py's record: Trainer.train() from each file on CPU, against
    ``--from FILE``. Within 1 %, but the bf16 + checkpointing + accumulation case, 5.0 % under
    (recorded before any model change; left open: its activations are 4.06 MiB over the estimate's,
    about one fp32 logits tensor, while bf16 without checkpointing is +0.4 %)."""
    from validation.hf_trainer_args import estimate

    error = (estimate(record) - record["measured_peak_bytes"]) / record["measured_peak_bytes"]
    tolerance = 0.055 if record["case"] == "bf16_ac_fused_accum2" else 0.01
    assert abs(error) <= tolerance, f"{record['case']}: {100 * error:+.2f} %"


@pytest.mark.slow
@needs_transformers
def test_a_trainer_run_from_its_arguments_file_is_estimated_live():
    """The fp32 file run by Trainer.train() now (not the record) against --from FILE."""
    from validation.hf_trainer_args import estimate, measure

    record = measure("fp32_adamw")
    error = (estimate(record) - record["measured_peak_bytes"]) / record["measured_peak_bytes"]
    assert abs(error) <= 0.01, f"{100 * error:+.2f} %"


# --- accelerate config YAML ----------------------------------------------------------

ACCELERATE = importlib.util.find_spec("accelerate")
needs_accelerate = pytest.mark.skipif(ACCELERATE is None, reason="accelerate is not installed")


@needs_accelerate
def test_every_accelerate_config_field_is_classified():
    """ClusterConfig's fields, and every fsdp_config / deepspeed_config / dynamo_config key that
    ``accelerate config`` writes (commands/config/cluster.py), have rows."""
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig

    table = field_table("accelerate")
    names = {f.name for f in dataclasses.fields(ClusterConfig)}
    source = (Path(ACCELERATE.origin).parent / "commands" / "config" / "cluster.py").read_text()
    for section in ("fsdp_config", "deepspeed_config"):
        names |= {f"{section}.{k}" for k in re.findall(section + r'\["([a-z_0-9]+)"\]', source)}
    names |= {f"dynamo_config.dynamo_{k}" for k in re.findall(r'dynamo_config\[prefix \+ "([a-z_]+)"\]', source)}
    assert sorted(names - set(table)) == []


def _accelerate_file(tmp_path, data: dict) -> Path:
    import yaml

    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": 1, "use_cpu": False}


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (dict(distributed_type="MULTI_GPU", mixed_precision="bf16", num_processes=4), ("ddp", "amp-bf16", 4)),
        (dict(distributed_type="NO", mixed_precision="no", num_processes=1), ("single", "fp32", 1)),
        (
            dict(
                distributed_type="FSDP",
                mixed_precision="bf16",
                num_processes=8,
                fsdp_config={"fsdp_version": 2, "fsdp_reshard_after_forward": False},
            ),
            ("fsdp-shard-grad-op", "mixed-bf16", 8),
        ),
        (
            dict(
                distributed_type="FSDP",
                mixed_precision="fp16",
                num_processes=8,
                fsdp_config={"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD"},
            ),
            ("fsdp-hybrid-shard", "mixed-fp16", 8),
        ),
        (
            dict(
                distributed_type="DEEPSPEED",
                mixed_precision="bf16",
                num_processes=8,
                deepspeed_config={"zero_stage": 3, "offload_optimizer_device": "cpu"},
            ),
            ("zero3", "mixed-bf16", 8),
        ),
    ],
)
def test_an_accelerate_config_sets_strategy_precision_and_world(tmp_path, config, want):
    got = read(_accelerate_file(tmp_path, BASE | config)).inputs
    assert (got["strategy"], got["precision"], got["gpus"]) == want
    assert got["recipe"] == "accelerate"


def test_accelerate_deepspeed_plugin_is_deepspeed_s_defaults(tmp_path):
    """No deepspeed_config_file: the plugin's config has the stage and offload alone, so DeepSpeed's
    default buckets (overlap_comm on for stage 3 only)."""
    config = BASE | dict(distributed_type="DEEPSPEED", num_processes=8, deepspeed_config={"zero_stage": 2})
    got = read(_accelerate_file(tmp_path, config)).inputs
    assert got["zero"] == read(DATA_DS / "zero2_stage_only.json").inputs["zero"]
    assert got["offload"] == "none"


def test_accelerate_names_a_deepspeed_file_read_by_the_deepspeed_reader(tmp_path):
    ds = DATA_DS / "zero3_user_buckets.json"
    config = BASE | dict(
        distributed_type="DEEPSPEED", num_processes=8, deepspeed_config={"deepspeed_config_file": str(ds)}
    )
    got = read(_accelerate_file(tmp_path, config)).inputs
    want = read(ds).inputs
    assert {k: got[k] for k in want} == want


DATA_DS = Path(__file__).resolve().parent / "data" / "deepspeed"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (dict(distributed_type="MEGATRON_LM"), "distributed_type"),
        (dict(distributed_type="MULTI_GPU", mixed_precision="fp8"), "mixed_precision"),
        (
            dict(distributed_type="FSDP", fsdp_config={"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}),
            "fsdp_config.fsdp_auto_wrap_policy",
        ),
        (
            dict(distributed_type="FSDP", fsdp_config={"fsdp_forward_prefetch": True}),
            "fsdp_config.fsdp_forward_prefetch",
        ),
        (
            dict(distributed_type="FSDP", fsdp_config={"fsdp_backward_prefetch": "NO_PREFETCH"}),
            "fsdp_config.fsdp_backward_prefetch",
        ),
        (
            dict(distributed_type="FSDP", fsdp_config={"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"}),
            "fsdp_config.fsdp_sharding_strategy",
        ),
        (dict(distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 0}), "deepspeed_config.zero_stage"),
        (
            dict(distributed_type="DEEPSPEED", deepspeed_config={"zero_stage": 3, "offload_param_device": "nvme"}),
            "deepspeed_config.offload_param_device",
        ),
        (
            dict(distributed_type="NO", dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_mode": "reduce-overhead"}),
            "dynamo_config.dynamo_mode",
        ),
        (dict(distributed_type="NO", parallelism_config={"parallelism_config_tp_size": 2}), "parallelism_config"),
    ],
)
def test_an_accelerate_field_memplan_does_not_model_is_refused_naming_it(tmp_path, config, field):
    path = _accelerate_file(tmp_path, BASE | config)
    with pytest.raises(InputError) as err:
        read(path)
    assert err.value.field == field and str(path) in str(err.value)


ROUND_TRIP = [
    (s, p)
    for s in ("single", "ddp", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-no-shard", "zero1", "zero2", "zero3")
    for p in ("fp32", "mixed-bf16", "mixed-fp16", "amp-bf16", "amp-fp16")
    # the emitted file says what accelerate runs only for: fp32; FSDP / DeepSpeed with mixed-* (FSDP's
    # MixedPrecisionPolicy, DeepSpeed's bf16 / fp16 modes); single / DDP with amp-* (accelerate's autocast)
    if p == "fp32" or (p.startswith("mixed") == (s.startswith(("fsdp", "zero"))))
]


@pytest.mark.parametrize(("strategy", "precision"), ROUND_TRIP)
def test_an_emitted_accelerate_config_reads_back_to_the_same_estimate(tmp_path, strategy, precision):
    """``--emit accelerate`` then ``--from`` on its output: the same job and estimate (the DeepSpeed
    plugin's buckets are DeepSpeed's defaults, which the emitted file does not set: compared without)."""
    import dataclasses

    from memplan.emit import emit
    from memplan.inputs import build_jobs
    from memplan.memory import estimate
    from memplan.request import Request

    gpus = 1 if strategy == "single" else 8
    ac = "none" if strategy in ("single", "ddp") or strategy.startswith("zero") else "full"
    request = Request.of(
        model="llama-2-7b", gpus=gpus, strategy=strategy, precision=precision, ac=ac, recipe="accelerate"
    )
    (job,) = build_jobs(request)[1]
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(job, "accelerate"))
    inputs = read(path).inputs
    (back,) = build_jobs(Request.of(model="llama-2-7b", **({"ac": ac} | inputs)))[1]
    if strategy.startswith("zero"):
        back = dataclasses.replace(back, plan=dataclasses.replace(back.plan, zero=job.plan.zero))
    assert back.plan == job.plan and back.train == job.train and back.cluster == job.cluster
    assert estimate(back).allocated_bytes == estimate(job).allocated_bytes


@pytest.mark.parametrize("strategy", ["fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid-shard"])
def test_one_fsdp_unit_round_trips_through_accelerate_s_no_wrap(tmp_path, strategy):
    """``--fsdp-wrap none`` is written as FSDP1's NO_WRAP and read back as it, to the byte."""
    from memplan.emit import emit
    from memplan.inputs import build_jobs
    from memplan.memory import estimate
    from memplan.request import Request

    job_inputs = dict(gpus=16, strategy=strategy, precision="mixed-bf16", ac="none", recipe="accelerate")
    (job,) = build_jobs(Request.of(model="llama-2-7b", fsdp_wrap="none", **job_inputs))[1]
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(job, "accelerate"))
    section = yaml.safe_load(path.read_text().split("\n", 2)[2])["fsdp_config"]
    assert (section["fsdp_version"], section["fsdp_auto_wrap_policy"]) == (1, "NO_WRAP")
    inputs = read(path).inputs
    (back,) = build_jobs(Request.of(model="llama-2-7b", **({"ac": "none"} | inputs)))[1]
    assert back.plan == job.plan and back.one_fsdp_unit
    assert estimate(back).allocated_bytes == estimate(job).allocated_bytes


def test_no_wrap_under_fsdp2_is_refused(tmp_path):
    config = BASE | dict(distributed_type="FSDP", fsdp_config={"fsdp_version": 2, "fsdp_auto_wrap_policy": "NO_WRAP"})
    with pytest.raises(InputError) as err:
        read(_accelerate_file(tmp_path, config))
    assert err.value.field == "fsdp_config.fsdp_auto_wrap_policy"


@needs_accelerate
@pytest.mark.parametrize("name", ["default_config.yaml", "default_config.json"])
def test_accelerate_s_own_default_config_is_read(tmp_path, name):
    """``accelerate config default`` (accelerate.utils.write_basic_config) writes JSON, under either name."""
    from accelerate.utils import write_basic_config

    path = tmp_path / name
    write_basic_config(mixed_precision="bf16", save_location=str(path))
    data = json.loads(path.read_text())
    got = read(path)
    assert got.format == "accelerate"
    want_strategy = "single" if data["num_processes"] == 1 else "ddp"
    assert got.inputs["strategy"] == want_strategy and got.inputs["gpus"] == data["num_processes"]
    assert got.inputs["precision"] == "amp-bf16"  # accelerate's autocast over fp32 parameters
