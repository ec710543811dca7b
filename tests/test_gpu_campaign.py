"""The GPU campaign's plan, its record writing and resume (validation.campaign), its child's
pieces that run on CPU (chunked loss, per-op AC, snapshot conversion), and the CLI's dry run.
No GPU numbers: the runs here are CPU runs of tiny models, or outcomes without a measurement."""

import gzip
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from calibrate import alloctrace, records
from memplan.allocator import Alloc, Free
from memplan.errors import MemplanError
from memplan.memory import estimate
from memplan.specs import ModelSpec
from validation import campaign
from validation.campaign import BUDGET_S, Case, design, estimated_s, make_case, sweep, timeout_s

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelSpec(
    name="tiny", arch="llama", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, vocab_size=256
)
TINY_KW = dict(gpu="h100-sxm", device="cpu", model=TINY, seq_len=32, micro_batch=2, strategy="single", world=1)


@pytest.fixture(scope="module", params=["h100-sxm", "h200"])
def plan(request):
    return request.param, design(request.param)[0]


def test_plan_covers_every_axis_of_the_issue(plan):
    _, cases = plan
    jobs = [c.run.job for c in cases]
    trains = [j.train for j in jobs]
    assert 50 <= len(cases) <= 90
    assert len({c.name for c in cases}) == len(cases)
    assert {j.plan.strategy for j in jobs} == {
        "single",
        "ddp",
        "fsdp-full-shard",
        "fsdp-shard-grad-op",
        "fsdp-hybrid-shard",
    }
    assert {j.cluster.gpus for j in jobs} == {1, 8, 64}
    assert {t.precision for t in trains} == {"fp32", "amp-bf16", "mixed-bf16", "bf16"}
    assert {t.activation_checkpointing for t in trains} == {"none", "selective", "op", "full"}
    assert {t.attention for t in trains} == {"sdpa", "eager"}
    assert {c.sdpa_backend for c in cases} == {"default", "flash", "efficient"}
    assert {t.optimizer_impl for t in trains} == {"foreach", "fused"}
    assert {t.logits for t in trains} == {"kept", "freed"}
    assert {t.loss for t in trains} == {"ce", "chunked-ce"}
    assert {t.compile for t in trains} == {False, True}
    llamas = [j.model.num_params for j in jobs if j.model.arch == "llama"]
    assert min(llamas) < 0.6e9 and max(llamas) > 7e9
    assert {j.model.arch for j in jobs} == {"llama", "gpt2", "vit"}
    assert 3 <= sum(c.snapshot for c in cases) <= 6
    # each strategy at world 8 or 64 where it shards, and crossed with every precision it runs natively
    by_strategy = {s: {t.precision for j, t in zip(jobs, trains) if j.plan.strategy == s} for s in ("ddp", "single")}
    assert by_strategy == {"ddp": {"fp32", "amp-bf16", "bf16"}, "single": {"fp32", "amp-bf16", "bf16"}}


def test_plan_fits_the_budget_and_layer_scales_what_does_not_fit(plan):
    gpu, cases = plan
    total = sum(estimated_s(c) for c in cases) + sum(campaign.probe_estimated_s(p) for p in campaign.PROBES)
    assert total <= BUDGET_S
    for case in cases:
        job = case.run.job
        assert job.cluster.gpu_name == gpu and job.train.device == "cuda" and case.run.mode == "emulate"
        assert case.run.layers_scaled == (estimate(job).total_bytes > job.cluster.usable_bytes)
        assert estimated_s(case) < timeout_s(case) <= campaign.MAX_TIMEOUT_S
        assert not (case.snapshot and case.run.layers_scaled)  # one trace, one model
    assert any(c.run.layers_scaled for c in cases)


def test_case_round_trips_through_its_json():
    case = make_case("loop", gpu="h200", loss="chunked-ce", logits="freed", sdpa_backend="flash", snapshot=True)
    again = Case.from_dict(json.loads(json.dumps(case.to_dict())))
    assert again == case


