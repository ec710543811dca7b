"""The training steps real frameworks run, measured on CPU with their own code.

Each Loop names the conventions of its step (who still holds the logits when backward
starts, which loss, which activation checkpointing) in the keys of issue 12's ``loop``
record, and ``step`` runs one micro-batch's forward and backward the way that framework
does it, calling the framework's own function where it runs here:

    hf-trainer     transformers ``Trainer.training_step`` (compute_loss keeps only the
                   loss: the logits are freed before ``accelerator.backward``)
    plain-kept     ``out = model(input_ids=x, labels=x); loss = out.loss; loss.backward()``
    plain-freed    ``model(input_ids=x, labels=x).loss.backward()``
    accelerate     ``outputs = model(**batch); loss = outputs.loss; accelerator.backward(loss)``
                   (accelerate's README loop: the outputs are kept)
    plain-held     the plain loop written as tutorials write it, ``for batch in data: outputs =
                   model(**batch); outputs.loss.backward(); optimizer.step(); optimizer.zero_grad()``:
                   the caller's ``outputs`` live through the optimizer step and the next step's
                   forward (the name is rebound when that forward returns); ``use_cache=False``
    plain-held-cache  the same with ``use_cache=True`` (transformers' configs' default): the outputs
                   also hold the DynamicCache, every layer's keys and values
    torchtune      ``logits = model(x)`` as torchtune's chunked output (the LM head applied
                   per chunk of the hidden states); ``CEWithChunkedOutputLoss``; ``del logits``
    torchtune-model  torchtune's own model (models/llama3_2's TransformerDecoder, whose forward
                   upcasts the logits: ``self.output(h).float()``) and its single-device
                   recipe's ``_loss_step`` with ``torch.nn.CrossEntropyLoss``; compiled by
                   torchtune's ``training.compile_model`` and ``compile_loss``
    torchtitan     ``pred = model(x); loss = cross_entropy_loss(pred, labels); del pred``
                   (torchtitan's Trainer._forward_backward_body and components/loss.py)
    cce-compile    cut-cross-entropy's ``linear_cross_entropy(hidden, lm_head.weight, labels,
                   shift=True, impl="torch_compile")`` in place of the head and the loss, as its
                   transformers patch (the repository's cce_forward / apply_lce) calls it; the
                   PyPI wheel (25.1.1) ships no patch module, so the model's forward does it.
                   Its default ``cce`` implementation is Triton (GPU only); torch_compile is
                   its inductor path (logits inside one compiled graph), which runs on CPU

Activation checkpointing ``op`` is torchtitan's own per-op ``SelectiveAC`` applied to
the Hugging Face blocks; ``full`` is transformers' gradient checkpointing (torchtitan's
``FullAC`` in the torchtitan loop).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from memplan import loop as memplan_loop
from memplan.precision import POLICIES
from memplan.specs import Job, ModelSpec

from .measure import METERS, Measurement, _optimizer
from .workloads import hf_config
from .wrappers import DTYPES, wrap

LOOP_KEYS = (*(f.name for f in fields(memplan_loop.Loop)), "loss_impl", "use_cache")
"""A record's ``loop`` keys: memplan's ``loop.Loop`` settings, which library's fused loss ran, and
whether the held loops' model kept its KV cache."""
HF_TYPES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox")
TORCHTUNE_CHUNKS = 8
"""torchtune recipes' ``num_output_chunks`` (CEWithChunkedOutputLoss's default)."""


def _version(package: str) -> str:
    return metadata.version(package)


