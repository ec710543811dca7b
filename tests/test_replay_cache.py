"""The replay's caches (memplan.alloctrace's trace shapes, totals.fits's stage-by-stage check,
the sweep's per-group caches, the answers kept on disk between processes) give the answers of the
uncached path."""

import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from memplan import alloctrace, grid, replaycache, totals
from memplan.allocator import DEFAULT_CONF, AllocConf, replay
from memplan.inputs import build_jobs
from memplan.layout import Layout
from memplan.memory import Step
from memplan.parallel import pipeline
from memplan.parallel.step import RankStep


def _uncached_excess(step, conf: AllocConf = DEFAULT_CONF) -> int:
    result = replay(alloctrace.step_trace(step), conf)
    return max(0, result.peak_reserved_bytes - result.peak_allocated_bytes)


@pytest.mark.parametrize(
    "inputs",
    [
        dict(ac="full", ac_every=2),
        dict(ac="selective", ac_every=3, finetune="frozen:2"),
        dict(ac="full", ac_every=2, finetune="lora"),
    ],
)
def test_a_shape_reads_each_block_as_its_own_index_does(inputs):
    """The shape reads one block of each kind; every block's own kept and transient sizes agree."""
    _, jobs = build_jobs(model="llama-2-7b", gpus=8, gpu="h100-sxm", **inputs)
    for job in jobs:
        step = Step(job)
        shape = alloctrace.trace_shape(step)
        L = job.model.num_layers
        assert shape.kept == tuple(tuple(s.bytes for s in step.kept(i)) for i in range(L))
        assert shape.transient == tuple(tuple(t.bytes for t in step.transient_terms(i)) for i in range(L))


def _count_replays(monkeypatch) -> list:
    """The shapes ``alloctrace`` replays from now on (its answers held, read or sent not counted)."""
    made, replay_here = [], alloctrace._replay

    def counted(shape, conf):
        made.append(shape)
        return replay_here(shape, conf)

    monkeypatch.setattr(alloctrace, "_replay", counted)
    return made


def test_middle_pipeline_stages_share_one_replay_which_is_each_ones_own(monkeypatch):
    _, jobs = build_jobs(model="llama-2-7b", gpus=64, gpu="h100-sxm", ac="full", strategy="fsdp-full-shard")
    job = replace(jobs[0], layout=Layout(tp=2, pp=8, pp_microbatches=32))
    stages = pipeline.stages(job.layout, job.model.num_layers)
    steps = [RankStep(job, s) for s in stages]
    shapes = {alloctrace.trace_shape(s) for s in steps}
    assert len(shapes) < len(stages)  # the middle stages differ only in the micro-batches in flight
    alloctrace.forget_answers()
    replays = _count_replays(monkeypatch)
    assert [alloctrace.excess_bytes(s) for s in steps] == [_uncached_excess(s) for s in steps]
    assert len(replays) == len(shapes)


def _clear() -> None:
    for cached in (totals.final, totals.bound, alloctrace.reserved):
        cached.cache_clear()
    alloctrace.forget_answers()


def _pipelined(gpu_mem: float, pp: int, micro: int):
    _, jobs = build_jobs(model="llama-2-7b", gpus=64, gpu_mem=gpu_mem, strategy="fsdp-full-shard")
    job = jobs[0].with_(micro_batch=micro, activation_checkpointing="selective")
    return replace(job, layout=Layout(tp=2, pp=pp, pp_microbatches=4 * pp))


