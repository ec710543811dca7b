"""The seeds' worked examples, redone on their own assumptions, and where they go wrong."""

import re

import pytest

from memplan.breakdown import Component
from memplan.catalog import TABLES_DIR, read_table
from memplan.memory import estimate, model_states
from memplan.precision import Policy
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec

GB = 10**9
# 002_*: "fp16 params and grads, fp32 Adam" with no fp32 master copy
SEED_002 = Policy(
    id="seed-002",
    compute_dtype="fp16",
    param_bytes=2,
    compute_bytes=2,
    stream_bytes=2,
    grad_bytes=2,
    master_bytes=0,
    state_bytes=4,
)


def llama(params_b: float) -> ModelSpec:
    from memplan.infer import model_for_params

    return model_for_params(int(params_b * 1e9))


def job(model, strategy, gpus=8, **train):
    return Job(model=model, train=TrainSpec(**train), cluster=ClusterSpec(gpus=gpus), plan=Plan(strategy=strategy))


def in_gb(states):
    return [states[c] / GB for c in (Component.PARAMS, Component.OPTIMIZER, Component.GRADIENTS)]


@pytest.mark.parametrize("strategy,expected", [("ddp", [26, 104, 26]), ("fsdp-full-shard", [3.25, 13, 3.25])])
def test_002_13b_table_on_its_own_assumptions(strategy, expected):
    # the seed's "13B" is exactly 13e9 parameters
    model = ModelSpec(num_layers=1, hidden=64, num_heads=1, ffn_hidden=64, vocab_size=1)
    states = model_states(job(model, strategy), SEED_002)
    scale = 13e9 / model.num_params
    assert [v * scale for v in in_gb(states)] == pytest.approx(expected, rel=1e-3)


def test_002_forgets_the_master_copy_and_ddp_buckets():
    """13B with real mixed precision under DDP: 16 B/param of states plus a bucket copy of
    the gradients, not the 12 B/param the seed adds up."""
    est = estimate(job(llama(13), "ddp"))
    p = est.job.model.num_params
    assert est.by_component[Component.OPTIMIZER] == 12 * p  # fp32 Adam moments + fp32 master
    assert est.allocated_bytes > 18 * p


def test_003_70b_full_shard_does_not_fit_in_35gb():
    """003 says Llama-3 70B under FSDP FULL_SHARD in FP16 needs 35 GB per GPU on 8 GPUs."""
    j = job(llama(70), "fsdp-full-shard", precision="mixed-fp16")
    states = sum(model_states(j).values())
    assert states / GB > 3.5 * 35  # fp32 shard + fp32 grads + Adam: 16 B/param / 8 GPUs = 138 GB
    assert estimate(j).total_bytes > 80 * 2**30


def test_003_fp32_weights_of_70b_are_280gb_not_140():
    states = model_states(job(llama(70), "ddp", precision="fp32"))
    assert states[Component.PARAMS] / GB == pytest.approx(280, rel=0.02)


SEEDS = TABLES_DIR / "seeds"


def _words(text: str) -> str:
    """Lower case with the markup and spacing that differ between a quote and its source dropped
    (table cells run together in the text dump, the flowchart breaks lines with <br/>)."""
    return re.sub(r"[^0-9a-z%~+<>.]+", "", text.replace("<br/>", " ").replace("×", "x").lower())


def _quoted(fragment: str, source: str) -> bool:
    """A fragment is in the source as written, or is one flowchart step: a node's label then the
    label of the edge taken ("Priority Memory efficiency"), "not X" for the No edge of node X."""
    words = fragment.split()
    words = words[1:] if words[:1] == ["not"] else words
    return any(
        _words(" ".join(words[:i])) in source and _words(" ".join(words[i:])) in source for i in range(len(words))
    )


@pytest.mark.parametrize("rule", read_table("rules.csv"), ids=lambda r: r["id"])
def test_every_rule_quotes_its_vendored_seed(rule):
    """Each quote of tables/rules.csv, cut at its elisions (...), table cells (|), flowchart arrows
    (->) and clause marks, is in the seed it cites (tables/seeds/, copied whole from the seeds)."""
    source = _words((SEEDS / rule["source"]).read_text())
    fragments = [f for f in re.split(r"\.\.\.|->|\||\?|;|\(|\)", rule["quote"]) if f.strip()]
    assert [f for f in fragments if not _quoted(f, source)] == []
