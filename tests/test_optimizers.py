"""The fine-tuning optimizers' states (memplan.finetune) against what the libraries allocate:
bitsandbytes' Lion, Lion8bit, AdamW8bit and PagedAdamW8bit, torch.optim.Adafactor and
transformers' Adafactor, stepped once on a small Hugging Face llama on CPU; paged states on CUDA
are reported outside torch's counters."""

import math

import pytest

from memplan.finetune import PAGED_MIN_ELEMENTS, full_tensors
from memplan.memory import Step, estimate
from memplan.notes import paged_state_bytes
from memplan.specs import Job, ModelSpec, TrainSpec

LLAMA = ModelSpec(
    name="llama-tiny",
    arch="llama",
    num_layers=2,
    hidden=128,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden=344,
    vocab_size=1024,
)


def _library_optimizer(name, params):
    import bitsandbytes as bnb
    import torch
    from transformers.optimization import Adafactor

    return {
        "lion": lambda: bnb.optim.Lion(params, lr=1e-4),
        "lion8bit": lambda: bnb.optim.Lion8bit(params, lr=1e-4),
        "adam8bit": lambda: bnb.optim.AdamW8bit(params, lr=1e-4),
        "paged-adamw8bit": lambda: bnb.optim.PagedAdamW8bit(params, lr=1e-4),
        "torch-adafactor": lambda: torch.optim.Adafactor(params, lr=1e-4),
        "adafactor": lambda: Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False),
    }[name]()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["lion", "lion8bit", "adam8bit", "paged-adamw8bit", "torch-adafactor", "adafactor"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_bytes_are_what_the_library_allocates(name, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=LLAMA.vocab_size,
        hidden_size=LLAMA.hidden,
        num_hidden_layers=LLAMA.num_layers,
        num_attention_heads=LLAMA.num_heads,
        num_key_value_heads=LLAMA.num_kv_heads,
        intermediate_size=LLAMA.ffn_hidden,
        tie_word_embeddings=False,
    )
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    optimizer = _library_optimizer(name, list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # every tensor of the states once (bitsandbytes' qmap is one shared 256-entry table, not per tensor)
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = {v.untyped_storage().data_ptr(): v for v in states}
    qmaps = {id(s["qmap1"]) for s in optimizer.state.values() if "qmap1" in s} | {
        id(s["qmap2"]) for s in optimizer.state.values() if "qmap2" in s
    }
    allocated = sum(v.untyped_storage().nbytes() for v in tensors.values() if id(v) not in qmaps)
    job = Job(model=LLAMA, train=TrainSpec(precision=dtype, optimizer=name, device="cpu"))
    modelled = sum(t.bytes for t in Step(job).optimizer_terms())
    # a full fine-tune's AdamW8bit is modelled per element, 2·(1 + 4/256) bytes (the small norm
    # vectors' fp32 states left out: 0.3 % here), every other one tensor by tensor
    assert modelled == (pytest.approx(allocated, rel=0.005) if name == "adam8bit" else allocated)


def test_per_tensor_states_of_an_moe_full_fine_tune_are_refused():
    from memplan.catalog import model_preset
    from memplan.errors import MemplanError

    with pytest.raises(MemplanError, match="lion sizes its states per tensor"):
        estimate(Job(model=model_preset("mixtral-8x7b"), train=TrainSpec(optimizer="lion")))


def test_model_order_tensors_are_the_parameters_in_module_order():
    """torch's for-loop Adafactor keeps the previous tensor's update alive: the order matters."""
    pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=LLAMA.vocab_size,
        hidden_size=LLAMA.hidden,
        num_hidden_layers=LLAMA.num_layers,
        num_attention_heads=LLAMA.num_heads,
        num_key_value_heads=LLAMA.num_kv_heads,
        intermediate_size=LLAMA.ffn_hidden,
        tie_word_embeddings=False,
    )
    model = tf.AutoModelForCausalLM.from_config(config)
    assert [tuple(p.shape) for p in model.parameters()] == list(full_tensors(LLAMA))


def test_paged_states_are_outside_torch_counters_on_cuda():
    cuda = Job(model=LLAMA, train=TrainSpec(optimizer="paged-adamw8bit"))
    cpu = cuda.with_(device="cpu")
    paged = paged_state_bytes(cuda)
    large = [t for t in full_tensors(LLAMA) if math.prod(t) >= PAGED_MIN_ELEMENTS]
    # the two uint8 states page; their fp32 absmax blocks are torch.zeros on the device (init_state)
    assert paged == sum(2 * math.prod(t) for t in large) > 0
    assert paged_state_bytes(cpu) == 0  # bitsandbytes falls back to ordinary tensors on CPU
    states = lambda job: next(t.bytes for t in Step(job).optimizer_terms() if t.key == "optimizer.states")  # noqa: E731
    assert states(cpu) - states(cuda) == paged
    note = next(n for n in estimate(cuda).notes if n.startswith("paged-adamw8bit"))
    assert "outside torch's allocator counters" in note
    assert not any(n.startswith("paged-adamw8bit") for n in estimate(cpu).notes)


def test_lion_keeps_one_fp32_state_and_sgd_momentum_one_in_the_param_dtype():
    for precision, param_bytes in (("fp32", 4), ("bf16", 2)):
        lion = Job(model=LLAMA, train=TrainSpec(precision=precision, optimizer="lion"))
        sgd = lion.with_(optimizer="sgd-momentum")
        P = LLAMA.num_params
        assert sum(t.bytes for t in Step(lion).optimizer_terms()) == 4 * P
        assert sum(t.bytes for t in Step(sgd).optimizer_terms()) == param_bytes * P


def test_the_table_says_how_much_paged_state_is_outside():
    from click.testing import CliRunner

    from memplan.cli import main

    args = ["estimate", "--model", "llama-3.2-1b", "--gpus", "2"]  # every strategy a row
    out = CliRunner().invoke(main, [*args, "--optimizer", "paged-adamw8bit"]).output
    line = next(line for line in out.splitlines() if line.startswith("paged-adamw8bit: "))
    from memplan.catalog import model_preset

    ddp = Job(model=model_preset("llama-3.2-1b"), train=TrainSpec(optimizer="paged-adamw8bit")).with_(
        gpus=2, strategy="ddp"
    )
    full_shard = ddp.with_(strategy="fsdp-full-shard")
    assert f"ddp {paged_state_bytes(ddp) / 2**30:.2f}, " in line
    assert f"fsdp-full-shard {paged_state_bytes(full_shard) / 2**30:.2f}, " in line
    assert paged_state_bytes(full_shard) < paged_state_bytes(ddp)  # sharded with the states
    assert "paged-adamw8bit: " not in CliRunner().invoke(main, [*args, "--optimizer", "adam8bit"]).output


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "case_id", ["llama-h256-full-single-fp32-torch-adafactor-g1-b1s32", "llama-h256-full-single-fp32-lion8bit-g1-b1s32"]
)
def test_live_optimizer_case_matches_its_record(case_id):
    """The harness still steps the library's optimizer as recorded (the measurement's repeatability)."""
    pytest.importorskip("torch")
    from calibrate import records
    from validation import finetune_matrix, heldout

    record = next(r for r in heldout.latest(records.read([finetune_matrix.OUT])) if r["case"] == case_id)
    outcome = heldout.measure_case(finetune_matrix.BY_ID[case_id])
    assert outcome["status"] == "ok", outcome["error"]
    measured = outcome["measurement"]["peak_allocated_bytes"]
    assert measured == pytest.approx(record["measurement"]["peak_allocated_bytes"], rel=0.005)