def test_the_first_slice_answers_the_issues_questions_in_order_within_eight_minutes(plan):
    _, cases = plan
    items = campaign.ordered(cases)
    where = campaign.slices(items, campaign.SLICE_S)
    first = [item for item, k in zip(items, where) if k == 0]
    assert sum(campaign._planned(i)[1] for i in first) <= 8 * 60
    head = first[: len(campaign.FIRST) + len(campaign.PROBES)]
    # 1. the base FSDP2 run with the allocator's history, then timed
    assert head[0].snapshot and head[0].run.job.plan.strategy == "fsdp-full-shard" and head[0].axis == "snapshot"
    assert head[1].name == cases[1].name and not head[1].snapshot
    # 2. the context and cuBLAS probes
    assert head[2:4] == list(campaign.PROBES)
    runs = head[4:]
    strategies = [c.run.job.plan.strategy for c in runs]
    # 3. DDP and single, 4. flash and efficient SDPA, 5. compile, 6. full AC and LoRA
    assert strategies.index("ddp") < strategies.index("single")
    backends = [c.sdpa_backend for c in runs]
    assert max(strategies.index("single"), strategies.index("ddp")) < backends.index("flash")
    assert backends.index("flash") < backends.index("efficient")
    compiled = next(i for i, c in enumerate(runs) if c.run.job.train.compile)
    full_ac = next(i for i, c in enumerate(runs) if c.run.job.train.activation_checkpointing == "full")
    lora = next(i for i, c in enumerate(runs) if c.run.job.train.finetune == "lora")
    assert backends.index("efficient") < compiled < full_ac < lora
    assert runs[lora].run.workload == "hf" and not runs[lora].run.layers_scaled


def test_dry_run_lists_every_run_and_the_total():
    from benchmarks.gpu_campaign import main

    result = CliRunner().invoke(main, ["--dry-run", "--gpu", "h100-sxm"])
    assert result.exit_code == 0, result.output
    cases, _ = design("h100-sxm")
    for case in cases:
        assert case.name in result.output
    total = sum(estimated_s(c) for c in cases) + sum(campaign.probe_estimated_s(p) for p in campaign.PROBES)
    assert f"{len(cases)} runs + 2 probes: {total:.0f} s estimated" in result.output
    assert "within the 25-minute budget" in result.output
    assert "slice 1: " in result.output and "min planned (calls of 480 s)" in result.output
    only = CliRunner().invoke(main, ["--dry-run", "--gpu", "h100-sxm", "--only", "^snapshot/"])
    assert only.exit_code == 0 and only.output.count("snapshot/") == 4 and "probe/" not in only.output


def _outcome(status: str) -> dict:
    return {"status": status, "measurement": None, "error": f"{status}: injected"}


def test_sweep_records_each_run_as_it_ends_and_resumes(tmp_path):
    cases = [make_case(f"t{i}", **TINY_KW, precision=p) for i, p in enumerate(("fp32", "bf16", "amp-bf16"))]
    path = tmp_path / campaign.RECORDS
    seen = []

    def run_case(case, out_dir, timeout):
        # every earlier run is on disk before this one starts
        seen.append([r["campaign"]["name"] for r in records.read([path])] if path.exists() else [])
        if case is cases[0]:
            return _outcome("oom")
        if case is cases[1]:
            return _outcome("timeout")
        raise OSError("the driver itself failed")

    probes = []
    progress = sweep(
        cases,
        tmp_path,
        gpu="h100-sxm",
        run_case=run_case,
        run_probe=lambda p, t: probes.append(p) or _outcome("failed"),
        say=lambda line: None,
    )
    assert probes == list(campaign.PROBES)
    assert seen == [[], [cases[0].name], [cases[0].name, cases[1].name]]
    got = records.read([path])
    assert [(r["campaign"]["name"], r["status"]) for r in got] == [
        (cases[0].name, "oom"),
        (cases[1].name, "timeout"),
        (cases[2].name, "failed"),
    ]
    assert got[2]["error"] == "OSError: the driver itself failed"
    assert got[0]["estimate"]["reserved_bytes"] >= got[0]["estimate"]["allocated_bytes"]
    # the probes run after the first PROBES_AFTER cases
    names = [c.name for c in cases]
    after = campaign.PROBES_AFTER
    assert progress.done == names[:after] + [f"probe/{p}" for p in campaign.PROBES] + names[after:]
    # resume: nothing recorded runs again; a new case does
    extra = make_case("t9", **TINY_KW, precision="fp32", attention="eager")
    again = sweep(
        [*cases, extra],
        tmp_path,
        gpu="h100-sxm",
        resume=True,
        run_case=lambda c, o, t: _outcome("failed"),
        run_probe=lambda p, t: pytest.fail("a recorded probe ran again"),
        say=lambda line: None,
    )
    assert again.done == [extra.name] and len(again.skipped) == 2 + len(cases)
    # a budget that holds nothing starts nothing
    held = sweep(cases, tmp_path / "b", gpu="h100-sxm", budget_s=0.0, run_case=pytest.fail, say=lambda line: None)
    assert held.done == [] and len(held.left) == 2 + len(cases)


