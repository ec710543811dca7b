"""Real torch models built from memplan's ModelSpec, written like the Hugging Face
reference implementations (modeling_llama.py, modeling_gpt2.py) so that their saved
tensors are the ones memplan's activation model counts."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memplan.specs import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):  # LlamaRMSNorm: normalise in fp32, scale in the input dtype
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(seq_len: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, *, attention: str, selective_ac: bool):
        super().__init__()
        self.spec = spec
        h, q, kv = spec.hidden, spec.q_hidden, spec.kv_hidden
        qkv_bias = spec.linear_bias or spec.qkv_bias
        self.fused_qkv = spec.arch != "llama"  # HF gpt2 c_attn, gpt_neox query_key_value
        if self.fused_qkv:
            self.qkv_proj = nn.Linear(h, q + 2 * kv, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(h, q, bias=qkv_bias)
            self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
            self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=spec.linear_bias)
        self.attention = attention
        self.selective_ac = selective_ac
        self.resid_dropout = nn.Dropout(spec.dropout)

    def core(self, q, k, v):
        p = self.spec.dropout if self.training else 0.0
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
            )
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # repeat_kv of modeling_llama.py
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
        s = q.shape[2]
        mask = torch.full((s, s), float("-inf"), device=q.device).triu(1)
        probs = F.softmax(scores + mask.to(scores.dtype), dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=p, training=self.training)
        return torch.matmul(probs, v)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d = self.spec.head_size
        if self.fused_qkv:
            q, k, v = self.qkv_proj(x).split([self.spec.q_hidden, self.spec.kv_hidden, self.spec.kv_hidden], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = checkpoint(self.core, q, k, v, use_reentrant=False) if self.selective_ac else self.core(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.resid_dropout(self.o_proj(out))


def gelu_new(x):
    """NewGELUActivation of transformers (GPT-2's gelu_new), written out as there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.act = gelu_new if spec.activation == "gelu_new" else (lambda x: F.gelu(x))
        h, f, bias = spec.hidden, spec.ffn_hidden, spec.linear_bias
        self.gated = spec.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x):
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.dropout(self.down_proj(self.act(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, *, attention: str, selective_ac: bool):
        super().__init__()
        norm = (lambda: RMSNorm(spec.hidden)) if spec.arch == "llama" else (lambda: nn.LayerNorm(spec.hidden))
        self.input_norm = norm()
        self.attn = Attention(spec, attention=attention, selective_ac=selective_ac)
        self.post_attention_norm = norm()
        self.mlp = MLP(spec)
        self.parallel = spec.arch == "neox"

    def forward(self, x, cos=None, sin=None):
        if self.parallel:  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
            return x + self.attn(self.input_norm(x), cos, sin) + self.mlp(self.post_attention_norm(x))
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attention_norm(x))


class CausalLM(nn.Module):
    """Decoder-only LM; forward returns (loss, logits) like a HF CausalLMOutput."""

    def __init__(self, spec: ModelSpec, *, attention: str = "sdpa", ac: str = "none"):
        super().__init__()
        if spec.arch == "vit":
            raise ValueError("a vit is not a causal LM: build_model(spec, workload='hf') builds it as HFViT")
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden)
        self.embed_positions = nn.Embedding(spec.max_positions, spec.hidden) if spec.max_positions else None
        self.dropout = nn.Dropout(spec.dropout)
        self.layers = nn.ModuleList(
            Block(spec, attention=attention, selective_ac=ac == "selective") for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden) if spec.arch == "llama" else nn.LayerNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = spec.arch in ("llama", "neox")

    # the names transformers' PreTrainedModel gives its embeddings and trunk, so that the
    # recipes' wrapping (wrappers._shard_embedding_and_head: torchtitan's embedding and
    # [norm, head] FSDP units) reads this model as it reads a transformers one
    base_model_prefix = "trunk"

    @property
    def trunk(self) -> nn.Module:
        return self

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids, labels, chunks: int = 0):
        """(loss, logits); with ``chunks``: (None, the logits as that many chunks along the
        sequence), the LM head applied per chunk as torchtune's TransformerDecoder.chunked_output."""
        _b, s = input_ids.shape
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = x + self.embed_positions(torch.arange(s, device=input_ids.device))
        x = self.dropout(x)
        cos, sin = rotary_tables(s, self.spec.head_size, x.device) if self.rotary else (None, None)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if chunks:
            return None, [self.lm_head(chunk) for chunk in self.norm(x).chunk(chunks, dim=1)]
        logits = self.lm_head(self.norm(x))
        if labels is None:  # the loop computes the loss (torchtitan)
            return None, logits
        # ForCausalLMLoss: cross-entropy on logits upcast to fp32
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        return loss, logits