@dataclass(frozen=True, kw_only=True)
class Loop:
    name: str
    recipe: str
    logits: str
    """kept: the caller holds the model's output during backward; freed: dropped before."""
    source: str
    """The framework function that runs the step (its package is named in ``loop_source``)."""
    package: str
    loss: str = "ce"
    loss_chunks: int = 1
    loss_impl: str = ""
    """Which library's fused loss ran (``cce-torch-compile``); empty for the others."""
    use_cache: bool = False
    """The model called with ``use_cache=True`` (the held loops; the others leave the config's)."""

    def conventions(self, ac: str, train=None) -> dict:
        """The record's ``loop`` object for this loop under activation checkpointing ``ac``,
        with the flags ``train`` (the case's TrainSpec) turns on (none without it)."""
        flags = train.loop if train is not None else memplan_loop.Loop()
        mine = {"logits": self.logits, "loss": self.loss, "loss_chunks": self.loss_chunks, "recipe": self.recipe}
        return (
            asdict(flags)
            | mine
            | {"ac": ac, "ac_every": flags.ac_every if ac != "none" else 0}
            | ({"loss_impl": self.loss_impl} if self.loss_impl else {})
            | ({"use_cache": self.use_cache} if self.logits == "held" else {})
        )

    def loop_source(self) -> str:
        return f"{self.package} {_version(self.package)} {self.source}"


LOOPS = {
    loop.name: loop
    for loop in (
        Loop(
            name="hf-trainer",
            recipe="hf-trainer",
            logits="freed",
            package="transformers",
            source="Trainer.training_step",
        ),
        Loop(
            name="plain-kept",
            recipe="plain",
            logits="kept",
            package="transformers",
            source="PreTrainedModel forward: out = model(input_ids, labels); out.loss.backward()",
        ),
        Loop(
            name="plain-freed",
            recipe="plain",
            logits="freed",
            package="transformers",
            source="PreTrainedModel forward: model(input_ids, labels).loss.backward()",
        ),
        *(
            Loop(
                name=f"plain-held{'-cache' * cache}",
                recipe="plain",
                logits="held",
                use_cache=cache,
                package="transformers",
                source=f"PreTrainedModel forward: for step: outputs = model(input_ids, labels, use_cache={cache}); "
                "outputs.loss.backward(); optimizer.step(); optimizer.zero_grad() (outputs held until the next "
                "forward returns)",
            )
            for cache in (False, True)
        ),
        Loop(
            name="accelerate",
            recipe="accelerate",
            logits="kept",
            package="accelerate",
            source="Accelerator.backward on outputs = model(**batch); loss = outputs.loss",
        ),
        Loop(
            name="torchtune",
            recipe="torchtune",
            logits="freed",
            loss="chunked-ce",
            loss_chunks=TORCHTUNE_CHUNKS,
            package="torchtune",
            source="modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss (the module file loaded alone: "
            "the torchtune package does not import with torchao 0.18), chunked output as "
            "TransformerDecoder.chunked_output, del logits",
        ),
        Loop(
            name="torchtune-model",
            recipe="torchtune",
            logits="freed",
            loss="ce",
            package="torchtune",
            source="recipes/full_finetune_single_device.py _loss_step (del logits) on models/llama3_2's "
            "TransformerDecoder (output = self.output(h).float()) with torch.nn.CrossEntropyLoss; "
            "training/_compile.py compile_model, compile_loss",
        ),
        Loop(
            name="torchtitan",
            recipe="torchtitan",
            logits="freed",
            package="torchtitan",
            source="components/loss.py cross_entropy_loss, Trainer._forward_backward_body (del pred); "
            "AC distributed/activation_checkpoint.py SelectiveAC / FullAC",
        ),
        Loop(
            name="cce-compile",
            recipe="plain",
            logits="freed",
            loss="fused-linear-ce",
            loss_impl="cce-torch-compile",
            package="cut-cross-entropy",
            source="linear_cross_entropy(hidden, lm_head.weight, labels, shift=True, impl='torch_compile') "
            "(torch_compile.py) in place of the head, as the repository's transformers cce_forward calls it; "
            "model(input_ids, labels).loss.backward()",
        ),
    )
}


