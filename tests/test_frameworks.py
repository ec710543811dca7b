"""Framework adapters, the moments declared as data, and Job.with_."""

import pytest

from memplan.breakdown import Component
from memplan.emit import KINDS
from memplan.errors import MemplanError
from memplan.frameworks import FRAMEWORKS
from memplan.inputs import build_jobs
from memplan.memory import Step, estimate
from memplan.precision import DTYPE_BYTES, POLICIES
from memplan.specs import PRECISIONS
from memplan.strategies import STRATEGIES


def job(strategy, **kw):
    args = {"model": "llama-3.2-1b", "gpus": 1 if strategy == "single" else 8, "strategy": strategy} | kw
    return build_jobs(**args)[1][0]


def test_every_strategy_names_a_registered_adapter_and_every_emit_kind_has_one_writer():
    assert {s.framework for s in STRATEGIES.values()} == set(FRAMEWORKS)
    own = [kind for f in FRAMEWORKS.values() for kind in f.emitters]
    assert len(own) == len(set(own)) and set(own) | {"accelerate", "torchrun", "torchtitan"} == set(KINDS)
    for f in FRAMEWORKS.values():
        assert set(f.native_precisions) <= set(PRECISIONS) and "fp32" in f.native_precisions


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_each_moment_is_its_declared_groups_in_order(strategy):
    step = Step(job(strategy, grad_accum=1))
    groups = step.groups()
    assert {g for m in step.moment_specs() for g in m.groups} <= set(groups)
    for spec, moment in zip(step.moment_specs(), step.moments(), strict=True):
        assert moment.terms == tuple(t for g in spec.groups for t in groups[g])
        assert all(t.key for t in moment.terms)


def test_the_logits_are_found_by_key_and_live_until_the_first_block_backward():
    step = Step(job("ddp"))
    t = step.job.train
    (logits,) = step.groups()["logits.forward"]
    # the head's output in the compute dtype: c·b·s·V
    assert (
        logits.key == "logits"
        and logits.bytes == POLICIES[t.precision].compute_bytes * t.micro_batch * t.seq_len * step.job.model.vocab_size
    )
    assert all(any(x.key == "logits" for x in m.terms) for m in step.moments()[:-1])  # a tied one's sum too
    assert not any(x.key == "logits" for x in step.moments()[-1].terms)  # the optimizer step


def test_framework_buffers_come_from_the_adapter_of_the_strategy():
    keys = {
        s: {t.key for m in estimate(job(s)).moments for t in m.terms if t.component == Component.BUFFERS}
        for s in ("single", "ddp", "fsdp-full-shard", "zero2", "zero3")
    }
    assert "ddp.buckets" in keys["ddp"] and not keys["single"] - {"optimizer.sqrt_temporaries"}
    assert {"fsdp.root_unit", "fsdp.block", "fsdp.block_grads"} <= keys["fsdp-full-shard"]
    assert "zero.ipg_bucket" in keys["zero2"] and "zero3.gathered" in keys["zero3"]
    # DeepSpeed copies the reduced bf16 gradients into an fp32 partition only under a master copy
    assert "deepspeed.fp32_grad_partition" in keys["zero2"]
    assert "deepspeed.fp32_grad_partition" not in {
        t.key for t in estimate(job("zero2", precision="fp32")).moments[-1].terms
    }


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_a_policys_dtypes_agree_with_its_byte_counts(policy):
    assert DTYPE_BYTES[policy.compute_dtype] == policy.compute_bytes
    assert DTYPE_BYTES[policy.param_dtype] == policy.param_bytes
    # a master copy sits only behind low-precision parameters, autocast only over fp32 ones
    assert not (policy.master and not policy.low_precision_params)
    assert not (policy.autocast and policy.low_precision_params)


def test_with_applies_every_change_before_validating():
    """Bug 2: zero2 + optimizer offload -> ddp + no offload failed when strategy came first."""
    j = job("zero2", offload="optimizer")
    for changes in ({"strategy": "ddp", "offload": "none"}, {"offload": "none", "strategy": "ddp"}):
        moved = j.with_(**changes)
        assert (moved.plan.strategy, moved.plan.offload) == ("ddp", "none")
    with pytest.raises(MemplanError, match="offload 'optimizer' is not available with ddp"):
        j.with_(strategy="ddp")
    with pytest.raises(MemplanError, match="unknown setting 'micro_bach'"):
        j.with_(micro_bach=2)
    multi = j.with_(micro_batch=3, gpus=16, offload="none")
    assert (multi.train.micro_batch, multi.cluster.gpus, multi.plan.offload) == (3, 16, "none")


def test_the_harness_wraps_exactly_the_frameworks_runs_plans_for():
    pytest.importorskip("torch")
    from calibrate.runs import HARNESS_FRAMEWORKS
    from calibrate.wrappers import WRAPPERS

    assert set(HARNESS_FRAMEWORKS) == set(WRAPPERS) and set(WRAPPERS) <= set(FRAMEWORKS)