def build_model(spec: ModelSpec, *, attention: str, ac: str, workload: str = "native") -> nn.Module:
    """``native``: the reference blocks above; ``hf``: the transformers model of the same shapes."""
    if spec.arch == "vit" and workload != "hf":
        raise ValueError("vit has no native workload; use workload 'hf' (transformers ViTForImageClassification)")
    if spec.arch == "vit":
        return HFViT(spec, attention=attention, ac=ac)
    if workload == "hf":
        return HFCausalLM(spec, attention=attention, ac=ac)
    model = CausalLM(spec, attention=attention, ac=ac)
    checkpoint_layers(model.layers, ac)
    return model


def checkpoint_layers(layers: nn.ModuleList, ac: str) -> None:
    """Each block wrapped in place for AC ``full`` (torch's checkpoint_wrapper) or ``op``
    (torchtitan's per-op SAC, ``op_checkpoint``); other policies leave them as they are."""
    if ac not in ("full", "op"):
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer) if ac == "full" else op_checkpoint(layer)


def _op_save_list() -> set:
    """torchtitan's default save list (torchtitan 0.3.0 distributed/activation_checkpoint.py
    _get_default_save_ops): the partitioner's compute-intensive ops, the SDPA variants, max,
    linear, topk and the functional reduce-scatter / all-to-all; ops this torch lacks are skipped."""
    from torch._functorch.partitioners import get_default_op_list

    save = {op.default for op in get_default_op_list().compute_intensive_ops}  # type: ignore[attr-defined]
    names = (
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten.max.default",
        "aten.linear.default",
        "aten.topk.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "_c10d_functional.all_to_all_single.default",
    )
    for name in names:
        op = torch.ops
        try:
            for part in name.split("."):
                op = getattr(op, part)
        except AttributeError:
            continue
        save.add(op)
    return save


def op_checkpoint(block: nn.Module) -> nn.Module:
    """torchtitan's per-op selective AC (SelectiveAC._wrap_block, no forced-recompute shapes),
    written against torch's API so that it runs where torchtitan is not installed: the save
    list's outputs are kept, except every second mm/linear, everything else recomputed
    (torchtitan's SelectiveAC.Config defaults: preserve_rng_state, no early stop)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save_ops = _op_save_list()
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)

    def policy_fn():
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            to_host = func == torch.ops.aten._to_copy.default and str(kwargs.get("device")) == "cpu"
            if to_host and "cuda" in str(args[0].device):  # a device-to-host copy (MoE sync): saved
                return CheckpointPolicy.MUST_SAVE
            mode = "recompute" if ctx.is_recompute else "forward"
            if func in mm_ops:
                counts[mode] += 1
            if func in save_ops:
                if func in mm_ops and counts[mode] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return checkpoint_wrapper(block, context_fn=policy_fn, preserve_rng_state=True, early_stop=False)


def make_batch(spec: ModelSpec, *, micro_batch: int, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch as the model's forward takes it: (input ids, labels) for a causal LM,
    (pixel values b×C×H×W in fp32, one class label per image) for a ViT."""
    if spec.arch == "vit":
        side = image_side(spec)
        pixels = torch.randn(micro_batch, spec.image_channels, side, side, device=device)
        return pixels, torch.randint(0, spec.vocab_size, (micro_batch,), device=device)
    ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len), device=device)
    return ids, ids


