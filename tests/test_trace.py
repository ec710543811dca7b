"""``--mode trace`` (calibrate.trace): the emulated job under fake tensors, its recorded events
replayed for reserved; the pieces fast, one tiny job end to end against ``--mode emulate``."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from calibrate import trace  # noqa: E402
from calibrate.alloctrace import Recorder  # noqa: E402
from calibrate.records import Run, make_record  # noqa: E402
from memplan.allocator import Alloc, Free, replay  # noqa: E402
from memplan.layout import Layout  # noqa: E402
from memplan.memory import estimate  # noqa: E402
from validation.accuracy_matrix import LLAMA, _job  # noqa: E402

FLOAT_BYTES = 4


def _sizes_live(events) -> list[int]:
    """The bytes live after each event."""
    sizes, live, out = {}, 0, []
    for e in events:
        if isinstance(e, Alloc):
            sizes[e.id] = e.size
            live += e.size
        else:
            live -= sizes.pop(e.id)
        out.append(live)
    return out


def test_a_resized_storage_is_a_free_then_an_allocation():
    # FSDP2 reshards with storage.resize_(0) and gathers into the same storage again
    with Recorder() as rec:
        t = torch.empty(1024)
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(2048 * FLOAT_BYTES)
        t.add_(0)  # seen again: no new event
    del t
    kinds = [type(e).__name__ for e in rec.events]
    assert kinds == ["Alloc", "Free", "Alloc", "Free"]
    assert [e.size for e in rec.events if isinstance(e, Alloc)] == [1024 * FLOAT_BYTES, 2048 * FLOAT_BYTES]
    assert torch.UntypedStorage.resize_ is not None and "resize_" in torch.UntypedStorage.resize_.__name__


def test_resize_is_unwrapped_after_recording():
    before = torch.UntypedStorage.resize_
    with Recorder():
        assert torch.UntypedStorage.resize_ is not before
    assert torch.UntypedStorage.resize_ is before


def test_fake_tensors_are_recorded_with_their_sizes_and_no_bytes():
    from torch._subclasses import FakeTensorMode

    n = 1 << 28  # a 1 GiB fp32 tensor, never allocated
    with FakeTensorMode(), Recorder() as rec:
        a = torch.empty(n)
        b = a * 2  # a new storage
        del b
        c = a.view(2, -1)  # a view: no allocation
    assert isinstance(c, torch.Tensor)
    allocs = [e for e in rec.events if isinstance(e, Alloc)]
    assert [e.size for e in allocs] == [n * FLOAT_BYTES, n * FLOAT_BYTES]
    assert max(_sizes_live(rec.events)) == 2 * n * FLOAT_BYTES
    assert isinstance(rec.events[-1], Free)
    result = replay(rec.events)
    assert result.peak_requested_bytes == 2 * n * FLOAT_BYTES


def test_the_replay_starts_from_the_storages_live_after_setup_allocated_afresh():
    # built whole (0: 100 B), sharded (1: 25 B), the whole freed; then a step (2) on the shard
    events = [Alloc(0, 100), Alloc(1, 25), Free(0), Alloc(2, 50), Free(2)]
    assert trace.after_setup(events, 3) == [Alloc(1, 25), Alloc(2, 50), Free(2)]
    assert trace.after_setup(events, 0) == events
    assert replay(trace.after_setup(events, 3)).peak_requested_bytes == 75


def _tiny(**kwargs):
    return _job(replace(LLAMA, num_layers=2), strategy="fsdp-full-shard", precision="mixed-bf16", gpus=4, **kwargs)


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda j: replace(j, layout=Layout(cp=2)), "--cp 2"),
        (lambda j: replace(j, layout=Layout(tp=2), plan=replace(j.plan, strategy="ddp")), "under ddp"),
        (lambda j: replace(j, train=replace(j.train, compile=True)), "torch.compile"),
        (lambda j: replace(j, plan=replace(j.plan, strategy="zero3")), "zero3"),
        (lambda j: replace(j, train=replace(j.train, finetune="lora")), "--finetune lora"),
    ],
)
def test_what_it_cannot_trace_is_refused_in_one_line(change, words):
    try:
        job = change(_tiny())
    except Exception as exc:  # a layout the job itself refuses: nothing to trace
        pytest.skip(f"not a valid job: {exc}")
    reason = trace.refusal(job)
    assert reason is not None and words in reason and "\n" not in reason
    with pytest.raises(trace.Unsupported, match="--mode trace"):
        trace.run(job)


def test_a_trace_run_makes_the_record_every_mode_makes():
    run = Run(job=_tiny(), mode="trace", steps=2, warmup=1)
    measurement = {"device": trace.DEVICE, "torch_version": torch.__version__, "peak_allocated_bytes": 1}
    record = make_record(run, status="ok", measurement=measurement, error=None, wall_s=1.0)
    assert record["mode"] == "trace" and record["estimate"]["allocated_bytes"] > 0
    assert Run.from_dict(record).key == run.key


@pytest.mark.slow
def test_a_tiny_trace_agrees_with_emulate_on_peak_allocated():
    from calibrate import launch

    job = _tiny(ac="full")
    real = launch.emulate(job, world_size=4, steps=2, warmup=1)
    traced = trace.run(job, steps=2, warmup=1)
    # 16 bytes apart: emulate's device mesh tensor (int64, CPU-resident on a GPU too), which
    # trace mode builds outside the fake mode and so outside the tracker
    assert traced.peak_allocated_bytes == pytest.approx(real.peak_allocated_bytes, abs=64)
    assert traced.phase == real.phase
    for category, nbytes in real.categories.items():
        assert traced.categories[category] == pytest.approx(nbytes, abs=64)
    assert traced.peak_reserved_bytes >= traced.peak_allocated_bytes


@pytest.mark.slow
def test_a_tiny_fsdp_by_tp_trace_equals_the_same_job_on_real_tensors():
    """FSDP2 2 × TP 2 (torchtitan's plan, SP, loss parallel, full AC), and TP 2 alone (FSDP2
    over a dp mesh of one, as torchtitan): the trace and ``--mode emulate`` (the same wrapping on
    real tensors over the fake process group) give the same peak, to emulate's 16-byte mesh tensor."""
    from calibrate import launch

    for gpus in (4, 2):
        job = replace(_tiny(ac="full"), layout=Layout(tp=2))
        job = replace(job, cluster=replace(job.cluster, gpus=gpus, gpus_per_node=gpus))
        traced = trace.run(job, steps=2, warmup=1)
        real = launch.emulate(job, world_size=gpus, steps=2, warmup=1)
        # 16 bytes apart: emulate's device-mesh tensor, built outside the fake mode in trace
        assert traced.peak_allocated_bytes == pytest.approx(real.peak_allocated_bytes, abs=64)
        for category, nbytes in real.categories.items():
            assert traced.categories[category] == pytest.approx(nbytes, abs=64)