def _torchtune_loss_class():
    """torchtune's CEWithChunkedOutputLoss from its own source file (torch-only imports)."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("torchtune is not installed")
    path = Path(spec.submodule_search_locations[0], "modules", "loss", "ce_chunked_output_loss.py")
    module_spec = importlib.util.spec_from_file_location("_torchtune_ce_chunked_output_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.CEWithChunkedOutputLoss


def _hf_config(spec: ModelSpec, hf_type: str, *, attention: str, overrides: dict | None = None):
    """The transformers config of ``hf_type`` with the spec's shapes (random weights);
    ``overrides``: config keys set beyond them (a shape the spec cannot hold)."""
    from transformers import AutoConfig

    if overrides and (hf_type in ("llama", "gpt2", "gpt_neox") or spec.arch == "bert"):
        raise ValueError(f"config overrides are set on the generic (mistral, qwen, deepseek) configs, not {hf_type}")

    if hf_type in ("llama", "gpt2", "gpt_neox"):
        return hf_config(spec, attention=attention)
    if spec.arch == "bert":  # bert, roberta: the head by num_labels (memplan.specs.ModelSpec)
        config = AutoConfig.for_model(
            hf_type,
            vocab_size=spec.vocab_size,
            num_hidden_layers=spec.num_layers,
            hidden_size=spec.hidden,
            num_attention_heads=spec.num_heads,
            intermediate_size=spec.ffn_hidden,
            hidden_act=spec.activation,
            max_position_embeddings=spec.max_positions,
            type_vocab_size=spec.type_vocab_size,
            hidden_dropout_prob=spec.dropout,
            attention_probs_dropout_prob=spec.dropout,
            num_labels=spec.num_labels or 2,
        )
        config._attn_implementation = attention
        return config
    # qwen2 and mistral are llama-arch blocks (qwen2: q/k/v biases); memplan describes them as arch llama
    shapes = dict(
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tied_embeddings,
        num_hidden_layers=spec.num_layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.ffn_hidden,
        attention_dropout=spec.dropout,
        sliding_window=None,
        use_sliding_window=False,
    )
    if spec.qk_norm or spec.head_dim:  # Qwen3Config's head_dim defaults to 128, the others' to hidden/heads
        shapes["head_dim"] = spec.head_size
    if spec.qk_norm:  # qwen3: its q/k/v biases default to none
        shapes["attention_bias"] = spec.qkv_bias
    if spec.num_experts:  # mixtral, qwen2_moe, qwen3_moe: the experts' keys (calibrate.moe_ep)
        from .moe_ep import hf_moe_kwargs

        shapes |= hf_moe_kwargs(spec, hf_type)
    config = AutoConfig.for_model(hf_type, **shapes | (overrides or {}))
    config._attn_implementation = attention
    return config


_TORCHTUNE_ABSENT = ("datasets", "omegaconf", "sentencepiece", "tiktoken")
"""Packages torchtune imports when its package loads (data, config, tokenizers) that this
environment lacks and a training step never calls."""


def import_torchtune():
    """The torchtune package, imported with stand-ins for what it imports at load time but a
    full fine-tune's step never calls: torchao.dtypes.nf4tensor (QLoRA's NF4, gone from torchao
    0.18), torchtune.training.quantization (QAT, which names torchao 0.7's API), and the data,
    config and tokenizer packages above when absent. A stand-in raises when it is called."""
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    if "torchtune.models.llama3_2" in sys.modules:
        return sys.modules["torchtune"]

    def absent(*args, **kwargs):
        raise NotImplementedError("a stand-in for a package torchtune imports but this step does not use")

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": absent}) if name[:1].isupper() else absent

    exact = {"torchao.dtypes.nf4tensor", "torchtune.training.quantization"}
    roots = {r for r in _TORCHTUNE_ABSENT if importlib.util.find_spec(r) is None}

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name in exact or name.split(".")[0] in roots:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            made.append(spec.name)
            module = Stub(spec.name)
            module.__path__ = []
            if spec.name == "torchao.dtypes.nf4tensor":  # isinstance(x, NF4Tensor) checks must answer False
                module.NF4Tensor = type("NF4Tensor", (), {})
                module.implements = lambda *a, **k: lambda f: f
            return module

        def exec_module(self, module):
            return None

    finder, made = Finder(), []
    sys.meta_path.insert(0, finder)
    try:
        import torchtune.models.llama3_2
        import torchtune.training  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        # torchtune keeps the names it bound; nothing imported later finds a stand-in
        for name in made:
            sys.modules.pop(name, None)
    return sys.modules["torchtune"]


class TorchtuneLM(nn.Module):
    """torchtune's Llama 3.2 TransformerDecoder (models/llama3_2 ``llama3_2``, tied embeddings) with
    the spec's shapes, built in the parameter dtype as the recipe builds it (under
    ``training.set_default_dtype``)."""

    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype, max_seq_len: int):
        super().__init__()
        torchtune = import_torchtune()
        if spec.arch != "llama" or not spec.tied_embeddings or spec.qkv_bias or spec.num_experts or spec.head_dim:
            raise ValueError(f"{spec.name}: torchtune's llama3_2 builder is a llama with tied embeddings")
        with torchtune.training.set_default_dtype(dtype):
            self.decoder = torchtune.models.llama3_2.llama3_2(
                vocab_size=spec.vocab_size,
                num_layers=spec.num_layers,
                num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads,
                embed_dim=spec.hidden,
                max_seq_len=spec.max_positions or max_seq_len,  # the rotary cache's length
                intermediate_dim=spec.ffn_hidden,
            )

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    def forward(self, input_ids, labels=None, chunks: int = 0):
        self.decoder.set_num_output_chunks(chunks)
        return self.decoder(input_ids)


class LoopLM(nn.Module):
    """A transformers AutoModelForCausalLM (from a config) whose forward serves every loop."""

    def __init__(self, spec: ModelSpec, *, hf_type: str, attention: str, autocast_dtype=None, overrides=None):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSequenceClassification

        auto: Any = AutoModelForCausalLM
        if spec.arch == "bert":
            auto = AutoModelForSequenceClassification if spec.num_labels else AutoModelForMaskedLM
        self.hf = auto.from_config(_hf_config(spec, hf_type, attention=attention, overrides=overrides))
        self.num_labels = spec.num_labels
        """A sequence classifier takes one label per row: the first token id modulo the labels."""
        self.autocast_dtype = autocast_dtype
        """amp: the forward runs under autocast, as accelerate's prepared forward and the
        Trainer's compute_loss context run it; backward runs outside."""
        self.cce_impl = ""
        """cut-cross-entropy's implementation that replaces the head and loss (the cce-compile loop)."""

    @property
    def layers(self) -> nn.ModuleList:
        base = self.hf.base_model
        if hasattr(base, "encoder"):  # BertModel, RobertaModel
            return base.encoder.layer
        return base.h if hasattr(base, "h") else base.layers

    def forward(self, input_ids, labels=None, chunks: int = 0, use_cache: bool | None = None):
        if self.autocast_dtype is None:
            return self._forward(input_ids, labels, chunks, use_cache)
        with torch.autocast("cpu", dtype=self.autocast_dtype):
            return self._forward(input_ids, labels, chunks, use_cache)

    def _forward(self, input_ids, labels, chunks, use_cache=None):
        if chunks:  # torchtune TransformerDecoder.chunked_output: the output projection per chunk
            hidden = self.hf.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
            return [self.hf.lm_head(chunk) for chunk in hidden.chunk(chunks, dim=1)]
        if self.cce_impl:  # cut-cross-entropy's cce_forward: the hidden states and the head's weight
            from cut_cross_entropy import linear_cross_entropy
            from transformers.modeling_outputs import CausalLMOutputWithPast

            hidden = self.hf.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
            loss = linear_cross_entropy(hidden, self.hf.lm_head.weight, labels, shift=True, impl=self.cce_impl)
            # cce_forward's return type: a ModelOutput, whose tensors FSDP2's root pre-backward hook finds
            return CausalLMOutputWithPast(loss=loss)
        if labels is None:  # torchtitan's and torchtune's models keep no KV cache in training
            return self.hf(input_ids=input_ids, use_cache=False).logits
        if self.num_labels:
            labels = labels[:, 0] % self.num_labels
        if use_cache is not None:  # the held loops say it; the others leave the config's default
            return self.hf(input_ids=input_ids, labels=labels, use_cache=use_cache)
        return self.hf(input_ids=input_ids, labels=labels)


