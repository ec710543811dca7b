"""LoRA on fused projections as peft adapts them: one adapter per module peft matches, Phi-3's
qkv_proj and gate_up_proj, GPT-2's c_attn, c_proj (attention output and MLP down projection)
and c_fc Conv1D modules. Held-out records: validation/records/finetune_matrix_cpu.jsonl (the
fine-tune matrix's phi3 and gpt2 cases, measured with peft before memplan modelled them)."""

import json

import pytest
from click.testing import CliRunner
from test_finetune_presets import PHI3 as PHI3_CONFIG  # tests/ is on the path, as test_slurm's import

from memplan.catalog import model_preset
from memplan.cli import main
from memplan.errors import MemplanError
from memplan.finetune import ADAPTED_BLOCKS, targets_of, trained
from memplan.hfconfig import model_from_hf_config
from memplan.specs import tuning


def _lora(targets: str, rank: int = 8, mode: str = "lora"):
    return tuning(mode, rank, 16.0, targets, 0.0)


def test_phi3_presets_and_configs_are_fused():
    assert model_preset("phi-3-mini").fused_projections and model_preset("phi-4").fused_projections
    assert not model_preset("llama-2-7b").fused_projections
    assert model_from_hf_config(PHI3_CONFIG).fused_projections


@pytest.mark.parametrize(
    ("model", "targets", "expected"),
    [
        ("phi-3-mini", "qkv_proj,o_proj", ("qkv", "o")),
        ("phi-3-mini", "attention", ("o", "qkv")),
        ("phi-3-mini", "all-linear", ("o", "qkv", "gate_up", "down")),
        ("phi-3-mini", "gate_up_proj,down_proj", ("gate_up", "down")),
        ("gpt2", "c_attn", ("qkv",)),
        ("gpt2", "c_proj", ("o", "down")),  # peft matches both modules named c_proj
        ("gpt2", "c_attn,c_fc", ("qkv", "up")),
        ("gpt2", "all-linear", ("qkv", "o", "up", "down")),
        ("llama-2-7b", "q_proj,v_proj", ("q", "v")),
    ],
)
def test_targets_are_the_modules_peft_adapts(model, targets, expected):
    assert targets_of(model_preset(model), _lora(targets)) == expected


@pytest.mark.parametrize(("model", "targets"), [("phi-3-mini", "q,v"), ("phi-3-mini", "c_attn"), ("llama-2-7b", "qkv")])
def test_a_target_the_block_has_not_is_refused_naming_the_accepted(model, targets):
    with pytest.raises(MemplanError) as err:
        targets_of(model_preset(model), _lora(targets))
    message = str(err.value)
    assert "\n" not in message and targets.replace(",", ", ") in message


def _adapter_params(shapes: list[tuple[int, int]], rank: int) -> int:
    """lora_A r × in and lora_B out × r per adapted module (peft LoraLayer.update_layer)."""
    return sum(rank * (n_in + n_out) for n_in, n_out in shapes)


def test_phi3_adapters_are_one_per_fused_module():
    spec = model_preset("phi-3-mini")
    h, q, kv, f, L = spec.hidden, spec.q_hidden, spec.kv_hidden, spec.ffn_hidden, spec.num_layers
    fused = [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)]
    assert trained(spec, _lora("all-linear", 16)).trainable == L * _adapter_params(fused, 16)
    assert trained(spec, _lora("qkv_proj,o_proj")).trainable == L * _adapter_params(fused[:2], 8)


