"""memplan.estimate / from_module / sweep as a notebook calls them: same inputs as the CLI."""

import inspect
import json
import subprocess
import sys

import pytest

import memplan
from memplan.errors import FLAGS, InputError, MemplanError
from memplan.inputs import build_jobs
from memplan.memory import estimate as estimate_job
from memplan.replayed import with_replayed_allocator
from memplan.request import FIELDS, PARTS, ModelRequest, Request

COLUMNS = [
    "precision",
    "activation_checkpointing",
    "offload",
    "micro_batch",
    "phase",
    "fits",
    "headroom_bytes",
    "params_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "buffers_bytes",
    "allocated_bytes",
    "overhead_bytes",
    "total_bytes",
]


def test_to_frame_has_one_row_per_strategy_with_byte_columns():
    result = memplan.estimate(params=13e9, gpus=8, gpu_mem=80, calibration=None)
    frame = result.to_frame()
    assert list(frame.index) == [e.job.plan.strategy for e in result.estimates] and len(frame) == 8
    assert set(COLUMNS) <= set(frame.columns)
    components = ["params_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes"]
    assert (frame[components].sum(axis=1) == frame.allocated_bytes).all()
    assert (frame.allocated_bytes + frame.overhead_bytes == frame.total_bytes).all()
    for est in result.estimates:
        row = frame.loc[est.job.plan.strategy]
        assert (row.total_bytes, row.phase, bool(row.fits)) == (est.total_bytes, est.phase, est.fits)
    assert result["zero3"].job.plan.strategy == "zero3"
    with pytest.raises(KeyError, match="zero9"):
        result["zero9"]


@pytest.mark.parametrize(
    "source",
    [
        dict(params=7e9),
        dict(model="llama-2-7b"),
        dict(arch="gpt2", layers=4, hidden=256, heads=4, ffn=1024, vocab=1000),
        dict(
            config={
                "model_type": "llama",
                "vocab_size": 1000,
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
            }
        ),
    ],
)
def test_every_model_source_matches_the_scalar_path(source):
    result = memplan.estimate(**source, gpus=4, micro_batch=2, seq_len=512, strategy="zero2", calibration=None)
    _, jobs = build_jobs(**source, gpus=4, micro_batch=2, seq_len=512, strategy="zero2")
    # memplan.estimate replays the allocator for what it reports (memplan.overheads)
    assert [e.total_bytes for e in result.estimates] == [with_replayed_allocator(estimate_job(jobs[0])).total_bytes]


def test_config_path_and_spec_give_the_same_answer(tmp_path):
    config = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    by_path = memplan.estimate(config=str(path), gpus=2, calibration=None)
    by_spec = memplan.estimate(model=by_path.choice.spec, gpus=2, calibration=None)
    assert by_path.to_frame().total_bytes.tolist() == by_spec.to_frame().total_bytes.tolist()


def test_from_module_reads_shapes_without_torch():
    spec = memplan.estimate(model="llama-2-7b", calibration=None).choice.spec

    class Shaped:
        def __init__(self, *shape):
            self.shape = shape

    h, kv, ffn = spec.hidden, spec.hidden * spec.num_kv_heads // spec.num_heads, spec.ffn_hidden
    block = [
        ("attn.q", (h, h)),
        ("attn.k", (kv, h)),
        ("attn.v", (kv, h)),
        ("attn.o", (h, h)),
        ("mlp.gate", (ffn, h)),
        ("mlp.up", (ffn, h)),
        ("mlp.down", (h, ffn)),
        ("norm1", (h,)),
        ("norm2", (h,)),
    ]
    named = [("embed", (spec.vocab_size, h))]
    named += [(f"layers.{i}.{n}", s) for i in range(spec.num_layers) for n, s in block]
    named += [("norm", (h,)), ("lm_head", (spec.vocab_size, h))]

    class Module:
        def named_parameters(self):
            return ((n, Shaped(*s)) for n, s in named)

    result = memplan.from_module(Module(), num_heads=spec.num_heads, name=spec.name, gpus=8, calibration=None)
    assert result.choice.spec == spec
    direct = memplan.estimate(model="llama-2-7b", gpus=8, calibration=None)
    assert result.to_frame().total_bytes.tolist() == direct.to_frame().total_bytes.tolist()


def test_bad_input_is_one_line_naming_the_value():
    with pytest.raises(TypeError, match="estimate\\(\\) got an unexpected keyword argument 'bogus'") as err:
        memplan.estimate(params=7e9, bogus=1)
    assert "\n" not in str(err.value) and isinstance(err.value, MemplanError)
    with pytest.raises(InputError, match="'zero9'") as err:
        memplan.estimate(params=7e9, strategy="zero9")
    assert (err.value.field, err.value.value) == ("strategy", "zero9") and "zero3" in err.value.accepted
    with pytest.raises(MemplanError, match="'bogus'"):
        memplan.sweep(params=[7e9], bogus=1)


