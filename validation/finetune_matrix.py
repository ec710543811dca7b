"""The fine-tuning matrix: peft's LoRA (and QLoRA on bitsandbytes' NF4 layers) on Hugging Face
models built from configs, frozen blocks, Adafactor and 8-bit AdamW, measured on CPU as the
held-out matrix is (validation.heldout: real gloo ranks, MemTracker's peak of live tensors).

    python -m validation.finetune_matrix   # measure every case not yet recorded
    python -m validation.finetune_matrix --report   # measured, estimated today, error %, peak phase

Each case is the memplan Job a user would type (``--finetune lora --lora-rank 8 ...``) and the
model the libraries build for it:

    lora    ``peft.get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout))``
            after the model is cast to the precision's parameter dtype (peft then keeps the
            adapters in fp32: ``autocast_adapter_dtype=True``)
    qlora   every linear layer of the blocks replaced by ``bitsandbytes.nn.Linear4bit`` (NF4,
            double quantization, bf16 compute: transformers' BitsAndBytesConfig(load_in_4bit,
            bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True), whose quantizer leaves
            the head out), then LoRA as above
    frozen  ``requires_grad_(False)`` on the input embedding and the first N blocks
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any

from calibrate.finetune import adapt
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

from . import heldout

OUT = "validation/records/finetune_matrix_cpu.jsonl"

LLAMA = ModelSpec(
    name="llama-h256",
    arch="llama",
    num_layers=4,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=688,
    vocab_size=2048,
)
QWEN = ModelSpec(
    name="qwen2-h256",
    arch="llama",
    num_layers=3,
    hidden=256,
    num_heads=4,
    num_kv_heads=1,
    ffn_hidden=704,
    vocab_size=3072,
    tied_embeddings=True,
    qkv_bias=True,
)
QWEN3 = ModelSpec(
    name="qwen3-h256",
    arch="llama",
    num_layers=3,
    hidden=256,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=768,
    vocab_size=3072,
    tied_embeddings=True,
    qk_norm=True,
)
_BERT: dict[str, Any] = dict(
    arch="bert", num_layers=3, hidden=256, num_heads=4, ffn_hidden=1024, linear_bias=True, tied_embeddings=True
)
BERT_MLM = ModelSpec(name="bert-h256-mlm", vocab_size=2048, max_positions=512, type_vocab_size=2, **_BERT)
BERT_CLS = ModelSpec(
    name="bert-h256-cls2", vocab_size=2048, max_positions=512, type_vocab_size=2, num_labels=2, dropout=0.1, **_BERT
)
ROBERTA_MLM = ModelSpec(name="roberta-h256-mlm", vocab_size=3072, max_positions=514, type_vocab_size=1, **_BERT)
ROBERTA_CLS = ModelSpec(
    name="roberta-h256-cls3", vocab_size=3072, max_positions=514, type_vocab_size=1, num_labels=3, **_BERT
)
"""Encoders as transformers' BertForMaskedLM / BertForSequenceClassification and the RoBERTa ones."""
HF_TYPE = {
    LLAMA.name: "llama",
    QWEN.name: "qwen2",
    QWEN3.name: "qwen3",
    BERT_MLM.name: "bert",
    BERT_CLS.name: "bert",
    ROBERTA_MLM.name: "roberta",
    ROBERTA_CLS.name: "roberta",
}


