"""QLoRA's double quantization (``--qlora-double-quant`` / ``--no-qlora-double-quant``, bitsandbytes'
``bnb_4bit_use_double_quant``): memplan against every case of validation/records/qlora_quant_cpu.jsonl
(bitsandbytes' Linear4bit under peft on CPU, validation.qlora_quant), the bytes it changes, and the
input's checks."""

import pytest
from click.testing import CliRunner

from memplan import api
from memplan.cli import main
from memplan.memory import estimate
from validation import heldout, qlora_quant

TOLERANCE = 0.02


def _records() -> list[dict]:
    return heldout.latest_ok(qlora_quant.OUT)


def _error(record: dict) -> float:
    measured = record["measurement"]["peak_allocated_bytes"]
    return (estimate(heldout.loop_job(record)).allocated_bytes - measured) / measured


def test_every_case_is_recorded():
    assert {r["id"] for r in _records()} == {qlora_quant.record_id(c) for c in qlora_quant.CASES}


@pytest.mark.parametrize("record", _records(), ids=lambda r: r["case"])
def test_estimate_within_2_percent_of_bitsandbytes(record):
    assert abs(_error(record)) <= TOLERANCE, record["case"]
    assert estimate(heldout.loop_job(record)).phase == record["measurement"]["phase"]


def _pairs() -> list[tuple[dict, dict]]:
    """Records of one shape measured with and without double quantization."""
    by_case = {r["case"]: r for r in _records()}
    return [(by_case[c], by_case[c[:-1] + "1"]) for c in by_case if c.endswith("-dq0") and c[:-1] + "1" in by_case]


@pytest.mark.parametrize("pair", _pairs(), ids=lambda p: p[0]["case"])
def test_the_statistics_move_the_peak_as_measured(pair):
    """Without double quantization each NF4 weight carries 4/64 bytes of fp32 absmax instead of
    1/64 + 4/16384: the peak moves by that much, within 2 % of the measured move."""
    without, with_ = pair
    measured = without["measurement"]["peak_allocated_bytes"] - with_["measurement"]["peak_allocated_bytes"]
    modelled = estimate(heldout.loop_job(without)).allocated_bytes - estimate(heldout.loop_job(with_)).allocated_bytes
    assert measured > 0 and abs(modelled - measured) / measured <= TOLERANCE


def test_the_nf4_weights_of_an_8b_model_by_their_statistics():
    """Llama-3.1-8B's block linears, P = 32·(4096·(2·4096 + 2·1024) + 3·4096·14336), at 0.5 + 4/64
    bytes each without double quantization and 0.5 + 1/64 + 4/16384 with it."""
    linears = 32 * (4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336)

    def nf4(*flags: bool) -> int:
        (est,) = api.estimate(
            model="llama-3.1-8b",
            gpus=1,
            strategy="single",
            finetune="qlora",
            lora_targets="all-linear",
            qlora_double_quant=flags[0],
        ).estimates
        return next(t.bytes for m in est.moments for t in m.terms if t.key == "params.nf4")

    assert nf4(False) == pytest.approx(linears * 9 / 16, abs=1)
    assert nf4(True) == pytest.approx(linears * (8192 + 256 + 4) / 16384, abs=1)


def test_double_quantization_applies_to_qlora_alone():
    args = ["estimate", "--model", "llama-3.1-8b", "--gpus", "1", "--finetune", "lora", "--no-qlora-double-quant"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert result.stderr == (
        "Error: --qlora-double-quant applies to --finetune qlora only (4-bit base weights), got --finetune lora\n"
    )


LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "hidden_act": "silu",
}


def _bnb_config(**given) -> dict:
    """``quantization_config`` as transformers writes it into config.json (``save_pretrained``)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, **given).to_dict()


def _estimate_json(tmp_path, quantization: dict | None, *flags: str):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps(LLAMA_CONFIG | ({"quantization_config": quantization} if quantization else {}))
    )
    args = ["estimate", "--config", str(tmp_path), "--gpus", "1", "--gpu-mem", "24", "--strategy", "single"]
    return CliRunner().invoke(main, [*args, *flags, "--format", "json"])


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_4bit_checkpoints_config_sets_double_quantization(tmp_path, double_quant):
    """transformers' own BitsAndBytesConfig, as a 4-bit checkpoint's config.json holds it: the same
    bytes as the flag states, and the line saying where it came from."""
    import json

    from_file = _estimate_json(tmp_path, _bnb_config(bnb_4bit_use_double_quant=double_quant), "--finetune", "qlora")
    assert from_file.exit_code == 0, from_file.output
    flag = "--qlora-double-quant" if double_quant else "--no-qlora-double-quant"
    stated = _estimate_json(tmp_path, None, "--finetune", "qlora", flag)
    read, given = (json.loads(r.stdout) for r in (from_file, stated))
    assert read["estimates"][0]["bytes"] == given["estimates"][0]["bytes"]
    state = "on" if double_quant else "off"
    assert (
        f"qlora-double-quant {state} (config.json quantization_config.bnb_4bit_use_double_quant)"
        in (read["inputs"]["assumptions"])
    )


@pytest.mark.parametrize(
    ("quantization", "flags", "message"),
    [
        (
            "bnb",
            [],
            "{cfg} quantization_config loads the weights in 4 bits (bitsandbytes): they train adapters only, "
            "give --finetune qlora (got full)",
        ),
        (
            {"quant_method": "gptq", "bits": 4},
            ["--finetune", "qlora"],
            "{cfg} quantization_config.quant_method 'gptq' is not modelled; memplan models bitsandbytes 4-bit (qlora)",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_8bit": True},
            ["--finetune", "qlora"],
            "{cfg} quantization_config.load_in_8bit true (LLM.int8) is not modelled; "
            "memplan models load_in_4bit (qlora)",
        ),
        (
            "bnb-storage",
            ["--finetune", "qlora"],
            "{cfg} quantization_config.bnb_4bit_quant_storage 'bfloat16' is not modelled; accepted: uint8, unset",
        ),
    ],
)
def test_what_a_quantization_config_holds_beyond_the_model_is_refused_in_one_line(
    tmp_path, quantization, flags, message
):
    import torch

    if quantization == "bnb":
        quantization = _bnb_config()
    elif quantization == "bnb-storage":
        quantization = _bnb_config(bnb_4bit_quant_storage=torch.bfloat16)
    given = quantization
    result = _estimate_json(tmp_path, given, *flags)
    assert result.exit_code == 2
    assert result.stderr == "Error: " + message.format(cfg=tmp_path / "config.json") + "\n"