def apply_ac(model: LoopLM, ac: str, loop: Loop, every: int = 1) -> None:
    """Checkpoint every block: ``op`` torchtitan's SelectiveAC, ``full`` transformers' (torchtitan's FullAC there).
    ``every`` N > 1: torchtitan's layer SAC, its FullAC on every N-th block only."""
    if ac == "none":
        return
    if every > 1:
        if ac != "full":
            raise ValueError(f"ac-every {every} is measured with ac full (torchtitan's layer SAC), not {ac!r}")
        from torchtitan.distributed.activation_checkpoint import FullAC

        policy = FullAC.Config().build()
        for index, block in list(model.layers.named_children()):
            # torchtitan 0.2 parallelize_llama.py _apply_ac_to_transformer_block, layer SAC:
            # _count += 1; checkpoint when _count % ac_freq == 0 (0.3.0 dropped the option)
            if (int(index) + 1) % every == 0:
                model.layers.register_module(index, policy._wrap_block(block))
        return
    if ac == "op" or loop.name == "torchtitan":
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        policy = (SelectiveAC if ac == "op" else FullAC).Config().build()
        # SelectiveAC.apply wraps model.get_submodule("layers")'s children in place
        policy.apply(SimpleNamespace(get_submodule=lambda name: model.layers))
        return
    if ac not in memplan_loop.AC_POLICIES:
        raise ValueError(f"activation checkpointing {ac!r} is not one of: {', '.join(memplan_loop.AC_POLICIES)}")
    if ac != "full":  # selective (the attention core, memplan's fourth policy) is modelled, not applied here
        raise ValueError(f"activation checkpointing {ac!r} is modelled, not applied by this harness")
    # transformers 5's name for gradient_checkpointing_enable (the old name warns, same code)
    model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels as torchtune and torchtitan build them (last position ignored)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def make_step(
    loop: Loop,
    model: nn.Module,
    hf_model: nn.Module,
    micro_batch: int,
    *,
    compile_loss: bool = False,
    offload=None,
):
    """The loop's forward + backward of one micro-batch, as a function of the input ids;
    ``compile_loss``: the loss compiled as torchtune's compile_loss (training/_compile.py, its
    compute_cross_entropy) and torchtitan's build_loss_fn (torch.compile of the loss) do;
    ``offload``: the torchtune loop's activation offloading context (calibrate.offload's
    replica), around the model's forward only, as the recipes' ``_loss_step`` enters it."""
    if loop.name == "hf-trainer":
        import tempfile

        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="heldout-trainer-"),
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=micro_batch,
            save_strategy="no",
        )
        trainer = Trainer(model=hf_model, args=args)
        trainer.current_gradient_accumulation_steps = 1  # set per step by Trainer._inner_training_loop
        return lambda ids: trainer.training_step(model, {"input_ids": ids, "labels": ids})
    if loop.name == "plain-kept":

        def kept(ids):
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
            loss.backward()

        return kept
    if loop.logits == "held":
        held: dict = {}

        def held_step(ids):
            # the previous step's outputs are released only when this forward returns and the
            # name is rebound: they live through this forward, and these through the optimizer step
            held["outputs"] = model(input_ids=ids, labels=ids, use_cache=loop.use_cache)
            held["outputs"].loss.backward()

        return held_step
    if loop.name in ("plain-freed", "cce-compile"):
        return lambda ids: model(input_ids=ids, labels=ids).loss.backward()
    if loop.name == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)

        def accelerate_step(ids):
            outputs = model(input_ids=ids, labels=ids)
            loss = outputs.loss
            accelerator.backward(loss)

        return accelerate_step
    if loop.name == "torchtune":
        loss_fn = _torchtune_loss_class()(num_output_chunks=loop.loss_chunks)
        if compile_loss:
            loss_fn.compute_cross_entropy = torch.compile(loss_fn.compute_cross_entropy)

        def torchtune_step(ids):
            labels = _shifted(ids)
            with offload or contextlib.nullcontext():
                logits = model(input_ids=ids, chunks=loop.loss_chunks)
            loss = loss_fn(logits, labels)
            del logits
            loss.backward()

        return torchtune_step
    if loop.name == "torchtune-model":
        training = import_torchtune().training
        # ignore_index -100, the recipe's ignore_labels_cache; not chunked: compile_loss compiles it whole
        ce: nn.Module = nn.CrossEntropyLoss()
        ce = training.compile_loss(ce, verbose=False) if compile_loss else ce

        def torchtune_model_step(ids):
            # full_finetune_single_device.py FullFinetuneRecipeSingleDevice._loss_step
            labels = _shifted(ids)
            logits = model(ids)
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
            loss = ce(logits, labels)
            del logits
            loss.backward()

        return torchtune_model_step
    if loop.name == "torchtitan":
        from torchtitan.components.loss import cross_entropy_loss

        if compile_loss:
            cross_entropy_loss = torch.compile(cross_entropy_loss)  # components/loss.py _maybe_compile

        def torchtitan_step(ids):
            labels = _shifted(ids)
            pred = model(input_ids=ids)
            loss = cross_entropy_loss(pred, labels) / labels.numel()
            del pred
            loss.backward()

        return torchtitan_step
    raise ValueError(f"loop {loop.name!r} is not one of: {', '.join(LOOPS)}")


