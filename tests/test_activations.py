"""The activation model against torch's own saved-tensor hooks, block by block."""

import pytest

from memplan.activations import block_saved, loss_saved, model_saved
from memplan.precision import POLICIES
from memplan.specs import ModelSpec, TrainSpec

torch = pytest.importorskip("torch")
from calibrate.workloads import Block, hf_config, make_batch, rotary_tables  # noqa: E402
from calibrate.wrappers import DTYPES  # noqa: E402
from validation.saved import saved_bytes  # noqa: E402


def measured_block_saved(model: ModelSpec, train: TrainSpec) -> int:
    """Bytes of distinct storages autograd saves in one block's forward (params and the
    shared rotary tables excluded: they are not the block's)."""
    block = Block(model, attention=train.attention, selective_ac=False)
    policy = POLICIES[train.precision]
    dtype = DTYPES[policy.param_dtype]
    block = block.to(dtype)
    x = torch.randn(train.micro_batch, train.seq_len, model.hidden, dtype=dtype, requires_grad=True)
    cos, sin = rotary_tables(train.seq_len, model.head_size, "cpu") if model.arch != "gpt2" else (None, None)
    skip = (*block.parameters(), *(t for t in (cos, sin) if t is not None))
    autocast = torch.autocast("cpu", dtype=DTYPES[policy.compute_dtype], enabled=policy.autocast)
    return saved_bytes(lambda: block(x, cos, sin), skip=skip, autocast=autocast)


CASES = [
    (arch, precision, attention, kv, dropout)
    for arch in ("llama", "gpt2", "neox")
    for precision in ("fp32", "amp-bf16", "mixed-bf16", "bf16")
    for attention in ("sdpa", "eager")
    for kv in ((8, 2) if arch == "llama" else (8,))
    for dropout in ((0.0, 0.1) if arch == "gpt2" else (0.0,))
]


@pytest.mark.parametrize("arch,precision,attention,kv,dropout", CASES)
def test_block_saved_bytes_match_autograd(arch, precision, attention, kv, dropout):
    model = ModelSpec(
        arch=arch,
        num_layers=1,
        hidden=128,
        num_heads=8,
        num_kv_heads=kv,
        ffn_hidden=344,
        vocab_size=512,
        linear_bias=arch != "llama",
        dropout=dropout,
    )
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, attention=attention, device="cpu")
    estimated = sum(s.bytes for s in block_saved(model, train))
    assert estimated == measured_block_saved(model, train)


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("head_dim", [8, 32])  # narrower and wider than hidden/heads = 16
def test_block_saved_bytes_match_autograd_with_a_head_dim_apart(precision, attention, head_dim):
    """q is heads·head_dim wide, k and v kv_heads·head_dim: Mistral-Nemo's and Qwen3-0.6B's heads."""
    model = ModelSpec(
        num_layers=1, hidden=128, num_heads=8, num_kv_heads=2, head_dim=head_dim, ffn_hidden=344, vocab_size=512
    )
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, attention=attention, device="cpu")
    estimated = sum(s.bytes for s in block_saved(model, train))
    assert model.q_hidden == 8 * head_dim != model.hidden
    assert estimated == measured_block_saved(model, train)


def measured_vit_saved(model: ModelSpec, train: TrainSpec) -> tuple[int, int]:
    """Bytes autograd saves in one transformers ViTLayer, and in a one-layer
    ViTForImageClassification outside its layer (params, the batch itself and 0-dim scalars
    such as nll_loss's total weight excluded)."""
    from transformers import ViTForImageClassification

    policy = POLICIES[train.precision]
    dtype = DTYPES[policy.param_dtype]
    vit = ViTForImageClassification(hf_config(model, attention=train.attention)).to(dtype)
    layer = vit.vit.layers[0]
    x = torch.randn(train.micro_batch, model.max_positions, model.hidden, dtype=dtype, requires_grad=True)
    pixels, labels = make_batch(model, micro_batch=train.micro_batch, seq_len=train.seq_len, device="cpu")
    autocast = torch.autocast("cpu", dtype=DTYPES[policy.compute_dtype], enabled=policy.autocast)
    options = dict(skip=(*vit.parameters(), pixels, labels), autocast=autocast, scalars=False)
    block = saved_bytes(lambda: layer(x), **options)
    return block, saved_bytes(lambda: vit(pixel_values=pixels, labels=labels), **options) - block


VIT_CASES = [
    (p, a, dropout)
    for p in ("fp32", "amp-bf16", "mixed-bf16", "bf16")
    for a in ("sdpa", "eager")
    for dropout in (0.0, 0.1)
]


@pytest.mark.parametrize("precision,attention,dropout", VIT_CASES)
def test_vit_saved_bytes_match_autograd(precision, attention, dropout):
    model = ModelSpec(
        arch="vit",
        num_layers=1,
        hidden=128,
        num_heads=8,
        ffn_hidden=344,
        vocab_size=10,
        linear_bias=True,
        max_positions=65,
        patch_size=8,
        dropout=dropout,
    )
    train = TrainSpec(seq_len=2048, micro_batch=2, precision=precision, attention=attention, device="cpu")
    pre, post = model_saved(model, train)
    outside = [s for s in pre + post + loss_saved(model, train)[0] if not s.name.startswith("logits")]
    estimated = (sum(s.bytes for s in block_saved(model, train)), sum(s.bytes for s in outside))
    assert estimated == measured_vit_saved(model, train)
