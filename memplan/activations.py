"""Tensors autograd saves for backward, counted from the implementations themselves.

Every count below was read off torch's saved-tensor hooks on the Hugging Face-style
blocks of ``calibrate/workloads.py`` (modeling_llama.py / modeling_gpt2.py layouts) and on
transformers' ViTForImageClassification (modeling_vit.py);
``tests/test_activations.py`` re-reads them and compares byte for byte.

Symbols: b micro-batch, s sequence (a ViT's patches + 1), h hidden, q the query and attention
output width a·d (h unless the head dim is set apart), kv the k/v width (GQA), a heads, d head
dim, f ffn width, V vocabulary (a ViT's classes), C·H·W an image's pixels; c compute bytes,
r residual-stream bytes, m dropout-mask bytes (CUDA's fused dropout keeps a 1-byte mask, CPU's
composite dropout a mask in the input dtype).
"""

from __future__ import annotations

from .finetune import adapter_block_saved
from .loop import logits_upcast_in_model
from .mla import mla_matrices, mla_saved
from .moe import moe_backward_transient, moe_matrices, moe_saved, routed_rows
from .saved import GRADIENT_TEMPORARIES, Saved, Shapes
from .shapes import shapes
from .specs import ModelSpec, TrainSpec


def _norm(model: ModelSpec, x: Shapes, label: str) -> list[Saved]:
    t = x.tokens
    if model.arch == "llama":
        # LlamaRMSNorm: x.to(fp32) kept by pow/mul, rsqrt kept, normalised x.to(dtype) kept by weight*
        return [
            Saved(f"{label}: fp32 input", "4·b·s·h", 4 * t * x.h),
            Saved(f"{label}: normalised", "r·b·s·h", x.r * t * x.h),
            Saved(f"{label}: rstd", "4·b·s", 4 * t),
        ]
    # LayerNorm keeps its input plus mean and rstd per token (fp32 on CUDA; the input
    # dtype on CPU, measured)
    stat = x.r if x.m == x.c else 4
    return [Saved(f"{label}: mean, rstd", "2·4·b·s", 2 * stat * t)]


def _qk_norm(model: ModelSpec, x: Shapes) -> list[Saved]:
    """Qwen3's q_norm and k_norm (Qwen3RMSNorm over head_dim, modeling_qwen3.py), each as a
    llama norm over the projection's output: its fp32 input (the output itself in fp32, its
    fp32 cast otherwise), rstd per head and token, the normalised input in the compute dtype."""
    t, kv_heads = x.tokens, model.num_kv_heads
    return [
        Saved("q_norm, k_norm: fp32 inputs", "4·b·s·(q + kv)", 4 * t * (x.q + x.kv)),
        Saved("q_norm, k_norm: normalised", "c·b·s·(q + kv)", x.c * t * (x.q + x.kv)),
        Saved("q_norm, k_norm: rstd", "4·b·s·(a + a_kv)", 4 * t * (x.a + kv_heads)),
    ]


def _linear_inputs(model: ModelSpec, x: Shapes) -> list[Saved]:
    t = x.tokens
    if x.autocast:
        # autocast casts the fp32 input once per linear, and each cast is saved
        casts = {"llama": 5, "vit": 4}.get(model.arch, 2)  # q,k,v,gate,up | q,k,v,fc1 | fused qkv, up
        if model.mla:  # q_proj or q_a_proj, kv_a_proj_with_mqa, gate, up (the latents' casts: memplan.mla)
            casts = 4
        return [Saved("autocast input casts", f"{casts}·c·b·s·h", casts * x.c * t * x.h)]
    return [Saved("norm outputs (linear inputs)", "2·r·b·s·h", 2 * x.r * t * x.h)]


def _attention_core(model: ModelSpec, x: Shapes) -> list[Saved]:
    """What sdpa / eager attention keep beyond q, k, v and the output."""
    t, a, s = x.tokens, x.a, x.s
    if x.attention == "flash":
        return [Saved("sdpa logsumexp", "4·b·a·s", 4 * x.b * a * s)]
    c, m = (4, 4) if x.attention == "math-fp32" else (x.c, x.m)
    out = [Saved("softmax output (fp32)", "4·b·a·s²", 4 * t * a * s)]
    if c < 4 or x.p > 0:  # the probs cast back to the compute dtype, or the dropped probs
        out.append(Saved("attention probs (compute dtype)", "c·b·a·s²", c * t * a * s))
    if x.p > 0:
        out.append(Saved("attention dropout mask", "m·b·a·s²", m * t * a * s))
    return out