@dataclass(frozen=True)
class FinetuneCase(heldout.Case):
    """A held-out case whose model peft (and bitsandbytes) adapt before it is wrapped."""

    @property
    def hf_type(self) -> str:
        return HF_TYPE[self.job.model.name]

    lora: tuple[tuple[str, Any], ...] = ()
    """``LoraConfig`` keywords as the user writes them (``target_modules``, ``use_dora``), beyond
    what the job states; none: the job's own."""

    def adapt(self, model) -> None:
        """Cast, quantize, freeze and add adapters as the libraries do (the module docstring)."""
        adapt(self.job, model, dict(self.lora))

    def record_fields(self) -> dict:
        given = {"peft_config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.lora}} if self.lora else {}
        return given | self._libraries()

    def _libraries(self) -> dict:
        libraries = ["peft", "bitsandbytes"] if self.job.train.tuning.mode == "qlora" else ["peft"]
        if self.job.train.optimizer in ("adam8bit", "lion", "lion8bit", "paged-adamw8bit"):
            libraries.append("bitsandbytes")
        return {"libraries": {name: metadata.version(name) for name in dict.fromkeys(libraries)}}


def _case(
    model: ModelSpec,
    finetune: str,
    strategy: str,
    precision: str,
    *,
    gpus: int = 1,
    b: int = 2,
    s: int = 256,
    rank: int = 8,
    targets: str = "attention",
    dropout: float = 0.0,
    optimizer: str = "adamw",
    ac: str = "none",
    impl: str | None = None,
    zero_grad: str = "none",
    attention: str = "sdpa",
    lora: tuple[tuple[str, Any], ...] = (),
) -> FinetuneCase:
    job = Job(
        model=model,
        train=TrainSpec(
            seq_len=s,
            micro_batch=b,
            precision=precision,
            optimizer=optimizer,
            optimizer_impl=impl,
            activation_checkpointing=ac,
            device="cpu",
            finetune=finetune,
            lora_rank=rank,
            lora_targets=targets,
            lora_dropout=dropout,
            zero_grad=zero_grad,
            attention=attention,
        ),
        cluster=ClusterSpec(gpus=gpus),
        plan=Plan(strategy={"single": "single", **heldout.STRATEGY}[strategy]),
    )
    adapter = f"-{targets}-r{rank}" + (f"-p{dropout:g}" if dropout else "") if "lora" in finetune else ""
    checkpointed = f"-ac{ac}" if ac != "none" else ""
    checkpointed += f"-zg{zero_grad}" if zero_grad != "none" else ""
    checkpointed += f"-{attention}" if attention != "sdpa" else ""
    stepped = f"-{impl}" if impl else ""
    stepper = f"{optimizer}{stepped}{checkpointed}"
    written = "".join(f"-{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in lora)
    name = f"{model.name}-{finetune}{adapter}{written}-{strategy}-{precision}-{stepper}-g{gpus}-b{b}s{s}"
    return FinetuneCase(name, job, "plain-kept", ac, "local", lora)


CASES = (
    _case(LLAMA, "lora", "single", "fp32"),
    _case(LLAMA, "lora", "single", "fp32", rank=16, targets="all-linear", dropout=0.1),
    _case(LLAMA, "lora", "single", "bf16", b=1, s=128),
    _case(LLAMA, "lora", "ddp", "fp32", gpus=2),
    _case(LLAMA, "lora", "fsdp", "fp32", gpus=2, targets="all-linear"),
    _case(LLAMA, "lora", "fsdp", "mixed-bf16", gpus=2, b=1, s=128, targets="all-linear"),
    _case(QWEN, "lora", "single", "fp32"),
    _case(QWEN, "lora", "ddp", "bf16", gpus=2, b=1, s=128, targets="all-linear", dropout=0.05),
    _case(QWEN, "lora", "fsdp", "fp32", gpus=2),
    _case(LLAMA, "qlora", "single", "bf16", b=1, s=128, rank=16, targets="all-linear"),
    _case(QWEN, "qlora", "single", "bf16", b=1, s=128),
    _case(LLAMA, "lora", "single", "fp32", rank=16, targets="all-linear", optimizer="adafactor"),
    _case(LLAMA, "lora", "single", "fp32", rank=16, targets="all-linear", optimizer="adam8bit"),
    _case(LLAMA, "frozen:1", "single", "fp32"),
    _case(QWEN, "full", "single", "fp32", optimizer="adafactor"),
    _case(LLAMA, "full", "single", "fp32", optimizer="adam8bit"),
    # measured after the model: transformers' gradient checkpointing around peft's adapters
    _case(LLAMA, "lora", "single", "fp32", targets="all-linear", ac="full"),
    _case(QWEN, "qlora", "single", "bf16", b=1, s=128, rank=16, targets="all-linear", ac="full"),
    # the optimizers people fine-tune with, measured before they were modelled (a short sequence
    # puts the peak in the optimizer step, where its states and temporaries are)
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="lion"),
    _case(LLAMA, "full", "single", "bf16", b=1, s=32, optimizer="lion"),
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="lion8bit"),
    _case(QWEN, "lora", "single", "fp32", targets="all-linear", optimizer="lion8bit"),
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="torch-adafactor"),
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="torch-adafactor", impl="foreach"),
    _case(QWEN, "full", "single", "bf16", b=1, s=32, optimizer="torch-adafactor"),
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="sgd-momentum"),
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="sgd-momentum", impl="foreach"),
    _case(QWEN, "lora", "ddp", "fp32", gpus=2, optimizer="sgd-momentum"),
    _case(LLAMA, "full", "single", "fp32", b=1, s=32, optimizer="paged-adamw8bit"),
    # Qwen3's per-head q/k norms, measured before their saves were modelled
    _case(QWEN3, "full", "single", "fp32"),
    _case(QWEN3, "full", "single", "bf16", b=1, s=128),
    _case(QWEN3, "lora", "single", "fp32", targets="all-linear"),
    _case(QWEN3, "full", "fsdp", "fp32", gpus=2),
    # encoders (full fine-tunes), measured before memplan modelled them
    _case(BERT_MLM, "full", "single", "fp32"),
    _case(BERT_CLS, "full", "single", "fp32", b=4),
    _case(BERT_MLM, "full", "ddp", "amp-bf16", gpus=2, b=1, s=128),
    _case(ROBERTA_CLS, "full", "fsdp", "fp32", gpus=2),
    _case(ROBERTA_MLM, "full", "single", "amp-bf16", b=1, s=128),
    _case(BERT_CLS, "full", "single", "fp32", b=4, ac="full"),
    _case(BERT_CLS, "full", "single", "fp32", b=4, optimizer="adafactor"),
    _case(ROBERTA_CLS, "full", "single", "fp32", optimizer="adam8bit"),
    # measured after the encoder model (held out): FSDP2 around BERT, fp32 and mixed-bf16
    _case(BERT_CLS, "full", "fsdp", "fp32", gpus=2, b=4),
    _case(BERT_MLM, "full", "fsdp", "mixed-bf16", gpus=2, b=1, s=128),
    # held out, measured before the LoRA + AC misses were looked into: peft's adapters under
    # transformers' gradient checkpointing on two ranks (DDP; FSDP2 mixed-bf16 with dropout)
    _case(QWEN3, "lora", "ddp", "fp32", gpus=2, rank=16, targets="all-linear", ac="full"),
    _case(LLAMA, "lora", "fsdp", "mixed-bf16", gpus=2, b=1, s=128, rank=4, dropout=0.1, ac="full"),
    # gradients zero-filled between steps (set_to_none=False: the 2022 HF Trainer's
    # model.zero_grad()), measured before the convention was modelled
    _case(BERT_CLS, "full", "single", "fp32", b=4, zero_grad="zeros"),
    _case(BERT_MLM, "full", "single", "amp-bf16", b=1, s=128, zero_grad="zeros"),
    _case(LLAMA, "lora", "single", "fp32", zero_grad="zeros"),
    # the 2022 HF BERT runs' shape (README "Published GPU runs"): eager attention at seq 512,
    # zero-filled gradients, batch 1 and 4, measured before their misses were looked into
    _case(BERT_CLS, "full", "single", "fp32", b=1, s=512, zero_grad="zeros", attention="eager"),
    _case(BERT_CLS, "full", "single", "fp32", b=4, s=512, zero_grad="zeros", attention="eager"),
)
STAND_IN = {
    "lion": "sgd-momentum",
    "lion8bit": "adam8bit",
    "torch-adafactor": "adafactor",
    "paged-adamw8bit": "adam8bit",
}
"""The optimizer a user would have typed for one memplan did not model yet (the first table of
the optimizer cases: lion's one fp32 state as SGD's momentum, torch's Adafactor as transformers')."""
BY_ID = {case.id: case for case in CASES}


# the held-out matrix's child, record, table and command line serve this one (heldout.main's matrix)
TIMEOUT_S = heldout.TIMEOUT_S
measure_case, make_record, record_id = heldout.measure_case, heldout.make_record, heldout.record_id
render_report = heldout.render_cases

if __name__ == "__main__":  # the cases as validation.finetune_matrix's, which the child processes import
    from validation import finetune_matrix

    heldout.main(matrix=finetune_matrix)