def test_a_misspelt_keyword_is_named_not_taken_for_a_missing_model():
    """Bug 1: recommend(model="gpt2", micro_bach=4) said "give exactly one model source"."""
    for function in (memplan.recommend, memplan.estimate, memplan.min_gpus):
        with pytest.raises(
            TypeError, match="unexpected keyword argument 'micro_bach'; did you mean 'micro_batch'"
        ) as err:
            function(model="gpt2", micro_bach=4)
        assert err.value.keyword == "micro_bach" and "model source" not in str(err.value)


def test_every_input_is_an_explicit_keyword_with_the_requests_default():
    for function in (memplan.estimate, memplan.recommend, memplan.min_gpus):
        params = inspect.signature(function).parameters
        assert next(iter(params)) == "request"
        for keyword, (part, _) in FIELDS.items():
            if keyword in params:
                assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY
                assert params[keyword].default == (None if part == "model" else getattr(PARTS[part](), keyword))
    assert "gpus" not in inspect.signature(memplan.min_gpus).parameters  # searched, not given
    assert not set(FIELDS) - set(inspect.signature(memplan.estimate).parameters)
    assert "params" not in inspect.signature(memplan.from_module).parameters  # the module is the model


def test_a_request_object_and_keywords_agree():
    request = Request.of(model="llama-2-7b", gpus=8, micro_batch=2, strategy="zero2")
    by_request = memplan.estimate(request, calibration=None)
    by_keywords = memplan.estimate(model="llama-2-7b", gpus=8, micro_batch=2, strategy="zero2", calibration=None)
    assert by_request.estimates == by_keywords.estimates and by_request.request == by_keywords.request
    over = memplan.estimate(request, gpus=16, calibration=None)  # keywords change the request
    assert over.request == request.with_(gpus=16) and over.estimates[0].job.cluster.gpus == 16
    assert memplan.estimate(request, params=13e9).request.model == ModelRequest(params=13e9)  # a new model source


def test_estimate_returns_what_the_command_renders():
    """Relative throughputs and the recommendation are the separate calls' answers."""
    from memplan.calibration import apply_all
    from memplan.decide import basis_for
    from memplan.throughput import relative_to_ddp

    result = memplan.estimate(params=7e9, gpus=8, device="cpu", ac="full")
    basis = basis_for(result.estimates[0].job, calibration="auto")
    assert result.relative_throughputs == tuple(relative_to_ddp(e.job, basis.step) for e in result.estimates)
    _, rec = memplan.recommend(params=7e9, gpus=8, device="cpu", ac="full")
    assert result.recommendation == rec and result.decision.fixed == ("ac",)
    assert result.applied == apply_all(list(result.estimates), "auto") and result.applied is not None


@pytest.mark.parametrize(
    "inputs,field,python,flag",
    [
        ({"params": 13e9, "micro_batch": 0}, "micro_batch", "micro_batch must be", "micro-batch must be"),
        ({"params": "zero"}, "params", "params 'zero'", "params 'zero'"),
        ({"params": 13e9, "gpu_mem": "eighty"}, "gpu_mem", "gpu_mem 'eighty'", "gpu-mem 'eighty'"),
        ({"params": 13e9, "gpu": "tpu-v9"}, "gpu", "gpu 'tpu-v9' is not a known GPU", "--gpu 'tpu-v9'"),
        ({"params": 13e9, "gpu": "v100-32gb"}, "precision", "use precision fp32", "use --precision fp32"),
        (
            {"params": 13e9, "gpu": "h100-sxm", "gpu_mem": 80},
            "gpu_mem",
            "give gpu NAME or gpu_mem SIZE",
            "give --gpu NAME",
        ),
        ({"arch": "llama", "layers": 4}, "hidden", "arch llama needs hidden, heads", "--arch llama needs --hidden"),
        ({"params": 13e9, "model": "gpt2"}, "model", "(got params, model)", "(got --params, --model)"),
    ],
)
def test_errors_name_the_keyword_in_python_and_the_flag_in_the_command(inputs, field, python, flag):
    with pytest.raises(InputError) as err:
        memplan.estimate(**inputs)
    assert err.value.field == field and python in str(err.value) and "--" not in str(err.value)
    assert flag in err.value.render(FLAGS)


def test_min_gpus_searches_whole_nodes_of_gpus_per_node():
    # 50B: past one node under both (the replayed totals put 66B on 120 GPUs either way)
    _, per_node = memplan.min_gpus(params=50e9, gpu="a100-80gb", gpus_per_node=4, calibration=None)
    _, default = memplan.min_gpus(params=50e9, gpu="a100-80gb", calibration=None)
    assert per_node.gpus % 4 == 0 and default.gpus % 8 == 0 and per_node.gpus != default.gpus


def test_exports_and_import_stays_torch_free():
    for name in ("estimate", "sweep", "from_module", "recommend", "plot_breakdown", "plot_fits", "plot_calibration"):
        assert callable(getattr(memplan, name)) and name in memplan.__all__
    code = (
        "import sys, memplan; print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_memplan_sweep_is_callable_whichever_import_came_first():
    code = (
        "from memplan.grid import sweep; import memplan; "
        "print(len(memplan.sweep(params=[7e9], gpus=[8, 64], strategy=['ddp'])))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2"