def _qkv_out(model: ModelSpec, x: Shapes) -> list[Saved]:
    t = x.tokens
    # repeat_kv (eager) or the model's own copies (torchtune) materialise k, v per query head
    kv = x.kv_saved
    c = 4 if x.attention == "math-fp32" else x.c
    formula = "c·b·s·(q + 2·q): k, v per query head" if kv != x.kv else "c·b·s·(q + 2·kv)"
    saved = [
        Saved("q, k, v", formula, c * t * (x.q + 2 * kv)),
        Saved("attention output", "c·b·s·q", x.c * t * x.q),
    ]
    if model.arch == "neox" and x.attention == "flash":
        # rotary makes new q, k while sdpa keeps v: a view that pins the whole fused qkv output
        saved.append(Saved("fused qkv output pinned by v", "c·b·s·(q + kv)", x.c * t * (x.q + x.kv)))
    return saved


def block_saved(model: ModelSpec, train: TrainSpec, *, inputs_cast: bool = False) -> list[Saved]:
    """Bytes one transformer block keeps from its forward for its backward (no AC).

    ``inputs_cast``: the block's floating-point inputs arrive already in the compute dtype
    (FSDP2's MixedPrecisionPolicy casts a unit's forward inputs, cast_forward_inputs=True)."""
    x = shapes(model, train)
    t = x.tokens
    if model.arch == "bert":
        return _bert_block_saved(model, x)
    saved: list[Saved] = []
    if model.arch != "llama":
        saved.append(Saved("block input (norm input)", "r·b·s·h", x.r * t * x.h))
        if model.arch in ("gpt2", "vit"):  # sequential residual: the second norm has its own input
            saved.append(Saved("residual after attention (norm input)", "r·b·s·h", x.r * t * x.h))
    saved += _norm(model, x, "norm 1") + _norm(model, x, "norm 2")
    saved += _linear_inputs(model, x)
    if model.mla:  # DeepSeek's latent attention in place of q/k/v/o (memplan.mla)
        saved += mla_saved(model, x)
    elif inputs_cast and _rotary_cast(model, x):
        saved += _rotary_cast(model, x)
    elif model.arch in ("llama", "neox") and x.c < 4:
        # cos/sin cast to the compute dtype for q and for k: 4 tables of s×d
        saved.append(Saved("rotary cos/sin casts", "4·c·s·d", 4 * x.c * x.s * x.d))
    if not model.mla:
        saved += _qkv_out(model, x) + _attention_core(model, x)
    if model.qk_norm:
        saved += _qk_norm(model, x)
    if model.num_experts:  # every block as a sparse one (memplan.moe)
        saved += moe_saved(model, x, routed_rows(t, model, 1))
    elif model.gated_mlp:
        saved.append(Saved("SwiGLU gate, silu, up, product", "4·c·b·s·f", 4 * x.c * t * x.f))
    else:
        saved.append(Saved("MLP up output, GELU output", "2·c·b·s·f", 2 * x.c * t * x.f))
    if model.activation == "gelu_new":
        # 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))): tanh output, 0.5·x and 1 + tanh are kept
        saved.append(Saved("gelu_new intermediates", "3·c·b·s·f", 3 * x.c * t * x.f))
    if x.p > 0:
        saved.append(Saved("residual dropout masks", "2·m·b·s·h", 2 * x.m * t * x.h))
    if x.autocast:
        # autocast caches one low-precision copy of every linear weight (not bias) per forward
        # q_proj h×q, k/v_proj h×kv each, o_proj q×h
        attention = mla_matrices(model) if model.mla else x.h * (2 * x.q + 2 * x.kv)
        weights = attention + (3 if model.gated_mlp else 2) * x.h * x.f
        if model.num_experts:  # the router, every expert hit, the shared expert and its gate
            weights = attention + moe_matrices(model)
        saved.append(Saved("autocast weight copies", "c·(block weight matrices)", x.c * weights))
    if train.tuning.adapters:
        # FSDP's MixedPrecisionPolicy (the inputs_cast case) gathers the adapters in the compute dtype
        return adapter_block_saved(model, train, saved, adapter_bytes=x.c if inputs_cast else 4)
    return saved


def _attention_internals(model: ModelSpec, train: TrainSpec) -> list[Saved]:
    return _attention_core(model, shapes(model, train))


