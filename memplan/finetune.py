"""Fine-tuning: which parameters a step trains, and what that changes in memory.

``--finetune`` names the mode: ``full`` (every parameter, the default), ``lora`` (peft's LoRA
adapters on frozen base weights), ``qlora`` (LoRA on 4-bit NF4 base weights) or ``frozen:N``
(the input embedding and the first N blocks frozen, the rest trained in full).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from .breakdown import Component, Term, term
from .errors import InputError
from .mla import attention_tensors
from .moe import is_moe_layer
from .precision import Policy
from .saved import GRADIENT_TEMPORARIES, Saved
from .shapes import shapes
from .specs import ATTENTION, LINEARS, MODULES, Tuning

P, O = Component.PARAMS, Component.OPTIMIZER  # noqa: E741 - the paper's P/G/O notation, as quantities.py

# --- what is trained ---------------------------------------------------------------------


def nf4_bytes_per_param(double_quant: bool) -> float:
    """bitsandbytes' NF4 (Params4bit, blocksize 64): two 4-bit codes a byte and one absmax per
    block of 64; with double quantization (compress_statistics=True) the absmax quantized to 8 bits
    and one fp32 absmax of those per block of 256 (functional.quantize_4bit, QuantState.state2),
    without it the fp32 absmax itself (measured: validation/records/qlora_quant_cpu.md)."""
    return 0.5 + (1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64)


def _nf4_formula(double_quant: bool) -> str:
    return "(1/2 + 1/64 + 4/(64·256))·P_linear" if double_quant else "(1/2 + 4/64)·P_linear"


def _family(model) -> str:
    """The key of the block's linear layers in ``LINEARS``: Phi-3's fused llama block apart."""
    return "phi3" if model.fused_projections else model.arch


ADAPTED_BLOCKS = {"llama": ("lora", "qlora"), "gpt2": ("lora",)}
"""The block families whose adapters are measured with peft (validation/finetune_matrix.py;
validation/peft_matrix.py: Phi-3's fused projections, GPT-2's Conv1D) and the modes measured."""
DORA_BLOCKS = ("llama",)
"""The block families peft's DoRA is measured on (validation/peft_matrix.py DORA_CASES: llama,
qwen2 and Phi-3's fused blocks; not GPT-2's Conv1D)."""
_FAMILIES = {"llama": "llama-family (llama, qwen2, mistral, phi3)", "gpt2": "gpt2"}


def _linears(model) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one block, by ``LINEARS``' names."""
    h, q, kv, f = model.hidden, model.q_hidden, model.kv_hidden, model.ffn_hidden
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "qkv": (h, q + 2 * kv), "o": (q, h)}
    shapes |= {"gate": (h, f), "up": (h, f), "gate_up": (h, 2 * f), "down": (f, h)}
    return {name: shapes[name] for name in LINEARS[_family(model)]}


def targets_of(model, tuning: Tuning) -> tuple[str, ...]:
    """The block's linear layers that carry an adapter: peft matches a target_modules name
    against each module's name, so one name adapts a fused module once (Phi-3's qkv_proj) and
    GPT-2's c_proj both its attention output and its MLP's down projection."""
    family = _family(model)
    names = LINEARS[family]
    if tuning.targets == ("all-linear",):
        return names
    if tuning.targets == ("attention",):
        return tuple(n for n in names if n in ATTENTION)
    modules = MODULES.get(family, {})
    missing = [n for n in tuning.targets if not set(modules.get(n, (n,))) <= set(names)]
    if missing:
        raise InputError(
            f"lora targets {', '.join(missing)} are no linear layer of a {family} block (it has {', '.join(names)})",
            field="lora_targets",
            value=",".join(tuning.targets),
            accepted=", ".join(names),
        )
    return tuple(dict.fromkeys(n for target in tuning.targets for n in modules.get(target, (target,))))