@contextlib.contextmanager
def _forward_ends_at_backward(meter, phase_peaks: dict):
    """Record the meter's peak as the forward phase's when ``Tensor.backward`` is called
    (the loops call it inside framework code, so the step cannot be split from outside)."""
    original = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        phase_peaks["forward"] = max(phase_peaks.get("forward", 0), meter.peak())
        return original(self, *args, **kwargs)

    # the allocator's forward peak (``_AllocatorPeak``): the range from the step's start to here
    forward = torch.profiler.record_function("memplan.forward")
    forward.__enter__()

    def backward_ends_forward(self, *args, **kwargs):
        if forward.record is not None:
            forward.__exit__(None, None, None)
            forward.record = None
        return backward(self, *args, **kwargs)

    # a patch of the class for the measured step only (torch's stubs call it a method)
    setattr(torch.Tensor, "backward", backward_ends_forward)  # noqa: B010
    try:
        yield
    finally:
        setattr(torch.Tensor, "backward", original)  # noqa: B010
        if forward.record is not None:
            forward.__exit__(None, None, None)


def apply_float8(model: LoopLM) -> None:
    """torchao's float8 training of the blocks' linear layers, filtered as torchtitan's float8
    converter filters them (components/quantization/utils.py module_filter_fn: in and out
    features divisible by 16, the output projection named in filter_fqns left alone)."""
    from torchao.float8 import convert_to_float8_training

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # a container: torchao descends into it
        return module.in_features % 16 == 0 and module.out_features % 16 == 0 and "lm_head" not in fqn

    convert_to_float8_training(model.hf, module_filter_fn=convert)


