"""memplan.estimate / from_module / sweep as a notebook calls them: same inputs as the CLI."""
import json
import subprocess
import sys

import pytest

import memplan
from memplan.errors import MemplanError
from memplan.inputs import build_jobs
from memplan.memory import estimate as estimate_job

COLUMNS = ["precision", "activation_checkpointing", "offload", "micro_batch", "phase", "fits", "headroom_bytes",
           "params_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
           "allocated_bytes", "overhead_bytes", "total_bytes"]


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


@pytest.mark.parametrize("source", [
    dict(params=7e9),
    dict(model="llama-2-7b"),
    dict(arch="gpt2", layers=4, hidden=256, heads=4, ffn=1024, vocab=1000),
    dict(config={"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
                 "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}),
])
def test_every_model_source_matches_the_scalar_path(source):
    result = memplan.estimate(**source, gpus=4, micro_batch=2, seq_len=512, strategy="zero2", calibration=None)
    _, jobs = build_jobs(**source, gpus=4, micro_batch=2, seq_len=512, strategy="zero2")
    assert [e.total_bytes for e in result.estimates] == [estimate_job(jobs[0]).total_bytes]


def test_config_path_and_spec_give_the_same_answer(tmp_path):
    config = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}
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
    block = [("attn.q", (h, h)), ("attn.k", (kv, h)), ("attn.v", (kv, h)), ("attn.o", (h, h)),
             ("mlp.gate", (ffn, h)), ("mlp.up", (ffn, h)), ("mlp.down", (h, ffn)), ("norm1", (h,)), ("norm2", (h,))]
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
    with pytest.raises(MemplanError, match="'bogus'.*accepted:") as err:
        memplan.estimate(params=7e9, bogus=1)
    assert "\n" not in str(err.value)
    with pytest.raises(MemplanError, match="'zero9'"):
        memplan.estimate(params=7e9, strategy="zero9")
    with pytest.raises(MemplanError, match="'bogus'"):
        memplan.sweep(params=[7e9], bogus=1)


def test_exports_and_import_stays_torch_free():
    for name in ("estimate", "sweep", "from_module", "recommend", "plot_breakdown", "plot_fits", "plot_calibration"):
        assert callable(getattr(memplan, name)) and name in memplan.__all__
    code = "import sys, memplan; print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_memplan_sweep_is_callable_whichever_import_came_first():
    code = ("from memplan.grid import sweep; import memplan; "
            "print(len(memplan.sweep(params=[7e9], gpus=[8, 64], strategy=['ddp'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "2"