def test_a_budget_starts_a_run_while_twice_its_plan_is_left_and_caps_its_timeout(tmp_path):
    import time

    cases = [make_case(f"t{i}", **TINY_KW, precision="fp32") for i in range(2)]
    planned = estimated_s(cases[0])
    given = []
    budget = campaign.START_FACTOR * planned + 0.1

    def run_case(case, out_dir, timeout):
        given.append(timeout)
        time.sleep(0.2)
        return _outcome("timeout")

    progress = sweep(
        cases, tmp_path, gpu="h100-sxm", probes=(), budget_s=budget, run_case=run_case, say=lambda line: None
    )
    # the first starts (twice its plan is left), to be killed at the call's end at the latest;
    # the second, planned the same, no longer has twice its plan left once the first took 0.2 s
    assert progress.done == [cases[0].name] and progress.left == [cases[1].name]
    assert given[0] <= budget and given[0] <= timeout_s(cases[0])


def test_chunked_ce_is_torchtunes_loss():
    import torch

    from calibrate.loops import _torchtune_loss_class
    from calibrate.measure import chunked_ce

    torch.manual_seed(0)
    logits = torch.randn(2, 16, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 16))
    labels[0, :3] = -100
    chunks = list(logits.chunk(4, dim=1))
    expected = _torchtune_loss_class()(num_output_chunks=4)(chunks, labels)
    assert torch.equal(chunked_ce(chunks, labels), expected)


@pytest.mark.slow  # importing torch's partitioner (the save list) takes ~5 s
def test_op_checkpoint_recomputes_to_the_same_gradients():
    import torch

    from calibrate.workloads import Block, op_checkpoint, rotary_tables

    torch.manual_seed(0)
    block = Block(TINY, attention="sdpa", selective_ac=False)
    x = torch.randn(2, 8, TINY.hidden, requires_grad=True)
    cos, sin = rotary_tables(8, TINY.head_size, "cpu")
    block(x, cos, sin).sum().backward()
    plain = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    op_checkpoint(block)(x, cos, sin).sum().backward()
    assert all(torch.allclose(a, b.grad) for a, b in zip(plain, block.parameters()))