@dataclass(frozen=True, kw_only=True)
class Trained:
    """The parameter counts of one job by what the step does with them."""

    total: int
    """Every parameter, adapters included."""
    trainable: int
    frozen: int
    quantized: int
    """Frozen base weights held in NF4 (qlora)."""
    root: int
    """Trainable parameters outside the blocks (embeddings, final norm, head)."""
    embedding: int
    """Trainable parameters of the input embedding whose gradient comes last (untied)."""
    blocks: tuple[int, ...]
    """Trainable parameters of each block."""
    tensors: tuple[tuple[int, ...], ...]
    """The shape of every trainable tensor (what per-tensor optimizers size their states by)."""
    adapters: bool
    head_trained: bool

    @property
    def largest(self) -> int:
        return max((math.prod(t) for t in self.tensors), default=0)


def _block_tensors(model) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    if model.mla:  # DeepseekV3Attention's tensors, then the MLP's gate, up, down (memplan.mla)
        f, h = model.ffn_hidden, model.hidden
        return attention_tensors(model) + [(f, h), (f, h), (h, f)] + 2 * [(h,)]
    for name, (n_in, n_out) in _linears(model).items():
        shapes.append((n_out, n_in))
        bias = model.linear_bias or (model.qkv_bias and name in ("q", "k", "v", "qkv"))
        shapes += [(n_out,)] if bias else []
        if name == "o" and model.qk_norm:  # Qwen3Attention registers q_norm, k_norm after o_proj
            shapes += [(model.head_size,), (model.head_size,)]
    norm = [(model.hidden,)] if model.arch == "llama" else [(model.hidden,), (model.hidden,)]
    return shapes + 2 * norm


def _block_params_at(model, index: int) -> int:
    """Block ``index``'s parameters: a sparse block's, or a dense one's where an MoE model has them."""
    return model.block_params() if is_moe_layer(model, index) else sum(model.block_param_counts().values())