def image_side(spec: ModelSpec) -> int:
    """The square image's side: max_positions is (side / patch)² patches + the class token."""
    return spec.patch_size * math.isqrt(spec.max_positions - 1)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the FSDP units and the AC units."""
    return list(cast(nn.ModuleList, model.layers))  # nn.Module.__getattr__ is typed Tensor | Module


_HF_TYPES = {"llama": "llama", "gpt2": "gpt2", "neox": "gpt_neox"}


def hf_config(spec: ModelSpec, *, attention: str):
    """A transformers config with the spec's shapes (random weights, nothing downloaded)."""
    from transformers import AutoConfig

    if spec.arch == "vit":
        return _hf_vit_config(spec, attention=attention)
    if spec.arch not in _HF_TYPES:
        raise ValueError(f"no Hugging Face workload for arch {spec.arch}")
    common = dict(vocab_size=spec.vocab_size, tie_word_embeddings=spec.tied_embeddings)
    if spec.arch == "gpt2":
        shape = dict(
            n_layer=spec.num_layers,
            n_embd=spec.hidden,
            n_head=spec.num_heads,
            n_inner=spec.ffn_hidden,
            activation_function=spec.activation,
            n_positions=spec.max_positions,
            resid_pdrop=spec.dropout,
            embd_pdrop=spec.dropout,
            attn_pdrop=spec.dropout,
        )
    else:
        shape = dict(
            num_hidden_layers=spec.num_layers,
            hidden_size=spec.hidden,
            num_attention_heads=spec.num_heads,
            intermediate_size=spec.ffn_hidden,
            attention_dropout=spec.dropout,
        )
        if spec.arch == "llama":
            shape.update(num_key_value_heads=spec.num_kv_heads, attention_bias=spec.qkv_bias)
            if spec.head_dim:  # LlamaConfig.head_dim (None: hidden / heads)
                shape.update(head_dim=spec.head_dim)
        else:
            shape.update(rotary_pct=1.0, hidden_dropout=spec.dropout, hidden_act=spec.activation)
    config = AutoConfig.for_model(_HF_TYPES[spec.arch], **common, **shape)
    config._attn_implementation = attention
    return config


def _hf_vit_config(spec: ModelSpec, *, attention: str):
    from transformers import ViTConfig

    config = ViTConfig(
        hidden_size=spec.hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        intermediate_size=spec.ffn_hidden,
        hidden_act=spec.activation,
        image_size=image_side(spec),
        patch_size=spec.patch_size,
        num_channels=spec.image_channels,
        num_labels=spec.vocab_size,  # type: ignore[call-arg]  # a PretrainedConfig keyword, not in the stub
        hidden_dropout_prob=spec.dropout,
        attention_probs_dropout_prob=spec.dropout,
    )
    config._attn_implementation = attention
    return config


def _enable_hf_checkpointing(model, ac: str) -> None:
    if ac == "selective":
        raise ValueError("Hugging Face models offer full activation checkpointing only")
    if ac == "full":
        # transformers 5 renamed gradient_checkpointing_enable (the old name warns)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class HFViT(nn.Module):
    """transformers ViTForImageClassification built from a config; forward(pixel_values,
    labels) returns (loss, logits)."""

    def __init__(self, spec: ModelSpec, *, attention: str, ac: str):
        super().__init__()
        from transformers import ViTForImageClassification

        self.hf = ViTForImageClassification(hf_config(spec, attention=attention))
        _enable_hf_checkpointing(self.hf, ac)

    @property
    def layers(self):
        return self.hf.vit.layers

    def forward(self, pixel_values, labels):
        out = self.hf(pixel_values=pixel_values, labels=labels)
        return out.loss, out.logits


class HFCausalLM(nn.Module):
    """A transformers AutoModelForCausalLM built from a config, returning (loss, logits)."""

    def __init__(self, spec: ModelSpec, *, attention: str, ac: str):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_config(hf_config(spec, attention=attention))
        _enable_hf_checkpointing(self.hf, ac)

    @property
    def layers(self):
        base = self.hf.base_model
        return base.h if hasattr(base, "h") else base.layers

    def forward(self, input_ids, labels):
        out = self.hf(input_ids=input_ids, labels=labels)  # labels None: no loss in the model
        return out.loss, out.logits
