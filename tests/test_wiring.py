"""The loop's conventions wired into the step's moments (memory.py): each changes the terms it
should, by the bytes its formula says, and keeps the others."""

import pytest

from memplan.activations import shapes
from memplan.checkpointing import block_kept_under, offload_stash_blocks, offloaded, offloaded_outside
from memplan.errors import MemplanError
from memplan.inputs import build_jobs
from memplan.loss import loss_saved
from memplan.memory import Step, estimate
from memplan.request import Request


def _job(**inputs):
    request = Request.of(model="llama-3.2-1b", gpus=8, strategy="fsdp-full-shard", seq_len=1024, **inputs)
    return build_jobs(request)[1][0]


def _by_label(job):
    return {m.label: m for m in estimate(job).moments}


def _bytes(moment, key_prefix):
    return sum(t.bytes for t in moment.terms if t.key.startswith(key_prefix))


def test_freed_logits_leave_the_moments_after_forward_by_exactly_the_logits():
    kept, freed = _by_label(_job()), _by_label(_job(logits="freed"))
    x = shapes(_job().model, _job().train)
    logits = x.c * x.tokens * x.V
    assert (
        freed["end of forward (cross-entropy)"].allocated_bytes
        == kept["end of forward (cross-entropy)"].allocated_bytes
    )
    backward = [label for label in kept if "block" in label and kept[label].phase == "backward"]
    assert len(backward) >= 6  # FSDP2 full shard: three instants of each block looked at
    for label in ("start of backward (loss gradient)", *backward):
        assert kept[label].allocated_bytes - freed[label].allocated_bytes == logits


def test_chunked_loss_terms_are_the_loss_modules():
    job = _job(loss="chunked-ce")
    fwd, bwd = loss_saved(job.model, job.train, job.train.loop)
    moments = _by_label(job)
    assert _bytes(moments["end of forward (cross-entropy)"], "loss.forward") == sum(s.bytes for s in fwd)
    assert _bytes(moments["start of backward (loss gradient)"], "loss.backward") == sum(s.bytes for s in bwd)


def test_fused_loss_has_no_logits_nor_head_input():
    terms = [t for m in estimate(_job(loss="fused-linear-ce")).moments for t in m.terms]
    assert not any(t.key == "logits" or t.name.startswith("final norm output") for t in terms)


def test_ac_every_splits_the_blocks_and_adds_the_last_checkpointed_moment():
    job = _job(ac="full", ac_every=3)  # 16 layers: blocks 2, 5, ..., 14 checkpointed; block 15 not
    L, step = job.model.num_layers, Step(job)
    assert step.last_checkpointed() == (L // 3) * 3 - 1
    moments = _by_label(job)
    blocks = moments["end of forward (cross-entropy)"]
    kept = [
        sum(
            s.bytes
            for s in block_kept_under(job.model, job.train, job.train.loop, i, inputs_cast=step.casts_block_inputs)
        )
        for i in range(L)
    ]
    assert _bytes(blocks, "activations.blocks") == sum(kept)
    j = step.last_checkpointed()
    assert _bytes(moments["backward of the last checkpointed block"], "activations.blocks") == sum(kept[: j + 1])


def test_op_sac_keeps_less_than_none_and_more_than_full():
    acts = {
        ac: _bytes(_by_label(_job(ac=ac))["end of forward (cross-entropy)"], "activations.blocks")
        for ac in ("none", "op", "full")
    }
    assert acts["full"] < acts["op"] < acts["none"]


def test_optimizer_in_backward_holds_one_gradient_and_refuses_accumulation():
    job = _job(optimizer_in_backward=True)
    step = Step(job)
    grads = [t for t in estimate(job).moments[-1].terms if t.key == "grads"]
    assert [t.bytes for t in grads] == [4 * step.local(step.largest_param(), True)]
    with pytest.raises(MemplanError, match="grad-accum 2"):
        estimate(_job(optimizer_in_backward=True, grad_accum=2))


def test_offloaded_activations_stay_as_a_stash_and_the_rest_goes_to_host():
    job = _job(ac="full", offload_activations=True)
    kept = block_kept_under(job.model, job.train, job.train.loop, 0, inputs_cast=Step(job).casts_block_inputs)
    L = job.model.num_layers
    start = _by_label(job)["start of backward (loss gradient)"]
    stash = offload_stash_blocks(job.model, job.train.tokens_per_micro_batch)
    assert _bytes(start, "activations.blocks") == stash * sum(s.bytes for s in kept)
    assert stash == 0  # a llama's final norm packs 5 tensors after the last block: measured (calibrate.offload)
    outside = sum(s.bytes for s in offloaded_outside(job.model, job.train))
    assert estimate(job).host_bytes == L * sum(s.bytes for s in offloaded(kept)[1]) + outside
    assert any("offloading" in n for n in estimate(job).notes)


def test_the_plain_loop_carries_no_notes():
    assert estimate(_job()).notes == ()


def test_the_header_names_each_convention_and_its_origin():
    from memplan.loop import in_force

    resolved = in_force(_job(recipe="torchtitan", ac="full").train)
    origins = {c.setting: c.origin for c in resolved.conventions + resolved.elsewhere}
    assert origins["ac"] == "given" and origins["logits"] == "recipe torchtitan"
    assert origins["reshard_after_forward"] == "recipe torchtitan"
    assert resolved.describe().startswith("recipe torchtitan: logits freed")


def test_torchtitan_holds_only_the_head_unit_unsharded():
    plain, titan = (Step(_job(recipe=r, ac="op")) for r in ("plain", "torchtitan"))
    keys = {plain: "fsdp.root_unit", titan: "fsdp.head_unit"}
    root = {s: next(t for t in s.framework.gathered(s, "loss") if t.key == keys[s]) for s in (plain, titan)}
    assert root[plain].bytes == plain.gather_bytes * plain.root_params
    m = titan.job.model  # tied: torchtitan's apply_fsdp puts the embedding in the head's unit
    assert m.tied_embeddings and root[titan].bytes == titan.gather_bytes * (m.head_params() + m.vocab_size * m.hidden)


def test_old_records_load_with_the_plain_loop():
    from calibrate.records import job_from_spec, spec_dict

    spec = spec_dict(_job())
    assert "logits" not in spec["train"] and job_from_spec(spec) == _job()
    assert job_from_spec(spec_dict(_job(recipe="torchtune"))) == _job(recipe="torchtune")


def test_a_vit_refuses_the_decoder_losses():
    request = Request.of(model="vit-large-patch16-224", strategy="ddp", gpus=2, loss="chunked-ce")
    with pytest.raises(MemplanError, match="loss chunked-ce"):
        estimate(build_jobs(request)[1][0])


def test_the_root_unit_moment_holds_its_gradients_unsharded():
    step = Step(_job())
    moment = next(m for m in estimate(_job()).moments if m.label.startswith("backward of the input embedding"))
    (grads,) = [t for t in moment.terms if t.key == "fsdp.root_grads"]
    m = step.job.model
    tied = 2 * m.vocab_size * m.hidden if m.tied_embeddings else 0  # head's, embedding's own, their sum
    assert grads.bytes == step.gather_bytes * (step.root_params + tied)
    assert {t.key for t in moment.terms if t.component.value == "activations"} <= {"logits"}