def _rotary_cast(model: ModelSpec, x: Shapes) -> list[Saved]:
    """A block's rotary cos/sin as FSDP2's MixedPrecisionPolicy (cast_forward_inputs) casts its
    floating-point forward inputs to the compute dtype on entry: a copy per block, which q and
    k share (measured: 2·c·s·d per block)."""
    if model.arch not in ("llama", "neox") or model.mla or x.c == 4:
        return []
    return [Saved("rotary cos/sin (cast by FSDP)", "2·c·s·d", 2 * x.c * x.s * x.d)]


def checkpoint_inputs(model: ModelSpec, train: TrainSpec, *, inputs_cast: bool = False) -> list[Saved]:
    """What a checkpointed block keeps as its checkpoint's inputs (torch.utils.checkpoint
    holds the arguments for the recompute): the block input, and under FSDP's input cast the
    block's own cos/sin copies (traced at full size: 8B FSDP 8 full AC, per block 2·c·s·d, and
    no fp32 tables left, which the blocks no longer reference)."""
    x = shapes(model, train)
    block_input = Saved("checkpointed block input", "r·b·s·h", x.r * x.tokens * x.h)
    return [block_input, *(_rotary_cast(model, x) if inputs_cast else [])]


def block_kept(model: ModelSpec, train: TrainSpec, *, inputs_cast: bool = False) -> list[Saved]:
    """What each block holds from its forward until its backward, under the AC mode."""
    x = shapes(model, train)
    mode = train.activation_checkpointing
    if mode == "full":
        # checkpoint keeps only the block's inputs; everything else is recomputed in backward
        return checkpoint_inputs(model, train, inputs_cast=inputs_cast)
    saved = block_saved(model, train, inputs_cast=inputs_cast)
    if mode == "selective":
        # the checkpointed core keeps only its inputs: q, k, v before repeat_kv (kv wide)
        core = {s.name for s in _attention_core(model, x)} | {"q, k, v"}
        saved = [s for s in saved if s.name not in core]
        saved.append(Saved("q, k, v (checkpoint inputs)", "c·b·s·(q + 2·kv)", x.c * x.tokens * (x.q + 2 * x.kv)))
    return saved


def block_backward_transient(model: ModelSpec, train: TrainSpec, *, inputs_cast: bool = False) -> list[Saved]:
    """Extra bytes live while one block runs its backward: recomputed activations under
    AC, plus gradient temporaries (measured: the SwiGLU/GELU backward holds two
    gradients of ffn width beyond the saved tensors; one under autocast, and one in ViT's
    MLP, whose exact GELU has a fused backward)."""
    x = shapes(model, train)
    k = 1 if x.autocast or model.arch in ("vit", "bert") else 2
    out = [Saved(GRADIENT_TEMPORARIES, f"{k}·c·b·s·f", k * x.c * x.tokens * x.f)]
    if model.num_experts:
        out = moe_backward_transient(model, x)
    if model.arch == "vit":
        out += _vit_live_in_backward(model, x)
    if model.arch == "bert" and train.activation_checkpointing != "full":
        # post-LayerNorm residuals: the gradient into the block, LayerNorm 2's input gradient
        # (sent down the MLP and the residual) and LayerNorm 1's, beside the ffn-wide one
        # (measured: MemTracker's Temp at the single-GPU fp32 peaks is c·b·s·f + 3·r·b·s·h; under
        # full AC the recompute's peak holds none of them beyond its saved list: not added there)
        out.append(Saved("residual-stream gradients (post-LayerNorm)", "3·r·b·s·h", 3 * x.r * x.tokens * x.h))
    mode = train.activation_checkpointing
    if mode == "full":
        # the recompute saves the checkpointed input itself (no copy) where a norm keeps it as is
        shared = "norm 1: fp32 input" if x.r == 4 else None
        if model.arch != "llama":
            shared = "block input (q, k, v input)" if model.arch == "bert" else "block input (norm input)"
        out += [s for s in block_saved(model, train, inputs_cast=inputs_cast) if s.name != shared]
    elif mode == "selective":
        out += _attention_core(model, x)
    return out