def _cli_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["estimate", *args, "--gpus", "1", "--strategy", "single", "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_cli_phi3_fused_targets_count_one_adapter_each():
    train = _cli_json("--model", "phi-3-mini", "--finetune", "lora", "--lora-targets", "qkv_proj,o_proj")["inputs"][
        "train"
    ]
    spec = model_preset("phi-3-mini")
    h, q, kv = spec.hidden, spec.q_hidden, spec.kv_hidden
    assert train["trainable_params"] == spec.num_layers * _adapter_params([(h, q + 2 * kv), (q, h)], 8)
    assert train["frozen_params"] == spec.num_params


def test_cli_gpt2_c_attn_is_one_adapter():
    train = _cli_json("--model", "gpt2", "--finetune", "lora", "--lora-targets", "c_attn")["inputs"]["train"]
    spec = model_preset("gpt2")
    assert train["trainable_params"] == spec.num_layers * _adapter_params([(spec.hidden, 3 * spec.hidden)], 8)


def test_cli_unfused_names_on_phi3_are_one_line():
    args = ["estimate", "--model", "phi-3-mini", "--finetune", "lora", "--lora-targets", "q_proj,v_proj"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "q, v" in lines[0] and "o, qkv, gate_up, down" in lines[0], result.output


def test_qlora_on_gpt2_stays_refused():
    """bitsandbytes quantizes nn.Linear, which GPT-2's Conv1D is not: not measured."""
    with pytest.raises(MemplanError, match="qlora"):
        trained(model_preset("gpt2"), _lora("c_attn", mode="qlora"))


@pytest.mark.parametrize("mode", ["lora", "qlora"])
def test_a_block_without_measured_adapters_is_refused_naming_the_ones_measured(mode):
    with pytest.raises(MemplanError) as refused:
        trained(model_preset("pythia-410m"), _lora("q,v", mode=mode))
    measured = [a for a, modes in ADAPTED_BLOCKS.items() if mode in modes]
    message = str(refused.value)
    assert f"{mode} is modelled for " in message and ", not neox:" in message
    assert all(f"{a}" in message for a in measured) and ("gpt2" in message) == (mode == "lora")


@pytest.mark.parametrize("name", ["phi3-gqa-h1024", "gpt2-small-l2"])
def test_trained_counts_are_what_peft_builds(name):
    pytest.importorskip("peft")
    from calibrate.loops import LoopLM
    from validation import peft_matrix

    for case in (c for c in peft_matrix.FUSED if c.job.model.name == name):
        model = LoopLM(case.job.model, hf_type=case.hf_type, attention="sdpa")
        case.adapt(model)
        expected = trained(case.job.model, case.job.train.tuning)
        params = list(model.parameters())
        assert sum(p.numel() for p in params if p.requires_grad) == expected.trainable, case.id
        assert sum(p.numel() for p in params if not p.requires_grad) == expected.frozen, case.id


def _records() -> dict[str, dict]:
    from calibrate import records
    from validation import heldout, peft_matrix

    return {r["id"]: r for r in heldout.latest(records.read([peft_matrix.OUT]))}


def _fused_cases() -> list:
    pytest.importorskip("torch")
    from validation import peft_matrix

    return list(peft_matrix.FUSED)


TOLERANCE_PCT = 2.0
"""The bar of the fine-tune matrix: within 2 % of the measured peak of live tensors."""


@pytest.mark.parametrize("case", _fused_cases(), ids=lambda c: c.id)
def test_estimate_within_tolerance_of_peft_as_written(case):
    from memplan.memory import estimate
    from validation import heldout, peft_matrix

    record = _records()[peft_matrix.record_id(case)]
    assert record["status"] == "ok", record["error"]
    measured = record["measurement"]["peak_allocated_bytes"]
    estimated = estimate(heldout.loop_job(record)).allocated_bytes
    assert abs(estimated - measured) <= TOLERANCE_PCT / 100 * measured, (estimated, measured)


@pytest.mark.slow
def test_live_phi3_measurement_matches_the_record():
    from validation import heldout, peft_matrix

    case = peft_matrix.BY_ID["phi3-gqa-h1024-lora-qkv_proj,o_proj-r8-single-fp32-adamw-g1-b2s512"]
    recorded = _records()[peft_matrix.record_id(case)]["measurement"]["peak_allocated_bytes"]
    outcome = heldout.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    measured = outcome["measurement"]["peak_allocated_bytes"]
    assert abs(measured - recorded) <= 0.005 * recorded, (measured, recorded)
