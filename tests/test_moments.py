"""Moments are inserted beside a moment they name (``memplan.moments.insert``), and the step
assembly asks its framework adapter, never which framework it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memplan.memory import Step
from memplan.moments import MomentSpec, insert
from memplan.specs import ClusterSpec, Job, ModelSpec, Plan, TrainSpec
from memplan.step import MOMENTS

PACKAGE = Path(__file__).resolve().parent.parent / "memplan"


def _spec(name: str) -> MomentSpec:
    return MomentSpec(name=name, phase="backward", label=name, groups=("states",))


A, B, C, X, Y = (_spec(n) for n in "abcxy")


def test_insert_before_after_instead():
    specs = (A, B, C)
    assert insert(specs, X, before="a") == (X, A, B, C)
    assert insert(specs, X, Y, after="b") == (A, B, X, Y, C)
    assert insert(specs, X, after="c") == (A, B, C, X)
    assert insert(specs, X, Y, instead="b") == (A, X, Y, C)


def test_insert_names_one_anchor_that_exists():
    with pytest.raises(KeyError, match="no moment named 'z'"):
        insert((A, B), X, after="z")
    with pytest.raises(ValueError):
        insert((A, B), X, after="a", before="b")


def test_moment_names_are_unique():
    names = [m.name for m in MOMENTS]
    assert len(names) == len(set(names))


def _job(strategy: str, gpus: int, **train) -> Job:
    model = ModelSpec(name="t", num_layers=4, hidden=256, num_heads=4, ffn_hidden=512, vocab_size=1000)
    return Job(
        model=model,
        train=TrainSpec(micro_batch=1, seq_len=64, precision="bf16", **train),
        cluster=ClusterSpec(gpus=gpus, gpus_per_node=gpus),
        plan=Plan(strategy=strategy),
    )


@pytest.mark.parametrize(
    ("strategy", "gpus"),
    [("single", 1), ("ddp", 2), ("fsdp-full-shard", 2), ("fsdp-shard-grad-op", 2), ("zero3", 2)],
)
def test_every_step_keeps_the_moments_every_job_has(strategy, gpus):
    """A framework inserts its moments and may split a block's backward into its own (FSDP2 full
    shard's three instants per block), but the forward's end, the loss's backward and the
    optimizer step stay, in that order, with the optimizer step last."""
    names = [m.name for m in Step(_job(strategy, gpus)).moment_specs()]
    assert len(names) == len(set(names))
    kept = [n for n in names if n in ("forward.end", "backward.start", "optimizer")]
    assert kept == ["forward.end", "backward.start", "optimizer"]
    assert names[-1] == "optimizer"


def test_full_shard_splits_each_block_backward_where_measured():
    names = [m.name for m in Step(_job("fsdp-full-shard", 2)).moment_specs()]
    assert "block.last" not in names and "block.first" not in names
    # four blocks: the last, then the upper (block 2) and lower (block 1) between, then the first
    blocks = [n.split(".")[2] for n in names if n.startswith("fsdp.block.")]
    assert blocks == [w for w in ("last", "upper", "lower", "first") for _ in range(3)]
    assert names[0] == "fsdp.forward_start"


def _id_tests(path: Path) -> list[str]:
    """Comparisons that test ``….framework.id``, ``….strategy.id`` or ``….strategy.framework``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if not isinstance(side, ast.Attribute):
                    continue
                owner = side.value.attr if isinstance(side.value, ast.Attribute) else getattr(side.value, "id", "")
                if (owner, side.attr) in (("framework", "id"), ("strategy", "id"), ("strategy", "framework")):
                    found.append(f"{path.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("module", ["memory.py", "step.py", "quantities.py"])
def test_the_step_asks_its_adapter_not_which_framework_it_is(module):
    assert _id_tests(PACKAGE / module) == []


def test_the_id_check_finds_an_id_test():
    assert _id_tests(PACKAGE / "notes.py")  # finetune_notes names strategies in its notes