def model_saved(model: ModelSpec, train: TrainSpec, *, inputs_cast: bool = False) -> tuple[list[Saved], list[Saved]]:
    """Saved outside the blocks: before them (embeddings) and after (final norm, head input, logits).
    ``inputs_cast`` as in ``block_saved``: the blocks hold their own casts of the rotary tables."""
    x = shapes(model, train)
    if model.arch == "vit":
        return _vit_embedding_saved(model, x), _vit_head_saved(model, x)
    if model.arch == "bert":
        return _bert_embedding_saved(model, x), _bert_head_saved(model, x)
    t = x.tokens
    pre = []
    full_uncast = train.activation_checkpointing == "full" and not (inputs_cast and _rotary_cast(model, x))
    if model.arch in ("llama", "neox") and (x.c == 4 or full_uncast):
        # the fp32 rotary cos/sin tables, made once per forward: saved by every block's q·cos,
        # k·sin in fp32, and as checkpoint inputs under full AC (measured: 2·4·s·d, once)
        pre.append(Saved("rotary cos/sin (shared by the blocks)", "2·4·s·d", 8 * x.s * x.d))
    if x.p > 0:
        pre.append(Saved("embedding dropout mask", "m·b·s·h", x.m * t * x.h))
    post = []
    if model.arch == "llama":
        post += _norm(model, x, "final norm")
    else:
        post += [Saved("final norm input", "r·b·s·h", x.r * t * x.h), *_norm(model, x, "final norm")]
    if x.autocast:
        post.append(Saved("head input cast", "c·b·s·h", x.c * t * x.h))
        post.append(Saved("autocast head weight copy", "c·V·h", x.c * x.V * x.h))
    else:
        post.append(Saved("final norm output (head input)", "r·b·s·h", x.r * t * x.h))
    if fp32_logits(model, train, x):
        # the model's output.float(): its compute-dtype logits are freed once cast (nothing saves them)
        post.append(Saved("logits in fp32 (the model upcasts them)", "4·b·s·V", 4 * t * x.V, "logits"))
    else:
        post.append(Saved("logits (held by the caller)", f"{x.c}·b·s·V", x.c * t * x.V, "logits"))
    return pre, post


def fp32_logits(model: ModelSpec, train: TrainSpec, x: Shapes) -> bool:
    """Whether a decoder's model returns its logits in fp32 where they are computed in a lower
    precision: the standard cross-entropy under a recipe whose model upcasts them
    (recipes.csv logits_upcast model: torchtune's TransformerDecoder)."""
    decoder = model.arch not in ("vit", "bert")
    return decoder and x.c < 4 and train.loop.loss == "ce" and logits_upcast_in_model(train.recipe)


def loss_saved(model: ModelSpec, train: TrainSpec) -> tuple[list[Saved], list[Saved]]:
    """Cross-entropy on fp32 logits: what is live while the loss runs forward, and while
    its backward starts (ForCausalLMLoss upcasts logits; log_softmax keeps its output)."""
    x = shapes(model, train)
    if model.arch == "vit":
        return _vit_loss_saved(x)
    if model.arch == "bert":
        return _bert_loss_saved(model, x)
    t, V = x.tokens, x.V
    lsm = Saved("log_softmax output (fp32)", "4·b·s·V", 4 * t * V, "loss.log_softmax")
    forward = [lsm]
    if x.c < 4 and not fp32_logits(model, train, x):  # logits the model upcast are the fp32 copy
        forward.append(Saved("fp32 copy of logits", "4·b·s·V", 4 * t * V, "loss.logits_fp32"))
    # nll_loss backward makes a b·s·V gradient, log_softmax backward another
    backward = [lsm, Saved("loss gradients (nll, log_softmax)", "2·4·b·s·V", 8 * t * V, "loss.gradients")]
    return forward, backward


def _vit_embedding_saved(model: ModelSpec, x: Shapes) -> list[Saved]:
    """ViTEmbeddings: the patch Conv2d keeps its input, the fp32 pixel batch itself (the data
    loader's, not counted, as a decoder's token ids are not) or its copy in the compute dtype
    (made by autocast, by the bf16 model's pixel_values.to(dtype), or by FSDP's cast of the
    root's inputs); the class token and positions add nothing saved."""
    pixels = x.b * model.image_channels * model.patch_size**2 * (x.s - 1)
    pre = []
    if x.c < 4:
        pre.append(Saved("pixel values cast (patch conv input)", "c·b·C·H·W", x.c * pixels))
    if x.autocast:
        conv = x.h * model.image_channels * model.patch_size**2
        pre.append(Saved("autocast patch conv weight copy", "c·h·C·p²", x.c * conv))
    if x.p > 0:
        # the embeddings are in the stream dtype (the class token and positions promote the
        # conv's output), so CPU's mask takes r bytes where CUDA's fused dropout keeps 1 (measured)
        mask = x.r if x.m == x.c else 1
        pre.append(Saved("embedding dropout mask", f"{mask}·b·s·h", mask * x.tokens * x.h))
    return pre


