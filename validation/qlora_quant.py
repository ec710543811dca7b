"""QLoRA's ``BitsAndBytesConfig`` as users write it (issue 27): ``bnb_4bit_use_double_quant``, off
by default in transformers' BitsAndBytesConfig and on in the QLoRA paper's scripts, measured on CPU
as the fine-tuning matrix measures QLoRA (validation.finetune_matrix: every linear of the blocks
as bitsandbytes' Linear4bit, NF4, ``compress_statistics`` as the config's double quantization;
peft's LoRA on them; MemTracker's peak of live tensors on one process). Wide blocks and few
tokens, so the 4-bit weights and their statistics are most of the peak.

The first table, before memplan read the setting (it charged double quantization's bytes to
every NF4 weight): validation/records/qlora_quant_cpu.first.md.

    python -m validation.qlora_quant            # measure every case not yet recorded
    python -m validation.qlora_quant --report   # measured, estimated today, error %, peak phase
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memplan.specs import ModelSpec

from . import heldout
from .finetune_matrix import FinetuneCase, _case

OUT = "validation/records/qlora_quant_cpu.jsonl"
TIMEOUT_S = 600
"""Quantizing a hundred million weights to NF4 takes a while on two CPU cores."""

WIDE = ModelSpec(
    name="llama-h2048-l2",
    arch="llama",
    num_layers=2,
    hidden=2048,
    num_heads=16,
    num_kv_heads=4,
    ffn_hidden=5632,
    vocab_size=2048,
)
QWEN_WIDE = ModelSpec(
    name="qwen2-h1536-l2",
    arch="llama",
    num_layers=2,
    hidden=1536,
    num_heads=12,
    num_kv_heads=2,
    ffn_hidden=4096,
    vocab_size=3072,
    tied_embeddings=True,
    qkv_bias=True,
)
HF_TYPE = {WIDE.name: "llama", QWEN_WIDE.name: "qwen2"}


@dataclass(frozen=True)
class QuantCase(FinetuneCase):
    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]


def _qlora(model: ModelSpec, *, double_quant: bool, **kwargs) -> QuantCase:
    case = _case(model, "qlora", "single", "bf16", **kwargs)
    job = replace(case.job, train=replace(case.job.train, qlora_double_quant=double_quant))
    return QuantCase(f"{case.id}-dq{int(double_quant)}", job, case.loop, case.ac, case.mode, case.lora)


CASES = (
    _qlora(WIDE, double_quant=False, b=1, s=64),
    _qlora(WIDE, double_quant=False, b=1, s=64, rank=16, targets="all-linear"),
    _qlora(WIDE, double_quant=True, b=1, s=64, rank=16, targets="all-linear"),
    _qlora(QWEN_WIDE, double_quant=False, b=2, s=128),
    _qlora(QWEN_WIDE, double_quant=False, b=1, s=128, targets="all-linear", ac="full"),
    # added after the model read the setting (not held out): the qwen2 shape with double quantization
    _qlora(QWEN_WIDE, double_quant=True, b=2, s=128),
)
BY_ID = {case.id: case for case in CASES}

# the held-out matrix's child, record, table and command line serve this one (heldout.main's matrix)
measure_case, make_record, record_id = heldout.measure_case, heldout.make_record, heldout.record_id
render_report = heldout.render_cases


if __name__ == "__main__":  # the cases as validation.qlora_quant's, which the child processes import
    from validation import qlora_quant

    heldout.main(matrix=qlora_quant)