def _root_tensors(model) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(input embedding, final norm + head) tensors of a decoder, or of a ViT (patch conv and
    its bias, class token, positions; the classifier and its bias)."""
    h = model.hidden
    head: list[tuple[int, ...]] = [(h,)] if model.arch == "llama" else [(h,), (h,)]
    if model.arch == "vit":
        patch = (h, model.image_channels, model.patch_size, model.patch_size)
        return [patch, (h,), (1, 1, h), (1, model.max_positions, h)], head + [
            (model.vocab_size, h),
            (model.vocab_size,),
        ]
    if model.arch == "bert":  # word, position, token type, LayerNorm; pooler + classifier | MLM transform
        L = model.num_labels
        mlm: list[tuple[int, ...]] = [(h, h), (h,), *head, (model.vocab_size,)]
        bert_head: list[tuple[int, ...]] = [(h, h), (h,), (L, h), (L,)] if L else mlm
        untied: list[tuple[int, ...]] = [] if L or model.tied_embeddings else [(model.vocab_size, h)]
        return [(model.vocab_size, h), (model.max_positions, h), (model.type_vocab_size, h), *head], bert_head + untied
    embedding: list[tuple[int, ...]] = [(model.vocab_size, h)]
    embedding += [(model.max_positions, h)] if model.max_positions else []
    return embedding, head + ([] if model.tied_embeddings else [(model.vocab_size, h)])


def _adapter_tensors(model, tuning: Tuning) -> list[tuple[int, ...]]:
    """lora_A (r × in) and lora_B (out × r) of each target linear (peft tuners/lora/layer.py
    update_layer) and, with DoRA, its magnitude, one per output feature, after them (tuners/lora/
    dora.py DoraLinearLayer.update_layer: ``nn.Parameter(weight_norm)``)."""
    if tuning.dora and model.arch not in DORA_BLOCKS:
        raise InputError(
            lambda n: (
                f"{n('dora')} is modelled for {_FAMILIES['llama']} blocks, not {model.arch}: what peft's "
                "DoRA saves there is not measured"
            ),
            field="dora",
            value=True,
            accepted="no dora for this model",
        )
    linears, r = _linears(model), tuning.rank
    magnitude = (lambda out: [(out,)]) if tuning.dora else (lambda out: [])
    return [
        shape
        for n in targets_of(model, tuning)
        for shape in [(r, linears[n][0]), (linears[n][1], r), *magnitude(linears[n][1])]
    ]


@lru_cache(maxsize=1024)
def trained(model, tuning: Tuning) -> Trained:
    """What a fine-tune of ``model`` trains: peft freezes every base parameter and adds its
    adapters (``_adapter_tensors``); frozen:N freezes the input embedding and the first N blocks."""
    L, P = model.num_layers, model.num_params
    block_tensors = _block_tensors(model)
    if tuning.mode == "full":
        blocks = tuple(_block_params_at(model, i) for i in range(L))
        return Trained(
            total=P,
            trainable=P,
            frozen=0,
            quantized=0,
            root=P - sum(blocks),
            embedding=model.embedding_params() - (model.vocab_size * model.hidden if model.tied_embeddings else 0),
            blocks=blocks,
            tensors=(),
            adapters=False,
            head_trained=True,
        )
    if tuning.mode == "frozen":
        n = tuning.frozen_blocks
        if n >= L:
            raise InputError(
                f"finetune frozen:{n} freezes every block of {model.name} ({L}); give N < {L}",
                field="finetune",
                value=f"frozen:{n}",
                accepted=f"frozen:N with 1 ≤ N < {L}",
            )
        _, head = _root_tensors(model)
        # the final norm and the head; a tied head is the frozen embedding (head_params has it not)
        root = model.head_params()
        tensors = tuple(head + block_tensors * (L - n))
        # an MoE model's blocks differ: its leading dense ones (first_dense_layers) are smaller
        blocks = tuple(0 if i < n else _block_params_at(model, i) for i in range(L))
        trainable = root + sum(blocks)
        return Trained(
            total=P,
            trainable=trainable,
            frozen=P - trainable,
            quantized=0,
            root=root,
            embedding=0,
            blocks=blocks,
            tensors=tensors,
            adapters=False,
            head_trained=not model.tied_embeddings,
        )
    if tuning.mode not in ADAPTED_BLOCKS.get(model.arch, ()):
        where = " and ".join(f"{_FAMILIES[a]} blocks" for a, modes in ADAPTED_BLOCKS.items() if tuning.mode in modes)
        raise InputError(
            f"{tuning.mode} is modelled for {where}, not {model.arch}: what peft's adapters save there is not measured",
            field="finetune",
            value=tuning.mode,
            accepted="full or frozen:N for this model",
        )
    adapter_tensors = _adapter_tensors(model, tuning)
    linears = _linears(model)
    per_block = sum(math.prod(s) for s in adapter_tensors)
    quantized = L * sum(i * o for i, o in linears.values()) if tuning.mode == "qlora" else 0
    return Trained(
        total=P + L * per_block,
        trainable=L * per_block,
        frozen=P,
        quantized=quantized,
        root=0,
        embedding=0,
        blocks=(per_block,) * L,
        tensors=tuple(adapter_tensors * L),
        adapters=True,
        head_trained=False,
    )


# --- what it changes in the step's memory (step.Step calls these) ----------------------


def adapter_policy(policy: Policy) -> Policy:
    """The dtypes of peft's adapters: fp32 parameters, gradients and optimizer states whatever
    the base model's dtype (get_peft_model's autocast_adapter_dtype=True upcasts bf16/fp16
    adapters), so no master copy."""
    return replace(policy, param_bytes=4, grad_bytes=4, state_bytes=4, master_bytes=0)


def _adapter_bytes(step) -> int:
    """Bytes of an adapter's weight where it runs: FSDP's MixedPrecisionPolicy gathers it in the
    compute dtype; elsewhere it stays fp32."""
    return step.gather_bytes if step.shard_master else 4


def finetune_param_terms(step) -> list[Term]:
    """Frozen base weights (NF4 for qlora's block linears) beside the trained parameters."""
    t, pol, sharded = step.trained, step.policy, step.strategy.shards_params
    double_quant = step.job.train.tuning.double_quant
    base = 4 if step.shard_master else pol.param_bytes
    trained_bytes = 4 if step.shard_master else step.train_policy.param_bytes
    div = step.div(sharded)
    plain = t.frozen - t.quantized
    terms = [
        term(P, "params.frozen", "frozen base parameters", f"{base}·P_frozen{div}", base * step.local(plain, sharded)),
        term(
            P,
            "params",
            "adapter parameters" if t.adapters else "trained parameters",
            f"{trained_bytes}·P_trained{div}",
            trained_bytes * step.local(t.trainable, sharded),
        ),
    ]
    if t.quantized:
        terms.insert(
            1,
            term(
                P,
                "params.nf4",
                "NF4 base weights" + (" (double quantization)" if double_quant else ""),
                _nf4_formula(double_quant),
                math.ceil(nf4_bytes_per_param(double_quant) * step.local(t.quantized, sharded)),
            ),
        )
    return terms


ADAM8BIT_MIN_SIZE = 4096
"""bitsandbytes' 8-bit optimizers keep fp32 states for a tensor of fewer elements
(Optimizer8bit min_8bit_size, optim/optimizer.py init_state)."""
PAGED_MIN_ELEMENTS = 100_000
"""bitsandbytes' paged optimizers page a state only of a tensor this large; a smaller one's is an
ordinary tensor (Optimizer8bit.get_state_buffer: ``p.numel() < 1e5``)."""
PER_TENSOR = ("adafactor", "torch-adafactor", "lion", "lion8bit", "adam8bit", "paged-adamw8bit")
"""The optimizers whose states memplan sizes tensor by tensor."""


def _blockwise_8bit(n: int) -> int:
    """One bitsandbytes 8-bit state of an n-element tensor: a uint8 code each and one fp32 absmax
    per 256-element block (Optimizer2State / Optimizer1State.init_state, blocksize 256); fp32
    below min_8bit_size."""
    return n + 4 * math.ceil(n / 256) if n >= ADAM8BIT_MIN_SIZE else 4 * n


def _factored(shape: tuple[int, ...]) -> int:
    """Elements of a row and a column factor of the last two dimensions (or the whole of a vector)."""
    n = math.prod(shape)
    return n // shape[-1] + n // shape[-2] if len(shape) >= 2 else n


def _state_bytes(optimizer: str, shape: tuple[int, ...], state_bytes: int) -> int:
    n = math.prod(shape)
    if optimizer == "adafactor":
        # transformers' Adafactor (beta1 None): a tensor of ≥ 2 dims keeps the row and column means
        # of grad² (exp_avg_sq_row, exp_avg_sq_col), a vector the full exp_avg_sq, all in fp32
        # (grad.float()); RMS a 0-d tensor
        return 4 * _factored(shape) + 4
    if optimizer == "torch-adafactor":
        # torch.optim.Adafactor._init_group: row_var (…, rows, 1) and col_var (…, 1, cols) in the
        # gradient's dtype (p.grad.new_zeros), a vector's variance; step a 0-d fp32 tensor
        return state_bytes * _factored(shape) + 4
    if optimizer == "lion":
        # bitsandbytes Lion (Optimizer1State, optim_bits 32): one fp32 state whatever the dtype
        return 4 * n
    if optimizer == "lion8bit":
        return _blockwise_8bit(n)
    # bitsandbytes AdamW8bit / PagedAdamW8bit: two 8-bit states
    return 2 * _blockwise_8bit(n)


def paged(optimizer: str, device: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor's states are paged: CUDA unified memory (cudaMallocManaged, F.get_paged),
    which torch's allocator does not count; on CPU bitsandbytes falls back to ordinary tensors."""
    return optimizer == "paged-adamw8bit" and device == "cuda" and math.prod(shape) >= PAGED_MIN_ELEMENTS


def _paged_bytes(optimizer: str, device: str, shape: tuple[int, ...]) -> int:
    """The part of a tensor's states in unified memory: its two uint8 states (get_state_buffer);
    their fp32 absmax blocks stay torch tensors on the device (bitsandbytes 0.50 optim/optimizer.py
    Optimizer2State.init_state: ``torch.zeros((blocks,), dtype=torch.float32, device=p.device)``)."""
    return 2 * math.prod(shape) if paged(optimizer, device, shape) else 0


STATE_NAMES = {
    "adafactor": ("Adafactor factored second moments (transformers)", "Σ 4·(rows + cols) per matrix"),
    "torch-adafactor": ("torch Adafactor row and column variances", "Σ s·(rows + cols) per matrix"),
    "lion": ("Lion momentum (bitsandbytes, fp32)", "4·P"),
    "lion8bit": ("Lion 8-bit momentum (bitsandbytes)", "Σ (1 + 4/256)·n per tensor"),
    "adam8bit": ("8-bit AdamW states", "Σ 8-bit states per tensor"),
    "paged-adamw8bit": (
        "paged 8-bit AdamW states counted by torch",
        "Σ 8-bit states per tensor < 1e5 + 2·4·⌈n/256⌉ absmax of the rest",
    ),
}


def trained_tensors(step) -> tuple[tuple[int, ...], ...]:
    """Every trained tensor in the order the optimizer steps them."""
    model = step.job.model
    if not step.trained.tensors and model.num_experts:
        optimizer = step.job.train.optimizer
        raise InputError(
            f"optimizer {optimizer} sizes its states per tensor, and an MoE model's expert tensors are not "
            "listed yet; give adamw, adam, sgd, sgd-momentum or adam8bit",
            field="optimizer",
            value=optimizer,
            accepted="adamw, adam, sgd, sgd-momentum or adam8bit",
        )
    return step.trained.tensors or full_tensors(model)


def optimizer_state_terms(step) -> list[Term]:
    """States sized per trained tensor (Adafactor, Lion, 8-bit AdamW)."""
    job = step.job
    optimizer, device = job.train.optimizer, job.train.device
    nbytes = sum(
        _state_bytes(optimizer, t, step.train_policy.state_bytes) - _paged_bytes(optimizer, device, t)
        for t in trained_tensors(step)
    )
    sharded = step.strategy.shards_optimizer
    name, formula = STATE_NAMES[optimizer]
    return [term(O, "optimizer.states", name, formula + step.div(sharded), step.local(nbytes, sharded))]


def adafactor_step_elements(step, *, foreach: bool) -> int:
    """Elements torch.optim.Adafactor's step holds beyond its states. foreach
    (_multi_tensor_adafactor): every tensor's var_estimate at once, the update written into it. A
    for-loop (_single_tensor_adafactor): a tensor's var_estimate (row_var @ col_var, then the
    update in place) and its row and column means, while the previous tensor's update is still
    bound to ``update`` (measured: the embedding's and the first q projection's)."""
    tensors = trained_tensors(step)
    if foreach:
        return sum(math.prod(t) for t in tensors)
    previous, worst = 0, 0
    for shape in tensors:
        n = math.prod(shape)
        worst = max(worst, previous + n + (_factored(shape) if len(shape) >= 2 else n))
        previous = n
    return worst


def full_tensors(model) -> tuple[tuple[int, ...], ...]:
    """Every tensor of a decoder (the trained ones of a full fine-tune), in module order: the
    input embedding, the blocks, the final norm and the head."""
    embedding, head = _root_tensors(model)
    return tuple(embedding + _block_tensors(model) * model.num_layers + head)


PLACES = {
    "": "trained",
    "frozen": "frozen: nothing saved",
    "first": "first trained block: its input needs no gradient",
}


def block_place(t: Trained, index: int) -> str:
    """Where block ``index`` sits in a fine-tune: frozen (frozen:N's first N), the first that
    trains behind a frozen input embedding, or like any other block ("")."""
    if t.blocks[index] == 0 and not t.adapters:
        return "frozen"
    if t.frozen and t.embedding == 0 and index == next(i for i, n in enumerate(t.blocks) if n):
        return "first"
    return ""


FIRST_NORM: tuple[str, ...] = ("norm 1: fp32 input", "norm 1: rstd", "block input (norm input)", "norm 1: mean, rstd")
FIRST_NORM += tuple(f"lora {name}: dropout mask" for name in ("q", "k", "v", "qkv"))
"""What the first trained block does not keep: its input norm's tensors and the dropout masks of
the adapters on that norm's output (x · mask keeps the mask only for x's gradient)."""


def kept_in_place(place: str, kept: list[Saved]) -> list[Saved]:
    """A block's kept tensors at its place: a frozen block keeps nothing; the first trained
    one's input norm keeps nothing, its input needing no gradient (autograd saves a tensor
    only for a gradient it computes: measured)."""
    if place == "frozen":
        return []
    if place == "first":
        return [s for s in kept if s.name not in FIRST_NORM]
    return kept


def transient_in_place(step, place: str, transient: list[Saved]) -> list[Saved]:
    """A frozen block runs no backward; a qlora block's backward dequantizes one linear's
    weight at a time (bitsandbytes MatMul4Bit.backward: dequantize_4bit(B) @ grad). Its largest
    instant is the MLP output projection's, the block's first backward op: the dequantized weight
    beside the one input gradient it makes; the two gradients of the gated product come after the
    weight is freed (measured, validation/qlora_probe.py: a one-block h1536 QLoRA step peaks in
    that mm at 49,314,840 B, memplan 49,289,776; with two gradients beside the weight 50,371,120,
    +2.1 %; and the wide cases of validation/records/qlora_quant_cpu.md)."""
    if place == "frozen":
        return []
    if step.trained.quantized:
        x = shapes(step.job.model, step.job.train)
        largest = max(i * o for i, o in _linears(step.job.model).values())
        dequantized = Saved("dequantized NF4 weight (one linear)", "c·largest linear", x.c * largest)
        one = Saved("MLP output projection's input gradient", "c·b·s·f", x.c * x.tokens * x.f)
        rest = [s for s in transient if s.name != GRADIENT_TEMPORARIES]
        temporaries = [s for s in transient if s.name == GRADIENT_TEMPORARIES]
        if not temporaries or dequantized.bytes + one.bytes >= temporaries[0].bytes:
            return [*rest, *(temporaries and [one]), dequantized]
        return transient
    return transient


def outside_saved(step, pre: list[Saved], post: list[Saved]) -> tuple[list[Saved], list[Saved]]:
    """What a frozen input embedding and a frozen head do not keep: the embedding's dropout
    mask, the final norm's normalised input to its weight and the head's input (autograd
    keeps a frozen weight's input only for the gradient of the other operand)."""
    t = step.trained
    if t.total == t.trainable:
        return pre, post
    pre = [s for s in pre if s.name != "embedding dropout mask"]
    if not t.head_trained:
        dropped = ("final norm: normalised", "final norm output (head input)", "head input cast")
        post = [s for s in post if s.name not in (*dropped, "autocast head weight copy")]
    return pre, post


_FROZEN_DROPPED = {
    "norm 1: normalised",
    "norm 2: normalised",
    "norm outputs (linear inputs)",
    "autocast input casts",
    "autocast weight copies",
    "SwiGLU gate, silu, up, product",
    "q_norm, k_norm: normalised",
    "MLP up output, GELU output",
}
"""What a block's frozen linears and norms no longer keep: a frozen weight's input (a linear's,
GPT-2's Conv1D addmm's, RMSNorm's weight product), its autocast copies, and the MLP activation's
output, the frozen down projection's input."""
_MLP_KEPT = {"llama": ("SwiGLU gate, silu, up", 3), "gpt2": ("MLP up output (gelu_new input)", 1)}
"""What the MLP's activation keeps of its ffn-wide tensors (c·b·s·f each): SwiGLU's gate, silu
and up; GPT-2's gelu_new its input (pow) beside the intermediates activations.py counts."""
_INPUT_WIDTH = {"q": "h", "k": "h", "v": "h", "qkv": "h", "o": "q", "gate": "h", "up": "h", "gate_up": "h", "down": "f"}
_SHARED_INPUT = dict.fromkeys(("q", "k", "v", "qkv"), "norm 1 output") | dict.fromkeys(
    ("gate", "up", "gate_up"), "norm 2 output"
)
"""The tensor an adapter's lora_A reads when no dropout or cast makes its own (the o projection's
input is the attention output sdpa keeps already); the down projection's by family."""
_DOWN_INPUT = {"llama": "SwiGLU product", "gpt2": "GELU output"}


def adapter_block_saved(model, train, full: list[Saved], *, adapter_bytes: int) -> list[Saved]:
    """What a block with frozen base weights and peft's LoRA keeps (peft lora/layer.py
    Linear.forward: ``result = base_layer(x); result + lora_B(lora_A(dropout(x))) * scaling``,
    x first cast to the adapter's dtype): the norms keep their input and statistics but not their
    normalised product with the frozen weight; a frozen linear (GPT-2's Conv1D too) keeps no
    input; per adapter, lora_A's input (the dropout output and mask, or x's cast, or x itself
    once per input) and lora_B's input, the b·s·r intermediate; a fused module (Phi-3's
    qkv_proj, GPT-2's c_attn) is one adapter (measured: validation/records/finetune_matrix_cpu.md,
    peft_matrix_cpu.md)."""
    x = shapes(model, train)
    t, a = x.tokens, adapter_bytes
    targets = targets_of(model, train.tuning)
    p = train.tuning.dropout
    saved = [s for s in full if s.name not in _FROZEN_DROPPED]
    mlp, count = _MLP_KEPT[model.arch]
    saved.append(Saved(mlp, f"{count}·c·b·s·f", count * x.c * t * x.f))
    width = {"h": x.h, "q": x.q, "f": x.f}
    shared = _SHARED_INPUT | {"down": _DOWN_INPUT[model.arch]}
    once: dict[str, Saved] = {}
    mask = a if train.device == "cpu" else 1
    for name in targets:
        w = _INPUT_WIDTH[name]
        n = width[w]
        if p > 0:
            saved.append(Saved(f"lora {name}: dropout output", f"{a}·b·s·{w}", a * t * n))
            saved.append(Saved(f"lora {name}: dropout mask", f"{mask}·b·s·{w}", mask * t * n))
        elif a != x.c:
            saved.append(Saved(f"lora {name}: input cast to the adapter dtype", f"{a}·b·s·{w}", a * t * n))
        elif name in shared:  # the o projection's input is the attention output sdpa keeps
            once[shared[name]] = Saved(f"lora input: {shared[name]}", f"c·b·s·{w}", x.c * t * n)
        saved.append(Saved(f"lora {name}: low-rank intermediate", f"{a}·b·s·r", a * t * train.tuning.rank))
        if train.tuning.dora:
            saved += dora_saved(model, train, name, adapter_bytes=a)
    return saved + list(once.values())


_OUTPUT_WIDTH = {"q": "q", "k": "kv", "v": "kv", "qkv": "(q+2kv)", "o": "h", "gate": "f", "up": "f"}
_OUTPUT_WIDTH |= {"gate_up": "2f", "down": "h"}


def dora_saved(model, train, name: str, *, adapter_bytes: int) -> list[Saved]:
    """What peft's DoRA keeps of adapted linear ``name`` beyond LoRA's (peft 0.21 tuners/lora/
    dora.py DoraLinearLayer.forward, variants.py DoraLinearVariant.forward): ``(m/‖W+sBA‖ − 1) ·
    base + m/‖W+sBA‖ · lora · s`` keeps both products' operands, the base output (the base layer's,
    in the compute dtype; with dropout ``F.linear`` of the dropout output, in the adapter dtype,
    which also keeps the weight it is given: the base weight cast to the adapter dtype where
    they differ), the LoRA output ``lora_B(lora_A(x))``, and three out-wide fp32 vectors (the
    detached weight norm the division keeps, the scale and the scale − 1)."""
    x, a = shapes(model, train), adapter_bytes
    t, p = x.tokens, train.tuning.dropout
    n_in, n_out = _linears(model)[name]
    w = _OUTPUT_WIDTH[name]
    base = a if p > 0 else x.c
    saved = [
        Saved(f"dora {name}: base output", f"{base}·b·s·{w}", base * t * n_out),
        Saved(f"dora {name}: LoRA output", f"{a}·b·s·{w}", a * t * n_out),
        Saved(f"dora {name}: weight norm, scale, scale − 1", f"3·4·{w}", 3 * 4 * n_out),
    ]
    if p > 0 and x.c != a:
        saved.append(Saved(f"dora {name}: base weight cast for F.linear", f"{a}·in·{w}", a * n_in * n_out))
    return saved


def _dora_forward_bytes(n_in: int, n_out: int, rank: int, *, a: int, cast: bool) -> int:
    """One DoRA forward's weight-sized temporaries at their largest, in the adapter dtype ``a``
    (dora.py): ``get_lora_weight`` builds ``lora_B(lora_A(eye(in)))``, whose graph keeps eye(in)
    and the in × r product beside the in × out weight until the forward returns;
    ``get_weight_norm`` then makes ``scaling · lora_weight`` and ``W + that`` (out × in each);
    ``cast``: the base weight cast to the adapter dtype (``weight.to(x.dtype)``), alive through
    the forward (with dropout it is kept, a ``dora_saved`` term)."""
    return a * (n_in * n_in + n_in * rank + (3 + cast) * n_in * n_out)


def dora_forward_saved(step) -> list[Saved]:
    """``DORA_FORWARD``'s transient (step.py): the adapted linear of the largest temporaries."""
    model, train = step.job.model, step.job.train
    a, c, rank = _adapter_bytes(step), shapes(model, train).c, train.tuning.rank
    cast = c != a and train.tuning.dropout == 0
    linears = _linears(model)
    name = max(targets_of(model, train.tuning), key=lambda n: _dora_forward_bytes(*linears[n], rank, a=a, cast=cast))
    w = _OUTPUT_WIDTH[name]
    formula = f"{a}·(in² + in·r + {3 + cast}·in·{w})"
    nbytes = _dora_forward_bytes(*linears[name], rank, a=a, cast=cast)
    return [Saved(f"dora {name}: eye(in), lora weight, weight norm temporaries", formula, nbytes)]


# --- what the reports say of it ----------------------------------------------------------

FINETUNE_FIELDS = (
    "finetune",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lora_dropout",
    "dora",
    "qlora_double_quant",
)
"""TrainSpec's fine-tuning fields: reported only for a fine-tune other than full (a full one's
report reads as before they existed; ``dora`` only where on, ``qlora_double_quant`` under qlora)."""


def finetune_inputs(job) -> dict:
    """The JSON inputs of a fine-tune: its fields and what it trains (a full one: only the counts,
    every parameter trainable)."""
    tuning = job.train.tuning
    t = trained(job.model, tuning)
    if tuning.mode == "full":
        return {"trainable_params": t.trainable, "frozen_params": t.frozen, "total_params": t.total}
    optional = {"dora": job.train.dora, "qlora_double_quant": tuning.mode == "qlora"}
    given = [k for k in FINETUNE_FIELDS if optional.get(k, True)]
    return {k: getattr(job.train, k) for k in given} | {
        "trainable_params": t.trainable,
        "frozen_params": t.frozen,
        "total_params": t.total,
    }


def finetune_line(job) -> str:
    """The header line of a fine-tune (none for full)."""
    tuning = job.train.tuning
    if tuning.mode == "full":
        return ""
    t = trained(job.model, tuning)
    nf4 = f" ({t.quantized / 1e6:,.1f}M of them in NF4)" if t.quantized else ""
    return f"finetune {tuning.describe()}: {t.trainable / 1e6:,.2f}M trainable, {t.frozen / 1e6:,.1f}M frozen{nf4}\n"


COMPARED = ("full", "lora", "qlora")