@pytest.mark.parametrize(("pp", "micro"), [(4, 1), (4, 4), (8, 2)])
def test_fits_stage_by_stage_is_the_replayed_totals_answer(pp, micro):
    """On memory that fits the replayed total, memory between the bound's and the replayed
    total's (the stage-by-stage check stops at a stage over it), and memory under the bound."""
    job = _pipelined(80, pp, micro)
    low, high = totals.bound(job).total_bytes, totals.final(job).total_bytes
    assert low < high
    fraction = job.cluster.usable_bytes / job.cluster.gpu_mem_bytes
    answers = []
    for total in (high + 2**20, (low + high) // 2, low - 2**30):
        squeezed = _pipelined(total / fraction / 2**30, pp, micro)
        _clear()
        answers.append((totals.bound(squeezed).fits, totals.fits(squeezed)))
        assert totals.fits(squeezed) == totals.final(squeezed).fits
    assert answers == [(True, True), (True, False), (False, False)]


def test_a_sweep_asked_again_replays_nothing_and_gives_the_same_rows(monkeypatch):
    kwargs = dict(params=[1e9, 3e9], gpus=[1, 8], micro_batch=[1, 2], seq_len=[512, 1024], gpu="h100-sxm")
    _clear()
    replays = _count_replays(monkeypatch)
    first = grid.sweep(**kwargs)
    made, misses = len(replays), totals.final.cache_info().misses
    again = grid.sweep(**kwargs)
    assert made and (len(replays), totals.final.cache_info().misses) == (made, misses)
    assert first.equals(again)


# -- answers kept on disk (memplan.replaycache) ---------------------------------------------------


def _gpt2_steps() -> list[Step]:
    _, jobs = build_jobs(model="gpt2", gpus=2, gpu="a100-80gb", seq_len=512, micro_batch=2)
    return [Step(job) for job in jobs]


@pytest.fixture
def disk(tmp_path, monkeypatch) -> Path:
    """The answers kept under a folder of this test's own."""
    monkeypatch.setenv(replaycache.ENV, str(tmp_path))
    alloctrace.forget_answers()
    yield tmp_path
    alloctrace.forget_answers()


def test_an_answer_kept_is_read_back_by_a_later_process_without_a_replay(disk, monkeypatch):
    steps = _gpt2_steps()
    first = [alloctrace.excess_bytes(s) for s in steps]
    assert first == [_uncached_excess(s) for s in steps]
    shapes = {alloctrace.trace_shape(s) for s in steps}
    assert len(list(disk.glob("replay-*/*"))) == len(shapes)

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed although its answer was kept")

    alloctrace.forget_answers()  # as a new process starts
    monkeypatch.setattr(alloctrace, "replay", no_replay)
    assert [alloctrace.excess_bytes(s) for s in steps] == first


def test_another_key_in_the_same_file_or_a_broken_file_is_a_miss_never_a_number(disk):
    shape = alloctrace.trace_shape(_gpt2_steps()[0])
    key, other = (shape, DEFAULT_CONF), (shape, AllocConf(expandable_segments=True))
    replaycache.store(key, 123)
    assert replaycache.load(key) == 123
    path = replaycache._path(key)
    path.write_text(f"456\n{other!r}")  # another key whose file name met this one's
    assert replaycache.load(key) is None
    path.write_text("not a number\n" + repr(key))
    assert replaycache.load(key) is None


@pytest.mark.parametrize("setting", ["none", "NONE", ""])
def test_none_keeps_nothing(setting, monkeypatch, tmp_path):
    monkeypatch.setenv(replaycache.ENV, setting)
    monkeypatch.chdir(tmp_path)
    assert replaycache.cache_root() is None
    replaycache.store(("key",), 1)
    assert replaycache.load(("key",)) is None
    assert not any(tmp_path.iterdir())


def test_a_folder_that_cannot_be_written_is_passed_over(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(replaycache.ENV, str(blocked))  # a file where the folder would go
    replaycache.store(("key",), 1)
    assert replaycache.load(("key",)) is None
    alloctrace.forget_answers()
    step = _gpt2_steps()[0]
    assert alloctrace.excess_bytes(step) == _uncached_excess(step)


def test_a_write_that_fails_midway_leaves_nothing_behind(disk, monkeypatch):
    def full(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(replaycache.os, "replace", full)
    replaycache.store(("key",), 1)
    assert [p for p in disk.rglob("*") if p.is_file()] == []
    assert replaycache.load(("key",)) is None


def test_the_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(replaycache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert replaycache.cache_root() == tmp_path / "memplan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert replaycache.cache_root() == tmp_path / ".cache" / "memplan"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: a relative one is ignored
    assert replaycache.cache_root() == tmp_path / ".cache" / "memplan"


def test_edited_replay_code_reads_none_of_the_old_answers(monkeypatch, tmp_path):
    """The folder is named by the sources that turn a shape into its answer: a copy of them gives
    the same name, one edited byte another."""
    here = Path(replaycache.__file__).parent
    for name in replaycache._SOURCES:
        (tmp_path / name).write_bytes((here / name).read_bytes())
    root = tmp_path / "cache"
    replaycache._folder.cache_clear()
    installed = replaycache._folder(root)
    monkeypatch.setattr(replaycache, "__file__", str(tmp_path / "replaycache.py"))
    replaycache._folder.cache_clear()
    assert replaycache._folder(root) == installed
    edited = tmp_path / replaycache._SOURCES[1]
    edited.write_bytes(edited.read_bytes() + b"# edited\n")
    replaycache._folder.cache_clear()
    assert replaycache._folder(root) != installed
    replaycache._folder.cache_clear()


def test_a_shape_names_the_same_file_in_every_process(disk):
    """The file name is the key's hash(), which Python salts for str and bytes but not for the
    ints, bools, floats and tuples of a trace shape and an AllocConf: processes started with two
    hash seeds name it as this one does."""
    code = (
        "from memplan import alloctrace, replaycache\n"
        "from memplan.allocator import DEFAULT_CONF\n"
        "from memplan.inputs import build_jobs\n"
        "from memplan.memory import Step\n"
        "_, jobs = build_jobs(model='gpt2', gpus=2, gpu='a100-80gb', seq_len=512, micro_batch=2)\n"
        "print(replaycache._path((alloctrace.trace_shape(Step(jobs[0])), DEFAULT_CONF)).name)"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    mine = replaycache._path((alloctrace.trace_shape(_gpt2_steps()[0]), DEFAULT_CONF)).name
    assert names == {mine}


def test_the_main_job_prints_the_same_from_a_cold_and_a_warm_folder(tmp_path):
    """Two processes of `memplan estimate`: the first replays and keeps its answers, the second
    reads them; the same table."""
    env = {**os.environ, replaycache.ENV: str(tmp_path)}
    args = [sys.executable, "-m", "memplan.cli", "estimate", "--model", "gpt2", "--gpus", "2", "--gpu-mem", "24"]
    cold = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    kept = sorted(tmp_path.glob("replay-*/*"))
    assert kept
    warm = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    assert warm == cold
    assert sorted(tmp_path.glob("replay-*/*")) == kept  # nothing new to keep


def _rows() -> list:
    """An estimate's rows: GPT-2 under every strategy on 8 GPUs (seven trace shapes)."""
    return build_jobs(model="gpt2", gpus=8, gpu="a100-80gb", seq_len=1024)[1]


def _keys(jobs) -> set:
    return {(alloctrace.trace_shape(Step(j)), DEFAULT_CONF) for j in jobs}


@pytest.fixture
def ahead():
    """No answer held, before and after: each test's replays are its own."""
    _clear()
    yield
    _clear()


@pytest.mark.parametrize("workers", ["2", "3", "16"])
def test_replays_shared_with_forked_workers_answer_as_one_process_does(workers, ahead, monkeypatch):
    """Each row's answer from this process or a worker is the replay's own, and the estimate that
    takes them gives the totals of one that replayed them itself."""
    monkeypatch.setenv(alloctrace.WORKERS_ENV, workers)
    jobs = _rows()
    alloctrace.replay_ahead(jobs)
    keys = _keys(jobs)
    assert set(alloctrace._ANSWERS) == keys and len(keys) == 7
    assert all(excess == alloctrace._replay(*key) for key, excess in alloctrace._ANSWERS.items())
    replays = _count_replays(monkeypatch)
    shared = [totals.final(j).total_bytes for j in jobs]
    assert not replays  # the estimate replays none of them again
    _clear()
    monkeypatch.setenv(alloctrace.WORKERS_ENV, "1")
    alloctrace.replay_ahead(jobs)
    assert not alloctrace._ANSWERS  # one worker: nothing forked, nothing found ahead
    assert [totals.final(j).total_bytes for j in jobs] == shared
    assert len(replays) == 7


@pytest.fixture
def dying_workers(ahead, monkeypatch):
    """Two workers at most, and each fails before it sends an answer."""
    parent, replay_here = os.getpid(), alloctrace._replay

    def fails_in_a_worker(shape, conf):
        if os.getpid() != parent:
            raise MemoryError("the worker is gone")
        return replay_here(shape, conf)

    monkeypatch.setenv(alloctrace.WORKERS_ENV, "2")
    monkeypatch.setattr(alloctrace, "_replay", fails_in_a_worker)


def test_a_worker_that_dies_costs_its_replays_here_never_a_number(dying_workers):
    """A worker that fails sends nothing: its shapes are replayed here when asked."""
    jobs = _rows()
    alloctrace.replay_ahead(jobs)
    assert 0 < len(alloctrace._ANSWERS) < len(_keys(jobs))  # this process's share only
    got = [alloctrace.excess_bytes(Step(j)) for j in jobs]
    assert got == [_uncached_excess(Step(j)) for j in jobs]


def test_no_worker_is_forked_beside_other_threads_or_where_one_is_asked_for(monkeypatch):
    monkeypatch.setenv(alloctrace.WORKERS_ENV, "4")
    assert alloctrace._workers() == 4
    monkeypatch.setenv(alloctrace.WORKERS_ENV, "1")
    assert alloctrace._workers() == 1
    monkeypatch.delenv(alloctrace.WORKERS_ENV)
    assert alloctrace._workers() == len(os.sched_getaffinity(0))
    waiting = threading.Event()
    thread = threading.Thread(target=waiting.wait)
    thread.start()
    try:  # a notebook kernel's threads: a forked child would hold none of their locks
        monkeypatch.setenv(alloctrace.WORKERS_ENV, "4")
        assert alloctrace._workers() == 1
    finally:
        waiting.set()
        thread.join()


def test_where_no_worker_can_be_forked_its_share_is_replayed_here(ahead, monkeypatch):
    def no_process():
        raise BlockingIOError(11, "Resource temporarily unavailable")  # fork's EAGAIN

    monkeypatch.setenv(alloctrace.WORKERS_ENV, "3")
    monkeypatch.setattr(alloctrace.os, "fork", no_process)
    jobs = _rows()
    alloctrace.replay_ahead(jobs)
    assert set(alloctrace._ANSWERS) == _keys(jobs)
    assert all(excess == alloctrace._replay(*key) for key, excess in alloctrace._ANSWERS.items())


def test_a_replay_begun_later_in_a_worker_is_taken_when_asked(ahead, monkeypatch, tmp_path):
    """``replay_later``'s worker keeps its answer on disk and sends it; the estimate's what-if
    takes it (no replay here) and it is the replay's own."""
    monkeypatch.setenv(alloctrace.WORKERS_ENV, "2")
    monkeypatch.setenv(replaycache.ENV, str(tmp_path))
    job = _rows()[1]
    conf = AllocConf(expandable_segments=True)
    alloctrace.replay_later(job, conf)
    (key,) = alloctrace._PENDING
    replays = _count_replays(monkeypatch)
    assert alloctrace.excess_bytes(Step(job), conf) == _uncached_excess(Step(job), conf)
    assert not alloctrace._PENDING and not replays
    assert replaycache.load(key) == alloctrace._ANSWERS[key]


def test_a_worker_begun_later_and_never_asked_is_stopped(ahead, monkeypatch):
    """The next one stops it, and so does the process's exit (``_stop_pending``): none is left."""
    monkeypatch.setenv(alloctrace.WORKERS_ENV, "2")
    first, second = _rows()[:2]
    conf = AllocConf(expandable_segments=True)
    alloctrace.replay_later(first, conf)
    ((pid, _),) = alloctrace._PENDING.values()
    alloctrace.replay_later(second, conf)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # stopped and reaped
    ((pid, _),) = alloctrace._PENDING.values()
    alloctrace._stop_pending()
    assert not alloctrace._PENDING
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_worker_begun_later_that_dies_costs_its_replay_here(dying_workers):
    job, conf = _rows()[1], AllocConf(expandable_segments=True)
    alloctrace.replay_later(job, conf)
    assert alloctrace._PENDING
    assert alloctrace.excess_bytes(Step(job), conf) == _uncached_excess(Step(job), conf)


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_the_main_job_prints_the_same_with_workers_and_without(fmt):
    """From the command line as a user runs it: workers (the rows', the what-if's, taken by the
    table and stopped unread under CSV) or none."""
    argv = [sys.executable, "-m", "memplan.cli", "estimate", "--params", "13e9", "--gpus", "8", "--gpu-mem", "80"]
    printed = [
        subprocess.run(
            [*argv, "--format", fmt],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, alloctrace.WORKERS_ENV: workers},
        ).stdout
        for workers in ("1", "3")
    ]
    assert printed[0] == printed[1]
