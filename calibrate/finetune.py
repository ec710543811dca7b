"""A Hugging Face model adapted for a fine-tuning job as the libraries do it: cast to the
precision's parameter dtype, the blocks' linears quantized to bitsandbytes' NF4 (QLoRA), blocks
frozen, peft's LoRA adapters injected (``memplan calibrate run --finetune ...`` on the hf workload;
the fine-tune matrix, validation/finetune_matrix.py, measures its cases the same way)."""

from __future__ import annotations

from memplan.specs import Job

PROJ = {name: f"{name}_proj" for name in ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")}
"""transformers' module names of memplan's llama linears (peft's target_modules; Phi-3 fuses
qkv_proj and gate_up_proj)."""


def adapt(job: Job, model, lora: dict | None = None) -> None:
    """The job's model (a ``calibrate.loops.LoopLM``) cast, quantized, frozen and given adapters as
    the libraries do (validation/finetune_matrix.py's docstring); ``lora``: ``LoraConfig`` keywords
    as a user writes them (``target_modules``, ``use_dora``), over those the job gives."""
    import torch

    from memplan.precision import POLICIES

    from .wrappers import DTYPES

    train, policy = job.train, POLICIES[job.train.precision]
    if policy.low_precision_params and not policy.master:
        model.hf.to(DTYPES[policy.param_dtype])
    tuning = train.tuning
    if tuning.mode == "full":
        return
    if tuning.mode == "frozen":
        model.hf.get_input_embeddings().requires_grad_(False)
        for block in list(model.layers)[: tuning.frozen_blocks]:
            block.requires_grad_(False)
        return
    if tuning.mode == "qlora":
        for block in model.layers:
            _quantize_linears(block, compute_dtype=torch.bfloat16, double_quant=tuning.double_quant)
    from peft import LoraConfig, get_peft_model

    given = dict(lora or {})
    if tuning.dora:
        given.setdefault("use_dora", True)
    if "target_modules" not in given:
        given["target_modules"] = "all-linear" if tuning.targets == ("all-linear",) else _modules(tuning.targets)
    config = LoraConfig(r=tuning.rank, lora_alpha=int(tuning.alpha), lora_dropout=tuning.dropout, **given)
    get_peft_model(model.hf, config)  # adapters injected into model.hf in place, the rest frozen


def _modules(targets: tuple[str, ...]) -> list[str]:
    if targets == ("attention",):
        return [PROJ[n] for n in ("q", "k", "v", "o")]
    return [PROJ[n] for n in targets]


def _quantize_linears(block, *, compute_dtype, double_quant: bool) -> None:
    """Every nn.Linear of the block as bitsandbytes' Linear4bit: NF4, its absmax statistics
    quantized again where ``double_quant`` (BitsAndBytesConfig's bnb_4bit_use_double_quant, as
    transformers passes it: compress_statistics), quantized on the move to the device
    (Params4bit._quantize)."""
    import bitsandbytes as bnb
    import torch.nn as nn

    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=double_quant,
                quant_type="nf4",
            )
            layer.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, compress_statistics=double_quant, quant_type="nf4"
            )
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.to("cpu"))