def test_snapshot_events_in_the_replay_form(tmp_path):
    # the device_traces structure torch.cuda.memory._snapshot() returns (TraceEntry), with a
    # free requested on one stream and completed later, a second stream, and a free of a
    # block allocated before the history started
    trace = [
        {"action": "free_completed", "addr": 7, "size": 512, "stream": 0},
        {"action": "segment_alloc", "addr": 100, "size": 2097152, "stream": 0},
        {"action": "alloc", "addr": 100, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": 1124, "size": 512, "stream": 55},
        {"action": "free_requested", "addr": 100, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": 100, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": 100, "size": 600, "stream": 0},
        {"action": "free_completed", "addr": 1124, "size": 512, "stream": 55},
    ]
    events = alloctrace.from_snapshot({"segments": [], "device_traces": [trace]})
    assert events == [Alloc(0, 1000, 0), Alloc(1, 512, 1), Free(0), Alloc(2, 600, 0), Free(1)]
    # the replay takes them: at most 1000 (rounded to 1024 by round_size) and 512 live at once
    from memplan.allocator import replay, round_size

    assert replay(events).peak_allocated_bytes == round_size(1000) + round_size(512)
    path = tmp_path / "t.trace.jsonl.gz"
    alloctrace.save(events, path)
    assert alloctrace.load(path) == events
    with gzip.open(path, "rt") as f:
        assert json.loads(f.readline()) == ["a", 0, 1000]  # the first stream's form is unchanged


@pytest.mark.slow
def test_campaign_children_on_cpu_record_ok_failed_and_killed_runs_and_load_as_calibration(tmp_path, monkeypatch):
    """The real child path on CPU: an ok run, one the harness refuses, one killed at its timeout,
    then one more ok run; the records fit into corrections that memplan loads."""
    from calibrate.fit import fit_one, fit_records, observations
    from memplan import calibration

    ok = make_case("cpu", **TINY_KW, precision="fp32", ac="op", logits="freed")
    refused = make_case("cpu", **{**TINY_KW, "strategy": "zero2", "world": 2}, precision="fp32")
    killed = make_case("kill", **TINY_KW, precision="bf16")
    last = make_case(
        "cpu", **{**TINY_KW, "strategy": "fsdp-full-shard", "world": 4}, precision="bf16", loss="chunked-ce"
    )

    def run_case(case, out_dir, timeout):
        return campaign.child_case(case, out_dir, 0.5 if case.axis == "kill" else timeout)

    sweep([ok, refused, killed, last], tmp_path, gpu="h100-sxm", probes=(), run_case=run_case, say=lambda line: None)
    got = records.read([tmp_path / campaign.RECORDS])
    assert [r["status"] for r in got] == ["ok", "failed", "timeout", "ok"]
    assert "DeepSpeed" in got[1]["error"]
    for r in (got[0], got[3]):
        m = r["measurement"]
        assert m["device"] == "cpu" and m["peak_allocated_bytes"] > 0 and m["step_time_s"] > 0
        assert r["campaign"]["torch_version"] == m["torch_version"]
        assert r["campaign"]["device_name"] == "cpu"
    assert got[3]["campaign"]["loss_source"] == "calibrate.measure.chunked_ce"
    # the records are calibrate fit's input, and its corrections load as memplan's
    corrections = tmp_path / "c.corrections.json"
    with pytest.raises(MemplanError, match=r"2 ok record\(s\) of cpu .* 1 more run"):
        fit_records(got, sources=["records.jsonl"])  # 3 records per fitted term
    no_term = fit_one(observations(got), terms=())  # memplan's arithmetic and its held-out band
    calibration.Calibration(corrections=(no_term,), sources=("records.jsonl",)).save(corrections)
    loaded = calibration.load(corrections)
    assert loaded.corrections[0].num_records == 2 and loaded.corrections[0].device == "cpu"
    # where the campaign ships a GPU's corrections, memplan.calibration.shipped finds them
    tables = tmp_path / "tables"
    (tables / "calibration").mkdir(parents=True)
    name = campaign.ship_stem("h100-sxm", "2.11.0+cu130") + ".corrections.json"
    (tables / "calibration" / name).write_text(corrections.read_text())
    monkeypatch.setattr("memplan.catalog.TABLES_DIR", tables)
    found = calibration.shipped("h100-sxm")
    assert found is not None and found.path.endswith(name)
    correction, why = found.for_device("h100-sxm")
    assert correction is None and why == "it was fitted on cpu, not on h100-sxm"  # never taken for the GPU's own
    # CPU records are not shipped as an H100's
    with pytest.raises(MemplanError, match="not h100-sxm records"):
        campaign.ship(tmp_path, tmp_path / "tables")


def test_benchmark_script_runs_from_the_repository_root():
    import subprocess

    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_campaign.py"), "--dry-run", "--gpu", "h200", "--only", "vit"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "model/vit-l-fsdp-w8-mixed-bf16-b32s197" in out.stdout
