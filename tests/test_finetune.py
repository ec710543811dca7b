"""Fine-tuning (memplan.finetune) against the fine-tune matrix (validation/records/finetune_matrix_cpu.jsonl:
peft LoRA, bitsandbytes QLoRA, frozen blocks, Adafactor and 8-bit AdamW measured on CPU), and
its inputs and reports."""

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import MemplanError
from memplan.finetune import nf4_bytes_per_param, trained
from memplan.memory import estimate
from memplan.specs import Job, ModelSpec, TrainSpec, tuning

pytest.importorskip("torch")
from calibrate import records
from validation import finetune_matrix, heldout

RECORDS = Path(__file__).resolve().parent.parent / finetune_matrix.OUT
TOLERANCE_PCT = 2.0
"""The matrix's bar: every case within 2 % of the measured peak of live tensors."""
RELATIVE_TOLERANCE = 0.005
"""A live re-run against its record (the measurement's own repeatability)."""


@pytest.fixture(scope="module")
def recs() -> list[dict]:
    return heldout.latest(records.read([RECORDS]))


def test_every_case_has_an_ok_record_that_rebuilds_it(recs):
    assert len(finetune_matrix.CASES) >= 12
    assert {r["case"] for r in recs} == set(finetune_matrix.BY_ID)
    for record in recs:
        assert record["status"] == "ok", record["error"]
        assert records.job_from_spec(record["spec"]) == finetune_matrix.BY_ID[record["case"]].job
        assert "peft" in record["libraries"] or record["spec"]["train"].get("finetune", "full") in ("full", "frozen:1")


@pytest.mark.parametrize("case", finetune_matrix.CASES, ids=lambda c: c.id)
def test_estimate_within_tolerance_of_the_measurement(case, recs):
    record = next(r for r in recs if r["case"] == case.id)
    measured = record["measurement"]["peak_allocated_bytes"]
    estimated = estimate(heldout.loop_job(record)).allocated_bytes
    assert abs(estimated - measured) <= TOLERANCE_PCT / 100 * measured, (estimated, measured)


def _cases_by_mode(mode: str) -> list:
    return [c for c in finetune_matrix.CASES if c.job.train.tuning.mode == mode]


@pytest.mark.parametrize("case", _cases_by_mode("lora")[:1] + _cases_by_mode("qlora")[:1] + _cases_by_mode("frozen"))
def test_trained_counts_are_what_the_libraries_build(case):
    pytest.importorskip("peft")
    from calibrate.loops import LoopLM

    model = LoopLM(case.job.model, hf_type=case.hf_type, attention="sdpa")
    case.adapt(model)
    expected = trained(case.job.model, case.job.train.tuning)
    params = list(model.parameters())
    assert sum(p.numel() for p in params if p.requires_grad) == expected.trainable
    # bitsandbytes packs two NF4 codes a byte: a quantized weight counts half its elements
    frozen = sum(p.numel() * (2 if p.dtype.itemsize == 1 else 1) for p in params if not p.requires_grad)
    assert frozen == expected.frozen


def test_nf4_bytes_are_bitsandbytes_storage():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    import torch

    out_features, in_features = 512, 256
    weight = bnb.nn.Params4bit(
        torch.randn(out_features, in_features), requires_grad=False, compress_statistics=True, quant_type="nf4"
    ).to("cpu")
    state = weight.quant_state
    # codes, 8-bit block absmax, and the nested state's fp32 absmax (its code table is shared)
    stored = weight.numel() + state.absmax.numel() * state.absmax.element_size() + 4 * state.state2.absmax.numel()
    assert stored == math.ceil(nf4_bytes_per_param(True) * out_features * in_features)


LLAMA = ModelSpec(num_layers=4, hidden=512, num_heads=8, num_kv_heads=2, ffn_hidden=1376, vocab_size=4096)


def test_full_is_the_default_and_changes_nothing():
    assert TrainSpec().tuning.mode == "full"
    job = Job(model=LLAMA)
    other = estimate(job.with_(finetune="full", lora_rank=64, lora_targets="all-linear"))
    assert (estimate(job).moments, estimate(job).notes) == (other.moments, other.notes)


def test_lora_trains_only_the_adapters():
    job = Job(model=LLAMA, train=TrainSpec(finetune="lora", lora_rank=16, lora_targets="q,v", micro_batch=1))
    t = trained(job.model, job.train.tuning)
    per_block = 16 * (512 + 512) + 16 * (512 + 128)  # q: r·(h + h), v: r·(h + kv), kv = 2 heads of 64
    assert t.trainable == 4 * per_block
    assert t.total == LLAMA.num_params + t.trainable
    full = estimate(job.with_(finetune="full"))
    assert estimate(job).allocated_bytes < full.allocated_bytes


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("finetune", "partial", "frozen:N"),
        ("finetune", "frozen:0", "N ≥ 1"),
        ("lora_targets", "mlp", "all-linear"),
        ("lora_dropout", 1.5, "[0, 1)"),
        ("lora_rank", 0, "positive integer"),
    ],
)
def test_bad_fine_tuning_inputs_are_refused_by_name(field, value, accepted):
    with pytest.raises(MemplanError, match=field) as info:
        TrainSpec(**{field: value})
    assert accepted in str(info.value)


def test_frozen_blocks_must_leave_one_trained():
    with pytest.raises(MemplanError, match="frozen:4"):
        estimate(Job(model=LLAMA, train=TrainSpec(finetune="frozen:4")))


