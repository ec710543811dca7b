"""from_module: a torch module's exact parameters give back the ModelSpec, and the same estimate."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import memplan  # noqa: E402
from calibrate.workloads import build_model  # noqa: E402
from memplan.errors import MemplanError  # noqa: E402
from memplan.memory import estimate as estimate_job  # noqa: E402
from memplan.module import spec_from_module  # noqa: E402
from memplan.replayed import with_replayed_allocator  # noqa: E402
from memplan.specs import ModelSpec  # noqa: E402

SMALL = dict(num_layers=2, hidden=64, num_heads=4, vocab_size=128, name="small")
NATIVE = [
    ModelSpec(arch="llama", num_kv_heads=2, ffn_hidden=172, **SMALL),
    ModelSpec(arch="llama", num_kv_heads=4, ffn_hidden=128, tied_embeddings=True, **SMALL),
    ModelSpec(arch="llama", num_kv_heads=2, head_dim=32, ffn_hidden=172, **SMALL),  # q width 128 over 64
    ModelSpec(arch="gpt2", ffn_hidden=256, max_positions=64, tied_embeddings=True, linear_bias=True, **SMALL),
    ModelSpec(arch="neox", ffn_hidden=256, linear_bias=True, **SMALL),
]


def _exact_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _same_estimates(spec_a: ModelSpec, spec_b: ModelSpec) -> None:
    kwargs = dict(gpus=4, gpu_mem=80, micro_batch=2, seq_len=64, calibration=None)
    a = memplan.estimate(model=spec_a, **kwargs)
    b = memplan.estimate(model=spec_b, **kwargs)
    assert [(e.job.plan.strategy, e.allocated_bytes, e.total_bytes, e.phase) for e in a.estimates] == [
        (e.job.plan.strategy, e.allocated_bytes, e.total_bytes, e.phase) for e in b.estimates
    ]


@pytest.mark.parametrize(
    "spec", NATIVE, ids=lambda s: f"{s.arch}-kv{s.num_kv_heads}-d{s.head_size}-tied{s.tied_embeddings}"
)
def test_native_module_round_trips(spec):
    module = build_model(spec, attention="sdpa", ac="none", workload="native")
    got = spec_from_module(module, num_heads=spec.num_heads, name=spec.name, dropout=spec.dropout)
    assert got.num_params == _exact_count(module) == spec.num_params
    assert (got.arch, got.num_layers, got.hidden, got.num_heads, got.vocab_size) == (
        spec.arch,
        spec.num_layers,
        spec.hidden,
        spec.num_heads,
        spec.vocab_size,
    )
    assert got.block_params() == spec.block_params() and got.head_dim == spec.head_dim
    _same_estimates(got, spec)


def test_from_module_estimate_equals_the_spec_estimate():
    spec = NATIVE[0]
    module = build_model(spec, attention="sdpa", ac="none", workload="native")
    result = memplan.from_module(module, num_heads=spec.num_heads, name=spec.name, gpus=8, gpu_mem=80, calibration=None)
    direct = memplan.estimate(model=spec, gpus=8, gpu_mem=80, calibration=None)
    # memplan.estimate replays the allocator for what it reports (memplan.overheads)
    replayed = [with_replayed_allocator(estimate_job(e.job)).total_bytes for e in direct.estimates]
    assert replayed == [e.total_bytes for e in direct.estimates]
    assert result.choice.spec == spec
    assert [e.total_bytes for e in result.estimates] == [e.total_bytes for e in direct.estimates]


HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=128),
}


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_hf_model_from_config(family):
    config = HF_CONFIGS[family]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    from_config = spec_from_module(model)
    assert from_config.num_params == _exact_count(model)
    assert from_config.num_layers == 3 and from_config.hidden == 64
    assert from_config.num_heads == config.num_attention_heads
    # the same module seen only through its shapes (no config) gives the same parameters and estimates
    shapes_only = type("Bare", (), {"named_parameters": lambda self: model.named_parameters()})()
    from_shapes = spec_from_module(shapes_only, num_heads=config.num_attention_heads, dropout=from_config.dropout)
    assert from_shapes.num_params == from_config.num_params
    assert dataclasses.replace(from_shapes, name=from_config.name) == from_config
    _same_estimates(from_shapes, from_config)


def test_module_without_config_needs_num_heads():
    module = build_model(NATIVE[0], attention="sdpa", ac="none", workload="native")
    with pytest.raises(MemplanError, match="num_heads="):
        spec_from_module(module)


def test_unknown_parameters_are_named():
    module = build_model(NATIVE[0], attention="sdpa", ac="none", workload="native")
    module.layers[0].adapter = torch.nn.Linear(64, 8)
    with pytest.raises(MemplanError, match="adapter") as err:
        spec_from_module(module, num_heads=4)
    assert "\n" not in str(err.value)


def test_an_object_without_parameters_is_refused():
    with pytest.raises(MemplanError, match="named_parameters"):
        memplan.from_module(object(), num_heads=4)