def test_a_records_layout_round_trips_and_a_plain_job_keeps_its_old_key():
    from calibrate.records import describe, job_from_spec, spec_dict

    plain = _tiny()
    assert "layout" not in spec_dict(plain)  # records made before layouts keep their run keys
    tp = replace(plain, layout=Layout(tp=2))
    spec = spec_dict(tp)
    assert spec["layout"] == {"tp": 2}
    assert job_from_spec(spec).layout == Layout(tp=2)
    assert "TP 2" in describe(spec, "trace")


def test_emulate_and_local_refuse_a_layout_they_would_not_run():
    from calibrate import runner

    run = Run(job=replace(_tiny(), layout=Layout(cp=2)), mode="emulate", steps=2, warmup=1)
    outcome = runner.execute(run)
    assert outcome["status"] == "failed" and "runs DDP, FSDP2 and FSDP2 × TP, not" in outcome["error"]
    run = Run(job=replace(_tiny(), layout=Layout(tp=2)), mode="local", steps=2, warmup=1)
    outcome = runner.execute(run)
    assert outcome["status"] == "failed" and "--mode emulate and trace run TP" in outcome["error"]


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "none"])
def test_a_trace_runs_the_recipes_loop(ac):
    """torchtitan's loop keeps its gradients allocated between steps (zero_grad zeros) and
    computes the loss outside the model, after FSDP's root post-forward: the trace runs that
    loop, so memplan's estimate of the job is the trace's peak (the harness's own loop, which
    freed the gradients and computed the loss in the model, was 7–9 % below it)."""
    tiny = _tiny(ac=ac)
    job = replace(tiny, train=replace(tiny.train, recipe="torchtitan", logits="freed", zero_grad="zeros"))
    traced = trace.run(job, steps=2, warmup=1)
    assert traced.categories["Gradient"] > 0  # kept from the step before
    assert estimate(job).allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.001)


def test_ddp_is_refused_in_one_line():
    # DDP's C++ reducer broadcasts and buckets on real storage: it failed mid-run under fake tensors
    job = replace(_tiny(), plan=replace(_tiny().plan, strategy="ddp"))
    assert "use --mode emulate" in trace.refusal(job)


def test_an_emulated_rank_built_on_the_meta_device_measures_what_the_whole_build_does(monkeypatch):
    """An emulated FSDP2 rank on CUDA builds its model on the meta device and materializes its
    shards (``measure._builds_on_meta``, as torchtitan): forced here on CPU, the measured step's
    peak and categories are the whole build's, byte for byte."""
    from calibrate import launch, measure

    job = _tiny(ac="full")
    whole = launch.emulate(job, world_size=4, steps=2, warmup=1)
    monkeypatch.setattr(measure, "_builds_on_meta", lambda job, **kwargs: True)
    meta = launch.emulate(job, world_size=4, steps=2, warmup=1)
    assert (meta.peak_allocated_bytes, meta.categories) == (whole.peak_allocated_bytes, whole.categories)