def test_cli_json_states_trainable_and_frozen_counts():
    args = ["estimate", "--model", "llama-2-7b", "--gpus", "1", "--strategy", "single", "--finetune", "qlora"]
    args += ["--lora-rank", "16", "--lora-targets", "all-linear", "--format", "json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    train = json.loads(result.output)["inputs"]["train"]
    from memplan.catalog import model_preset

    expected = trained(model_preset("llama-2-7b"), tuning("qlora", 16, 16.0, "all-linear", 0.0))
    assert (train["trainable_params"], train["frozen_params"]) == (expected.trainable, expected.frozen)
    assert train["finetune"] == "qlora"
    full = CliRunner().invoke(main, [*args[:7], "--format", "json"])  # no --finetune: full
    counts = json.loads(full.output)["inputs"]["train"]
    P = model_preset("llama-2-7b").num_params
    assert (counts["trainable_params"], counts["frozen_params"], counts["total_params"]) == (P, 0, P)


def test_cli_bad_mode_is_one_line():
    result = CliRunner().invoke(main, ["estimate", "--params", "1e9", "--finetune", "half"])
    assert result.exit_code == 2
    assert "--finetune" in result.output or "finetune 'half'" in result.output


@pytest.mark.slow
def test_live_measurement_matches_the_record(recs):
    case = finetune_matrix.BY_ID["llama-h256-lora-attention-r8-single-fp32-adamw-g1-b2s256"]
    record = next(r for r in recs if r["case"] == case.id)
    outcome = heldout.measure_case(case)
    assert outcome["status"] == "ok", outcome["error"]
    recorded = record["measurement"]["peak_allocated_bytes"]
    measured = outcome["measurement"]["peak_allocated_bytes"]
    assert abs(measured - recorded) <= RELATIVE_TOLERANCE * recorded, (measured, recorded)


def test_recommend_on_one_gpu_weighs_the_fine_tune_modes():
    from memplan.decide import finetune_modes
    from memplan.memory import modes_compared
    from memplan.report import finetune_lines

    job = Job(model=LLAMA, train=TrainSpec(finetune="qlora", seq_len=512))
    lines = finetune_lines(finetune_modes(job))
    compared = modes_compared(job)
    assert [mode for mode, _ in compared] == ["full", "lora", "qlora"]
    assert compared[2][1].allocated_bytes < compared[1][1].allocated_bytes < compared[0][1].allocated_bytes
    assert all(any(line.startswith(f"  - {mode}: ") for line in lines) for mode, _ in compared)
    assert finetune_modes(job.with_(finetune="full")) == () == finetune_modes(job.with_(gpus=2, strategy="ddp"))
    assert finetune_lines(()) == []


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "pythia-6.9b",
        "qwen2.5-7b",
        "vit-large-patch16-224",
        "llama-3.2-1b",
        "bert-base-uncased",
        "roberta-large",
    ],
)
def test_trained_tensors_of_a_full_fine_tune_are_the_model(name):
    """Adafactor and 8-bit AdamW size their states per tensor: the tensors must be the model's."""
    from memplan.catalog import model_preset
    from memplan.finetune import full_tensors

    model = model_preset(name)
    assert sum(math.prod(t) for t in full_tensors(model)) == model.num_params


def test_tied_embedding_gradients_are_summed_out_of_place_outside_fsdp():
    """memory.TIED_SUM: the head's and the embedding's gradients and their sum at once (measured:
    the qwen2 bf16 full torch-adafactor case)."""
    from memplan.memory import Step

    tied = finetune_matrix.QWEN
    job = Job(model=tied, train=TrainSpec(precision="bf16", seq_len=32, device="cpu")).with_(strategy="single")
    moment = next(m for m in estimate(job).moments if m.label.startswith("backward of the tied"))
    summed = sum(t.bytes for t in moment.terms if t.key == "grads.tied_sum")
    assert summed == 2 * 2 * tied.vocab_size * tied.hidden
    assert not Step(Job(model=LLAMA, train=job.train, plan=job.plan)).tied_sum()
    assert not Step(job.with_(gpus=2, strategy="fsdp-full-shard")).tied_sum()  # FSDP's root unit holds it


def test_the_meter_keeps_no_earlier_step_s_leaf_module_inputs():
    """calibrate.measure's MemTracker: a module input that is a leaf requiring grad (a frozen
    embedding's output marked as peft marks it under gradient checkpointing) is not kept alive by
    ModTracker's multi-grad hooks once the next step starts; torch's MemTracker alone keeps every
    step's (and its .grad): what made the LoRA + AC cases measure 2 b·s·h too high."""
    import gc
    import weakref

    import torch
    import torch.nn as nn

    from calibrate.measure import _CpuMeter

    embedding, block = nn.Embedding(64, 16).requires_grad_(False), nn.Linear(16, 16)
    embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    outputs: list = []
    ids = torch.randint(0, 64, (2, 8))
    with _CpuMeter() as meter:
        for _ in range(3):
            meter.new_step()
            x = embedding(ids)
            outputs.append(weakref.ref(x))
            block(x).sum().backward()
            del x
        gc.collect()
        alive = [ref() is not None for ref in outputs]
    assert alive == [False, False, True]  # the last step's own, until the next step starts


@pytest.mark.parametrize("mode", ["lora", "qlora"])
def test_the_fine_tune_modes_line_of_the_jobs_own_mode_says_the_recommendations_bytes(mode):
    """One answer: the modes compared at the recommended option carry the total every command
    reports (the replayed reserved in it), so the job's own mode repeats the pick's GiB."""
    import re

    from click.testing import CliRunner

    from memplan.cli import main

    args = ["recommend", "--model", "llama-3.1-8b", "--gpus", "1", "--gpu-mem", "80", "--finetune", mode]
    out = CliRunner().invoke(main, args).stdout
    picked = re.search(r"^  ([\d.]+) GiB per GPU", out, re.M)
    own = re.search(rf"^  - {mode}: ([\d.]+) GiB of", out, re.M)
    assert picked and own and picked.group(1) == own.group(1)