def _vit_live_in_backward(model: ModelSpec, x: Shapes) -> list[Saved]:
    """Live while a ViT block runs its backward, on top of the one ffn-wide temporary
    (measured: MemTracker's Temp at the DDP peak is c·b·s·f + r·b·s·h + the fc2 weight
    gradient, which is left to the gradient terms): the gradient flowing into the block, and
    what the embeddings saved, which the patch conv's backward frees only at the very end
    (the block moments of step.py keep, of what is saved outside the blocks, only the logits)."""
    return [Saved("gradient into the block", "r·b·s·h", x.r * x.tokens * x.h), *_vit_embedding_saved(model, x)]


def _vit_head_saved(model: ModelSpec, x: Shapes) -> list[Saved]:
    """The final LayerNorm runs over every token; the classifier reads the class token only,
    a slice that pins the whole norm output, or under autocast a cast copy of that row."""
    t = x.tokens
    post = [Saved("final norm input", "r·b·s·h", x.r * t * x.h), *_norm(model, x, "final norm")]
    if x.autocast:
        post.append(Saved("class token cast (classifier input)", "c·b·h", x.c * x.b * x.h))
        post.append(Saved("autocast classifier weight copy", "c·V·h", x.c * x.V * x.h))
    else:
        post.append(Saved("final norm output (pinned by the class-token slice)", "r·b·s·h", x.r * t * x.h))
    post.append(Saved("logits (held by the caller)", "c·b·V", x.c * x.b * x.V, "logits"))
    return post


def _vit_loss_saved(x: Shapes) -> tuple[list[Saved], list[Saved]]:
    """ForImageClassification's cross-entropy over b rows, on the logits as they are
    (fp32 under autocast, which runs log_softmax in fp32)."""
    k = 4 if x.autocast else x.c
    lsm = Saved("log_softmax output", f"{k}·b·V", k * x.b * x.V)
    return [lsm], [lsm, Saved("loss gradients (nll, log_softmax)", f"2·{k}·b·V", 2 * k * x.b * x.V)]


def head_outputs(model: ModelSpec, x: Shapes) -> tuple[int, int, str]:
    """The logits' rows and columns, with their formula: b·s·V for a decoder and an MLM head,
    b·N for a sequence classifier (a ViT's b·V is its own)."""
    if model.arch == "bert" and model.num_labels:
        return x.b, model.num_labels, "b·N"
    return x.tokens, x.V, "b·s·V"


def _bert_block_saved(model: ModelSpec, x: Shapes) -> list[Saved]:
    """BertLayer (modeling_bert.py; RobertaLayer is the same): q, k, v apart, sdpa without a
    mask, then post-LayerNorm residuals, LayerNorm(dropout(dense(attn)) + input) and
    LayerNorm(dropout(dense(gelu(dense(.)))) + that). Each LayerNorm keeps its input, the
    residual sum; the block input is kept by q, k, v (three casts of it under autocast, which
    casts the intermediate dense's input too) and the first LayerNorm's output by the
    intermediate dense (measured with saved-tensor hooks: tests/test_encoders.py)."""
    t = x.tokens
    if x.autocast:
        inputs = [Saved("autocast input casts", "4·c·b·s·h", 4 * x.c * t * x.h)]  # q, k, v, intermediate
    else:
        inputs = [
            Saved("block input (q, k, v input)", "r·b·s·h", x.r * t * x.h),
            Saved("LayerNorm 1 output (intermediate input)", "r·b·s·h", x.r * t * x.h),
        ]
    saved = inputs + [
        Saved("LayerNorm 1 input (attention output + residual)", "r·b·s·h", x.r * t * x.h),
        *_norm(model, x, "norm 1"),
        Saved("LayerNorm 2 input (MLP output + residual)", "r·b·s·h", x.r * t * x.h),
        *_norm(model, x, "norm 2"),
    ]
    saved += _qkv_out(model, x)
    if x.attention == "eager" and not (x.autocast and x.m != x.c):
        # eager_attention_forward: softmax in the compute dtype (no fp32 upcast, none under CPU
        # autocast either), then dropout's mask and the dropped probabilities; CUDA autocast runs
        # softmax in fp32 (its fp32 op list), which the decoders' eager core describes
        saved.append(Saved("softmax output", "c·b·a·s²", x.c * t * x.a * x.s))
        if x.p > 0:
            saved.append(Saved("attention dropout mask, dropped probs", "(m + c)·b·a·s²", (x.m + x.c) * t * x.a * x.s))
    else:
        saved += _attention_core(model, x)
    saved.append(Saved("MLP up output, GELU output", "2·c·b·s·f", 2 * x.c * t * x.f))
    if x.p > 0:
        saved.append(Saved("residual dropout masks", "2·m·b·s·h", 2 * x.m * t * x.h))
    if x.autocast:
        # autocast caches one low-precision copy of every linear weight per forward
        weights = 4 * x.h * x.h + 2 * x.h * x.f
        saved.append(Saved("autocast weight copies", "c·(4·h² + 2·h·f)", x.c * weights))
    return saved


