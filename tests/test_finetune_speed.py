"""The step time of a fine-tune: frozen weights skip their weight-gradient GEMMs, frozen:N's
first blocks run forward only, QLoRA dequantizes its NF4 weights twice per micro-batch; and
recommend weighing the modes by memory and speed on one GPU."""

import pytest

from memplan import catalog
from memplan.catalog import model_preset
from memplan.decide import finetune_modes
from memplan.finetune import nf4_bytes_per_param, trained
from memplan.report import finetune_lines
from memplan.specs import ClusterSpec, Job, TrainSpec
from memplan.throughput import dequant_seconds, flops_per_token, link_for, step_time

MODEL = model_preset("llama-3.1-8b")


def _job(**train) -> Job:
    return Job(
        model=MODEL,
        train=TrainSpec(seq_len=2048, micro_batch=2, **train),
        cluster=ClusterSpec(gpus=1, gpu_name="rtx-4090", gpu_mem_bytes=catalog.gpu("rtx-4090").memory_bytes),
    )


def test_lora_skips_the_frozen_weight_gradients():
    full, lora = _job(), _job(finetune="lora", lora_rank=16)
    adapters = trained(MODEL, lora.train.tuning).trainable
    # the frozen weights lose their weight-gradient GEMM: 2·N of the 6·N; the adapters train in full
    assert flops_per_token(lora) == pytest.approx(flops_per_token(full) - 2 * MODEL.num_params + 6 * adapters)


def test_frozen_blocks_run_forward_only():
    full, frozen = _job(), _job(finetune="frozen:8")
    t = trained(MODEL, frozen.train.tuning)
    attention_fwd = 4 * MODEL.num_layers * MODEL.hidden * 2048
    share = 8 / MODEL.num_layers
    skipped = 4 * t.frozen + 2 * attention_fwd * share  # their backward: 4·N and twice the attention's forward
    assert flops_per_token(frozen) == pytest.approx(flops_per_token(full) - skipped)


def test_qlora_dequantizes_every_nf4_weight_in_forward_and_backward():
    job = _job(finetune="qlora", grad_accum=3)
    link = link_for(job)
    quantized = trained(MODEL, job.train.tuning).quantized
    assert quantized > 0.8 * MODEL.num_params
    expected = 2 * 3 * quantized * (nf4_bytes_per_param(True) + 2) / link.gpu.memory_bw_bytes_s
    assert dequant_seconds(job, link) == pytest.approx(expected)
    assert dequant_seconds(job.with_(finetune="lora"), link) == 0.0
    lora = job.with_(finetune="lora")
    assert step_time(job, link).compute_s == pytest.approx(step_time(lora, link).compute_s + expected)


def test_recommend_lines_weigh_memory_and_speed():
    job = _job(finetune="qlora", lora_rank=16, precision="amp-bf16", activation_checkpointing="full").with_(
        micro_batch=1
    )
    lines = finetune_lines(finetune_modes(job))
    speeds = {
        mode: float(line.split("(")[-1].split("×")[0])
        for line in lines
        for mode in ("full", "lora", "qlora")
        if line.startswith(f"  - {mode}: ")
    }
    assert speeds["full"] == 1.0 and speeds["lora"] > speeds["qlora"] > 1.0
    assert "  Fastest mode that fits: qlora (" in "\n".join(lines)  # on a 24 GB card only qlora fits
    assert finetune_lines(finetune_modes(job.with_(seq_len=2**20)))[-1] == "  No mode fits at this option."


def test_min_gpus_answers_how_many_gpus_a_full_fine_tune_needs():
    import memplan
    from memplan.memory import estimate

    inputs = dict(model="llama-3.1-8b", gpu="rtx-4090", seq_len=2048, micro_batch=2, ac="full", calibration=None)
    _, found = memplan.min_gpus(**inputs)
    assert found.estimate.fits and found.estimate.job.train.tuning.mode == "full"
    # one whole node fewer does not fit with the same strategy
    fewer = found.estimate.job.with_(gpus=found.gpus - found.estimate.job.cluster.gpus_per_node)
    assert not estimate(fewer).fits
    _, adapters = memplan.min_gpus(**inputs, finetune="qlora")
    assert adapters.gpus == 1 < found.gpus