def apply_compile(model: LoopLM) -> None:
    """torch.compile of each block, as torchtitan's apply_compile (models/llama3/parallelize.py:
    every transformer block compiled in place, before FSDP) and torchtune's compile_model do."""
    for index, block in list(model.layers.named_children()):
        model.layers.register_module(index, torch.compile(block))  # type: ignore[arg-type]


def _torchtune_memory_module():
    """torchtune's training/memory.py (register_optim_in_bwd_hooks) loaded alone: the torchtune
    package does not import with torchao 0.18, so its one import of torchtune.utils is given the
    three helpers it names while the file loads."""
    import sys
    import types

    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("torchtune is not installed")
    path = Path(spec.submodule_search_locations[0], "training", "memory.py")
    utils = types.ModuleType("torchtune.utils")
    utils.get_device_support = lambda: "cpu"
    utils.get_logger = lambda *a: __import__("logging").getLogger("torchtune")
    utils.get_torch_device_namespace = lambda: torch.cpu
    saved = {name: sys.modules.get(name) for name in ("torchtune", "torchtune.utils")}
    sys.modules["torchtune"] = types.ModuleType("torchtune")
    sys.modules["torchtune.utils"] = utils
    try:
        module_spec = importlib.util.spec_from_file_location("_torchtune_training_memory", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def optimizer_in_backward(model: nn.Module, job: Job) -> None:
    """torchtune's optimizer in backward (full_finetune_distributed.py _setup_optimizer with
    optimizer_in_bwd): one optimizer per parameter, stepped and zeroed by
    register_optim_in_bwd_hooks (training/memory.py) as the parameter's gradient is accumulated."""
    memory = _torchtune_memory_module()
    optim_dict = {p: _optimizer(nn.ParameterList([p]), job) for p in model.parameters()}
    memory.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)


