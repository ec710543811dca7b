"""peft's DoRA (``LoraConfig(use_dora=True)``, ``--dora``): the magnitude vector it trains, what it
keeps and the weight-sized temporaries of its forward. Held-out records:
validation/records/peft_matrix_cpu.jsonl (validation.peft_matrix DORA_CASES, measured by the
storage meter before memplan modelled DoRA; the table: validation/records/peft_dora_cpu.md)."""

import json

import pytest
from click.testing import CliRunner

from memplan.catalog import model_preset
from memplan.cli import main
from memplan.errors import MemplanError
from memplan.finetune import _linears, targets_of, trained
from memplan.memory import estimate
from memplan.specs import ClusterSpec, Job, Plan, TrainSpec, tuning


def _lora(targets: str = "attention", *, dora: bool, rank: int = 8):
    return tuning("lora", rank, 16.0, targets, 0.0, dora)


@pytest.mark.parametrize(("model", "targets"), [("llama-3.1-8b", "attention"), ("phi-3-mini", "all-linear")])
def test_dora_trains_one_magnitude_per_output_feature_of_each_adapted_linear(model, targets):
    spec = model_preset(model)
    lora, dora = trained(spec, _lora(targets, dora=False)), trained(spec, _lora(targets, dora=True))
    linears = _linears(spec)
    outputs = sum(linears[n][1] for n in targets_of(spec, _lora(targets, dora=True)))
    assert dora.trainable - lora.trainable == spec.num_layers * outputs
    assert dora.frozen == lora.frozen
    magnitudes = [t for t in dora.tensors if len(t) == 1]
    assert len(magnitudes) == spec.num_layers * len(targets_of(spec, _lora(targets, dora=True)))


def _job(dora: bool, *, precision: str = "fp32", dropout: float = 0.0, b: int = 2, s: int = 256) -> Job:
    return Job(
        model=model_preset("llama-3.1-8b"),
        train=TrainSpec(
            seq_len=s,
            micro_batch=b,
            precision=precision,
            finetune="lora",
            lora_targets="q,v",
            lora_dropout=dropout,
            dora=dora,
            activation_checkpointing="none",
        ),
        cluster=ClusterSpec(gpus=1),
        plan=Plan(strategy="single"),
    )


def _backward_start(job: Job) -> int:
    (moment,) = (m for m in estimate(job).moments if m.label.startswith("start of backward"))
    return sum(t.bytes for t in moment.terms)


@pytest.mark.parametrize(("precision", "dropout"), [("fp32", 0.0), ("bf16", 0.0), ("bf16", 0.1)])
def test_dora_keeps_the_base_and_lora_outputs_and_three_vectors_per_adapted_linear(precision, dropout):
    """Per adapted linear beyond LoRA: the base output (compute dtype; fp32 from F.linear under
    dropout, with the base weight's fp32 cast where it is bf16), the fp32 LoRA output, three fp32
    out-wide vectors; and the magnitude's parameter, gradient and two AdamW states (fp32)."""
    lora, dora = _job(False, precision=precision, dropout=dropout), _job(True, precision=precision, dropout=dropout)
    spec, t = lora.model, 2 * 256
    c = 4 if precision == "fp32" else 2
    base = 4 if dropout else c
    outs = [_linears(spec)[n] for n in ("q", "v")]
    per_block = sum((base + 4) * t * o + 3 * 4 * o for _, o in outs)
    per_block += sum(4 * i * o for i, o in outs) if dropout and c != 4 else 0
    magnitude = 4 * sum(o for _, o in outs)  # parameter, gradient, exp_avg, exp_avg_sq at the start of backward
    expected = spec.num_layers * (per_block + 3 * magnitude)  # no gradient yet: parameter and two states
    assert _backward_start(dora) - _backward_start(lora) == expected


def test_dora_forward_moment_holds_the_widest_linears_weight_temporaries():
    job = _job(True)
    (moment,) = (m for m in estimate(job).moments if m.label.startswith("DoRA's weight norm"))
    (temporaries,) = (t for t in moment.terms if t.key == "dora.forward")
    n_in, n_out = _linears(job.model)["q"]  # q is wider than v (grouped k/v heads)
    assert temporaries.bytes == 4 * (n_in * n_in + n_in * 8 + 3 * n_in * n_out)


def _dora_terms(job: Job, label: str) -> list[int]:
    """The DoRA forward temporaries of ``job``'s moments whose label starts with ``label``."""
    return [
        t.bytes for m in estimate(job).moments if m.label.startswith(label) for t in m.terms if t.key == "dora.forward"
    ]


def test_dora_under_full_ac_recomputes_the_temporaries_in_the_last_blocks_backward():
    recompute, forward = (
        "DoRA's weight norm in the last block's recompute",
        "DoRA's weight norm in the last block's forward",
    )
    checkpointed = _job(True).with_(activation_checkpointing="full")
    assert (
        _dora_terms(checkpointed, recompute) == _dora_terms(checkpointed, forward) == _dora_terms(_job(True), forward)
    )
    assert _dora_terms(_job(True), recompute) == []


@pytest.mark.parametrize("mode", ["full", "qlora", "frozen:2"])
def test_dora_other_than_on_lora_is_refused(mode):
    with pytest.raises(MemplanError, match="lora only"):
        TrainSpec(finetune=mode, dora=True)


def test_dora_on_gpt2s_conv1d_is_refused():
    with pytest.raises(MemplanError, match="not gpt2"):
        trained(model_preset("gpt2"), _lora("c_attn", dora=True))


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


LLAMA_DORA = ("--model", "llama-3.1-8b", "--gpus", "1", "--gpu-mem", "80", "--finetune", "lora", "--dora")


