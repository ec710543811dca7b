import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import MemplanError
from memplan.infer import model_for_params

# Llama-2 params.json / HF config.json: (layers, hidden, heads, kv heads, ffn, parameters).
LLAMA2 = {
    7e9: (32, 4096, 32, 32, 11008, 6_738_415_616),
    13e9: (40, 5120, 40, 40, 13824, 13_015_864_320),
    70e9: (80, 8192, 64, 8, 28672, 68_976_648_192),
}


@pytest.mark.parametrize("request_", sorted(LLAMA2))
def test_llama2_shapes_exactly(request_):
    spec = model_for_params(int(request_))
    shape = (spec.num_layers, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.ffn_hidden, spec.num_params)
    assert shape == LLAMA2[request_]
    assert (spec.arch, spec.vocab_size, spec.tied_embeddings) == ("llama", 32000, False)
    assert spec.name == f"llama-style-{int(request_ / 1e9)}B (inferred)"


def test_float_request_and_name():
    assert model_for_params(7e9).num_layers == 32
    assert model_for_params(350_000_000).name == "llama-style-350M (inferred)"
    assert model_for_params(1.3e9).name == "llama-style-1.3B (inferred)"


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=10**8, max_value=2 * 10**12))
def test_within_two_percent(num_params):
    if num_params == 7 * 10**9:
        return  # Meta's "7B" holds 6.74e9 parameters (checked above)
    spec = model_for_params(num_params)
    assert abs(spec.num_params - num_params) / num_params <= 0.02
    assert spec.hidden % 128 == 0 and spec.num_heads % spec.num_kv_heads == 0
    assert spec.num_kv_heads == (8 if spec.hidden >= 8192 else spec.num_heads)


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=1e6, max_value=1e14))
def test_whole_range_gives_a_valid_model(num_params):
    assert model_for_params(num_params).num_layers >= 1


@pytest.mark.parametrize("bad", [999_999, 0, -5, 1e14 + 1e6, 10**15, float("nan"), "7B", True])
def test_out_of_range(bad):
    with pytest.raises(MemplanError) as err:
        model_for_params(bad)
    assert "out of range; accepted: 1e+06 to 1e+14" in str(err.value)