def _bert_embedding_saved(model: ModelSpec, x: Shapes) -> list[Saved]:
    """BertEmbeddings: word + token type + position, LayerNorm, dropout. The token type ids
    are gathered from a buffer (a new int64 tensor the embedding keeps); the LayerNorm keeps
    its input, the sum, in the stream dtype."""
    t = x.tokens
    pre = [
        # gathered from the (1, max_positions) buffer, then expanded over the batch: one row
        Saved("token type ids (gathered, int64)", "8·s", 8 * x.s),
        Saved("embedding LayerNorm input", "r·b·s·h", x.r * t * x.h),
        *_norm(model, x, "embedding LayerNorm"),
    ]
    if x.p > 0:
        mask = x.r if x.m == x.c else 1  # CPU's mask in the stream dtype, CUDA's fused one 1 byte
        pre.append(Saved("embedding dropout mask", f"{mask}·b·s·h", mask * t * x.h))
    return pre


def _bert_head_saved(model: ModelSpec, x: Shapes) -> list[Saved]:
    """The MLM head (BertLMPredictionHead: dense, GELU, LayerNorm, decoder over the
    vocabulary at every position) or the classifier (BertPooler: dense + tanh on the first
    token, a slice that pins the whole last block output; dropout; classifier)."""
    t, h = x.tokens, x.h
    rows, cols, formula = head_outputs(model, x)
    if model.num_labels:
        post = [
            Saved("pooler input cast", "c·b·h", x.c * x.b * h)
            if x.autocast
            else Saved("last block output (pinned by the first-token slice)", "r·b·s·h", x.r * t * h),
            Saved("pooler tanh output", "c·b·h", x.c * x.b * h),
        ]
        if x.p > 0:
            post.append(Saved("classifier dropout mask and output", "(m + c)·b·h", (x.m + x.c) * x.b * h))
        weights = h * h + h * model.num_labels
    else:
        head_input = ("head input cast", "c", x.c) if x.autocast else ("last block output (head input)", "r", x.r)
        decoder_input = ("decoder input cast", "c", x.c) if x.autocast else ("head LayerNorm output", "r", x.r)
        post = [
            Saved(head_input[0], f"{head_input[1]}·b·s·h", head_input[2] * t * h),
            Saved("head dense output, GELU output", "2·c·b·s·h", 2 * x.c * t * h),
            *_norm(model, x, "head LayerNorm"),
            Saved(decoder_input[0], f"{decoder_input[1]}·b·s·h", decoder_input[2] * t * h),
        ]
        weights = h * h + model.vocab_size * h
    if x.autocast:
        post.append(Saved("autocast head weight copies", "c·(head weights)", x.c * weights))
    post.append(Saved("logits (held by the caller)", f"{x.c}·{formula}", x.c * rows * cols, "logits"))
    return post


def _bert_loss_saved(model: ModelSpec, x: Shapes) -> tuple[list[Saved], list[Saved]]:
    """CrossEntropyLoss on the logits as they are (BertForMaskedLM and ForSequenceClassification
    do not upcast): autocast runs it in fp32 on an fp32 copy, a bf16 model in bf16."""
    rows, cols, formula = head_outputs(model, x)
    k = 4 if x.autocast else x.c
    lsm = Saved("log_softmax output", f"{k}·{formula}", k * rows * cols, "loss.log_softmax")
    forward = [lsm]
    if x.autocast and x.c < 4:
        forward.append(Saved("fp32 copy of logits", f"4·{formula}", 4 * rows * cols, "loss.logits_fp32"))
    gradients = Saved("loss gradients (nll, log_softmax)", f"2·{k}·{formula}", 2 * k * rows * cols, "loss.gradients")
    return forward, [lsm, gradients]
