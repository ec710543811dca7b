"""The activation model against torch's own saved-tensor hooks, block by block."""
import pytest

from memplan.activations import block_saved
from memplan.precision import POLICIES
from memplan.specs import ModelSpec, TrainSpec

torch = pytest.importorskip("torch")
from calibrate.workloads import Block, rotary_tables  # noqa: E402
from calibrate.wrappers import DTYPES  # noqa: E402


def measured_block_saved(model: ModelSpec, train: TrainSpec) -> int:
    """Bytes of distinct storages autograd saves in one block's forward (params and the
    shared rotary tables excluded: they are not the block's)."""
    block = Block(model, attention=train.attention, selective_ac=False)
    policy = POLICIES[train.precision]
    dtype = DTYPES[policy.param_dtype]
    block = block.to(dtype)
    x = torch.randn(train.micro_batch, train.seq_len, model.hidden, dtype=dtype, requires_grad=True)
    cos, sin = rotary_tables(train.seq_len, model.head_dim, "cpu") if model.arch != "gpt2" else (None, None)
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *(t for t in (cos, sin) if t is not None))}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=DTYPES[policy.compute_dtype], enabled=policy.autocast)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        block(x, cos, sin)
    return sum(seen.values())


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
    model = ModelSpec(arch=arch, num_layers=1, hidden=128, num_heads=8, num_kv_heads=kv, ffn_hidden=344,
                      vocab_size=512, linear_bias=arch != "llama", dropout=dropout)
    train = TrainSpec(seq_len=64, micro_batch=2, precision=precision, attention=attention, device="cpu")
    estimated = sum(s.bytes for s in block_saved(model, train))
    assert estimated == measured_block_saved(model, train)