@pytest.mark.parametrize(
    "args",
    [
        ("estimate", "--model", "llama-3.1-8b", "--dora"),
        ("estimate", "--model", "llama-3.1-8b", "--finetune", "qlora", "--dora"),
        ("estimate", "--model", "gpt2", "--finetune", "lora", "--dora"),
    ],
)
def test_cli_refuses_dora_in_one_line(args):
    result = _cli(*args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--dora" in lines[0], result.output


def test_cli_estimate_explain_and_recommend_give_the_same_dora_bytes():
    rec = json.loads(_cli("recommend", *LLAMA_DORA, "--format", "json").output)
    picked = (
        "--strategy",
        rec["strategy"],
        "--precision",
        rec["precision"],
        "--ac",
        rec["activation_checkpointing"],
        "--micro-batch",
        str(rec["micro_batch"]),
        "--offload",
        rec["offload"],
    )
    out = json.loads(_cli("estimate", *LLAMA_DORA, *picked, "--format", "json").output)
    (row,) = out["estimates"]
    assert row["bytes"]["total"] == rec["total_bytes"]
    assert out["inputs"]["train"]["dora"] is True
    explained = _cli("explain", *LLAMA_DORA, *picked).output
    assert f"total = {row['bytes']['total']:,} B" in explained and "DoRA's weight norm" in explained


def test_cli_without_dora_reports_no_dora_field():
    out = json.loads(
        _cli("estimate", *LLAMA_DORA[:-1], "--strategy", "single", "--format", "json").output
    )  # the LoRA report reads as before DoRA existed
    assert "dora" not in out["inputs"]["train"]


# --- the held-out records --------------------------------------------------------------


def _records() -> dict[str, dict]:
    from calibrate import records
    from validation import heldout, peft_matrix

    return {r["id"]: r for r in heldout.latest(records.read([peft_matrix.OUT]))}


def _cases(name: str) -> list:
    pytest.importorskip("torch")
    from validation import peft_matrix

    return list(getattr(peft_matrix, name))


TOLERANCE_PCT = 2.0
"""The bar of the fine-tune matrix: within 2 % of the measured peak of live tensors."""


@pytest.mark.parametrize("case", _cases("DORA_CASES") + _cases("DORA_LOOPS"), ids=lambda c: c.id)
def test_estimate_within_tolerance_of_peft_dora(case):
    from validation import peft_matrix

    record = _records()[peft_matrix.record_id(case)]
    assert record["status"] == "ok" and record["meter"] == "storages", record["error"]
    measured = record["measurement"]["peak_allocated_bytes"]
    est = estimate(peft_matrix.stated_job(record))
    assert est.job.train.dora
    assert abs(est.allocated_bytes - measured) <= TOLERANCE_PCT / 100 * measured, (est.allocated_bytes, measured)
    assert est.phase == record["measurement"]["phase"]


@pytest.mark.parametrize("case", _cases("METER_CHECK")[1::2], ids=lambda c: c.id)
def test_storage_meter_is_memtracker_on_plain_lora(case):
    """Where MemTracker keeps nothing of its own (no DoRA), the two meters' peaks are one, phase by phase."""
    from dataclasses import replace

    from validation import peft_matrix

    recs = _records()
    probe = recs[peft_matrix.record_id(case)]["measurement"]
    tracked = recs[peft_matrix.record_id(replace(case, meter="memtracker"))]["measurement"]
    assert probe["phase_peaks"] == tracked["phase_peaks"]
    assert probe["peak_allocated_bytes"] == tracked["peak_allocated_bytes"]


@pytest.mark.parametrize("case", _cases("DORA_CASES")[4:7], ids=lambda c: c.id)
def test_dora_trained_counts_are_what_peft_builds(case):
    pytest.importorskip("peft")
    from calibrate.loops import LoopLM

    model = LoopLM(case.job.model, hf_type=case.hf_type, attention="sdpa")
    case.adapt(model)
    expected = trained(case.job.model, case.job.with_(dora=True).train.tuning)
    params = list(model.parameters())
    assert sum(p.numel() for p in params if p.requires_grad) == expected.trainable
    assert sum(p.numel() for p in params if not p.requires_grad) == expected.frozen


@pytest.mark.slow
def test_live_dora_measurement_matches_the_record():
    from validation import heldout, peft_matrix

    case = peft_matrix.BY_ID["qwen2-h256-lora-attention-r16-use_dora=True-single-fp32-adamw-g1-b4s128-storages"]
    recorded = _records()[peft_matrix.record_id(case)]["measurement"]["peak_allocated_bytes"]
    outcome = heldout.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    measured = outcome["measurement"]["peak_allocated_bytes"]
    assert abs(measured - recorded) <= 0.005 * recorded, (measured, recorded)


@pytest.mark.slow
def test_calibrate_run_measures_dora_with_the_storage_meter(tmp_path):
    """``memplan calibrate run --finetune lora --dora`` on the hf workload: measured without
    MemTracker's module hooks (calibrate.measure.run), within the matrix's bar of the estimate."""
    from calibrate import records

    out = tmp_path / "runs.jsonl"
    shape = ["--arch", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "256"]
    step = ["--seq-len", "32", "--micro-batch", "2", "--precision", "fp32", "--device", "cpu", "--gpus", "1"]
    job = ["--strategy", "single", "--finetune", "lora", "--dora", "--workload", "hf", "--out", str(out)]
    result = _cli("calibrate", "run", *shape, *step, *job)
    assert result.exit_code == 0, result.output
    (record,) = records.read([out])
    assert record["spec"]["train"]["dora"] is True
    measured = record["measurement"]["peak_allocated_bytes"]
    estimated = estimate(records.job_from_spec(record["spec"])).allocated_bytes
    assert abs(estimated - measured) <= TOLERANCE_PCT / 100 * measured, (estimated, measured)