class _NoMeter:
    """No MemTracker: the compiled cases' meter is ``_AllocatorPeak``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def new_step(self) -> None:
        return None

    def reset_peak(self) -> None:
        return None

    def peak(self) -> int:
        return 0

    def categories(self) -> dict[str, int]:
        return {}


class _AllocatorPeak:
    """The CPU allocator's own count of live bytes (torch.profiler's memory events: c10's
    ProfiledCPUMemoryReporter reports every allocation and free made while profiling), which
    sees the buffers inductor's compiled code allocates and MemTracker does not. Started
    before the model is built, so it counts everything MemTracker counts."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self):
        self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        self.profile.__exit__(*exc)

    def peaks(self, phases: tuple[str, ...]) -> dict[str, int]:
        """The largest live total inside each ``record_function`` range named in ``phases``."""
        from torch._C._autograd import DeviceType

        events = sorted(self.profile.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        ranges = {e.name(): (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in phases}
        live, peaks = 0, dict.fromkeys(phases, 0)
        for event in events:
            if event.name() != "[memory]" or event.device_type() != DeviceType.CPU:
                continue
            live += event.nbytes()
            for name, (start, end) in ranges.items():
                if start <= event.start_ns() <= end:
                    peaks[name] = max(peaks[name], live)
        return peaks


def run(
    job: Job,
    loop: Loop,
    *,
    hf_type: str,
    ac: str,
    emulated: bool,
    steps: int = 2,
    warmup: int = 1,
    adapt=None,
    hf_overrides: dict | None = None,
    cpu_meter: str = "memtracker",
) -> Measurement:
    """Build the HF model, wrap it as the job's strategy, and train ``steps`` steps with the
    loop's step; measure the last (MemTracker's peak of live tensors, by phase; under
    ``compile`` the CPU allocator's, ``_AllocatorPeak``). ``adapt`` changes the model after AC
    and before wrapping (calibrate.finetune's peft adapters). The job's TrainSpec turns on
    float8, compile, optimizer in backward and ac-every, applied in torchtitan's order:
    float8, AC, compile, FSDP, and how the gradients are cleared after each step (``Loop.zero_grad``:
    none ``optimizer.zero_grad(set_to_none=True)``, zeros ``set_to_none=False``, so they stay
    allocated through the next forward). ``hf_overrides``: transformers config keys beyond the
    spec's shapes. ``cpu_meter``: the CPU meter (``measure.METERS``), MemTracker's or the storages a
    dispatch mode sees alone."""
    from torch.profiler import record_function

    if steps <= warmup:
        raise ValueError("steps must exceed warmup: the measured step needs optimizer states")
    torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    train = job.train
    policy = POLICIES[train.precision]
    # dynamo runs a compiled function eagerly while a TorchDispatchMode (MemTracker) is active,
    # so a compiled case is measured by the allocator alone (measured: with MemTracker on, the
    # compiled case's peak was the eager one's and dynamo's counters were empty)
    compiled = train.compile or loop.loss_impl == "cce-torch-compile"  # its loss is compiled code
    meter = _NoMeter() if compiled else METERS[cpu_meter]()
    allocator = _AllocatorPeak() if compiled else None
    ids = torch.randint(0, job.model.vocab_size, (train.micro_batch, train.seq_len))
    phase_peaks: dict[str, int] = {}
    times = []
    model: nn.Module
    with allocator or contextlib.nullcontext(), meter:
        if loop.name == "torchtune-model":
            if ac != "none" or train.float8 or policy.autocast or train.attention != "sdpa":
                raise ValueError("the torchtune-model loop runs without AC, float8 or autocast, with sdpa")
            model = TorchtuneLM(job.model, dtype=DTYPES[policy.param_dtype], max_seq_len=train.seq_len)
            if train.compile:  # training/_compile.py: every TransformerSelfAttentionLayer compiled in place
                import_torchtune().training.compile_model(model.decoder, verbose=False)
        else:
            hf = LoopLM(
                job.model,
                hf_type=hf_type,
                attention=train.attention,
                autocast_dtype=DTYPES[policy.compute_dtype] if policy.autocast else None,
                overrides=hf_overrides,
            )
            if train.float8:
                apply_float8(hf)
            apply_ac(hf, ac, loop, train.ac_every)
            if train.compile:
                apply_compile(hf)
            if loop.loss_impl == "cce-torch-compile":
                hf.cce_impl = "torch_compile"
            model = hf
        if adapt is not None:
            adapt(model)
        hf_model = getattr(model, "hf", model)  # the Trainer loop trains the transformers model
        wrapped = wrap(model, job.with_(recipe=loop.recipe), emulated)  # the recipe's FSDP units
        if train.optimizer_in_backward:
            optimizer_in_backward(wrapped, job)
            optimizer = None
        else:
            optimizer = _optimizer(wrapped, job)
        offload = None
        if train.offload_activations:
            if loop.name != "torchtune" or ac != "full":
                raise ValueError("offloading runs in the torchtune loop with ac full (its recipes require AC)")
            from .offload import offloading_context

            head: nn.Module = getattr(hf_model, "lm_head")  # noqa: B009  the recipe's NoOpManager is around it
            offload = offloading_context(head)
        step = make_step(loop, wrapped, hf_model, train.micro_batch, compile_loss=train.compile, offload=offload)
        for index in range(steps):
            measured = index == steps - 1
            if measured:
                meter.reset_peak()
            start = time.perf_counter()
            meter.new_step()
            marks = _forward_ends_at_backward(meter, phase_peaks) if measured else contextlib.nullcontext()
            with marks, record_function("memplan.forward_backward" if measured else "warmup"):
                step(ids)
            if measured:
                phase_peaks["backward"] = meter.peak()
            with record_function("memplan.optimizer" if measured else "warmup"):
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=train.zero_grad == "none")
            times.append(time.perf_counter() - start)
            if measured:
                phase_peaks["optimizer"] = meter.peak()
        peak = meter.peak()
        categories = meter.categories()
    if allocator is not None:
        found = allocator.peaks(("memplan.forward", "memplan.forward_backward", "memplan.optimizer"))
        phase_peaks = {
            "forward": found["memplan.forward"],
            "backward": found["memplan.forward_backward"],
            "optimizer": found["memplan.optimizer"],
        }
        peak = max(phase_peaks.values())
    phase = next(p for p in ("forward", "backward", "optimizer") if phase_peaks[p] == peak)
    return Measurement(
        peak_allocated_bytes=peak,
        phase=phase,
        categories=categories,
        step_time_s=times[-1],
        tokens_per_s=train.tokens_per_micro_batch / times[-1],
        device="cpu",
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        emulated=emulated,
        phase_peaks=phase_peaks,
    )
