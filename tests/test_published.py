"""memplan against published GPU peak-memory figures (../shared/published), where the
published configuration is one memplan expresses. A check at GPU scale, not a fit target:
the tolerance follows each row's trust level as the data set grades it."""

import csv
from pathlib import Path

import pytest

from memplan.api import estimate
from memplan.overheads import reserved_bytes
from memplan.units import GIB

CSV = Path(__file__).resolve().parents[2] / "shared" / "published" / "measured_memory.csv"
TOLERANCE = {"medium-high": 0.05, "medium-low": 0.10, "low": 0.25}

# (substring of the row's source, its strategy text, memplan's flags for that run). FSDP1 with
# use_orig_params=False (these runs) hands the optimizer FlatParameters, whose type is not in
# torch.optim.optimizer._foreach_supported_types: AdamW defaults to its single-tensor loop.
# llama-recipes in Aug 2023 ran transformers 4.31, whose LlamaAttention is eager (matmul,
# softmax; SDPA came to Llama in 4.36): the runs without use_fast_kernels are eager.
_7B_100 = dict(
    model="llama-2-7b",
    seq_len=2048,
    micro_batch=4,
    precision="mixed-bf16",
    ac="full",
    gpus=4,
    gpu="a100-40gb",
    strategy="fsdp-full-shard",
    optimizer_impl="single",
    attention="eager",
)
_TORCHTUNE_3B = dict(
    model="llama-3.2-3b", seq_len=4096, micro_batch=2, precision="bf16", gpus=1, gpu="a100-80gb", strategy="single"
)
EXPRESSIBLE = [
    (
        "issue #120",
        "FSDP1 FULL_SHARD over 16 (2 nodes)",
        dict(
            model="llama-2-70b",
            seq_len=2048,
            micro_batch=1,
            precision="bf16",
            ac="full",
            gpus=16,
            gpu="a100-80gb",
            strategy="fsdp-full-shard",
            optimizer_impl="single",
            attention="eager",
        ),
    ),
    ("issue #100 comment by HamidShojanazeri 2023-08-07 (default attention)", "FSDP1 FULL_SHARD over 4", _7B_100),
    # use_fast_kernels: optimum's BetterTransformer, torch's scaled_dot_product_attention
    ("use_fast_kernels", "FSDP1 FULL_SHARD over 4", _7B_100 | dict(attention="sdpa")),
    # torchtune full_finetune_single_device: a plain loop, no wrapper (the row before compile)
    ("row '+ Packed Dataset'", "single GPU (standard CE loss, eager)", _TORCHTUNE_3B | dict(ac="none")),
    # the rows after it add one technique each (cumulative), as torchtune's recipe sets it
    (
        "row '+ Chunked Cross Entropy'",
        "single GPU (compile + CEWithChunkedOutputLoss)",
        _TORCHTUNE_3B | dict(recipe="torchtune", ac="none", compile=True),
    ),
    (
        "row '+ Fuse optimizer step into backward'",
        "single GPU (compile + chunked CE)",
        _TORCHTUNE_3B | dict(recipe="torchtune", compile=True, optimizer_in_backward=True),
    ),
    (
        "row '+ Activation Offloading'",
        "single GPU (compile + chunked CE)",
        _TORCHTUNE_3B | dict(recipe="torchtune", compile=True, optimizer_in_backward=True, offload_activations=True),
    ),
    (
        "row '+ Activation Checkpointing'",
        "single GPU (compile + chunked CE)",
        _TORCHTUNE_3B | dict(recipe="torchtune", compile=True),
    ),
]
# rows memplan expresses but misses at their tolerance: (source, strategy, flags, what is off)
MISSED = [
    (
        "row '+ Compile'",
        "single GPU (torch.compile, standard CE)",
        _TORCHTUNE_3B | dict(recipe="torchtune", loss="ce", ac="none", compile=True),
        "-19 % (9.6 GiB under); the term that differs from the eager row, which matches, is the compiled "
        "blocks: 19.3 GiB from inductor's saved list measured on CPU, against 28.1 eager",
    ),
    (
        "row '+ 8-bit AdamW'",
        "single GPU (compile + chunked CE)",
        _TORCHTUNE_3B
        | dict(
            recipe="torchtune", compile=True, optimizer_in_backward=True, offload_activations=True, optimizer="adam8bit"
        ),
        "-6.2 % (bitsandbytes' paged 8-bit states, the row notes, may not be what the allocator counts)",
    ),
]


def published_rows():
    if not CSV.exists():
        pytest.skip(f"{CSV} not present")
    return list(csv.DictReader(CSV.open()))


def matching(rows, source, strategy):
    found = [r for r in rows if source in r["source"] and r["strategy"] == strategy]
    assert found, f"no published row for {source} / {strategy}"
    return found


_CASES = [pytest.param(*e, id=e[0]) for e in EXPRESSIBLE] + [
    pytest.param(source, strategy, flags, id=source, marks=pytest.mark.xfail(strict=True, reason=why))
    for source, strategy, flags, why in MISSED
]


def test_every_torchtune_row_is_expressed():
    rows = [r for r in published_rows() if "torchtune" in r["source"]]
    expressed = {(source, strategy) for source, strategy, *_ in EXPRESSIBLE + MISSED}
    assert all(any(s in r["source"] and r["strategy"] == t for s, t in expressed) for r in rows)


@pytest.mark.parametrize("source,strategy,flags", _CASES)
def test_estimate_against_published_peak(source, strategy, flags):
    for row in matching(published_rows(), source, strategy):
        trust = row["notes"].split(".")[0].removeprefix("trust:")
        measured = float(row["measured_gib"]) * GIB
        [est] = estimate(**flags, calibration=None).estimates
        assert est.job.model.num_params == int(row["params"])
        # max_reserved is the allocator's pool (replayed); max_allocated is tensor bytes alone
        predicted = reserved_bytes(est) if "reserved" in row["measure_kind"] else est.allocated_bytes
        assert predicted == pytest.approx(measured, rel=TOLERANCE[trust]), (
            f"{row['model']}: {predicted / GIB:.1f} GiB estimated vs {measured / GIB:.1f} GiB {row['measure_kind']}"
        )


# -- reserved against allocated: the rows that give both for the same run --------------------
# llama-recipes #120 gives max_allocated in the row and max_reserved / peak_active in its notes
# (alt_measure). Both rows miss: torch's peak_active (59 and 52 GiB) is 17 and 10 GiB over its
# max_allocated (42), blocks freed but waiting on another stream's event. FSDP1 (these runs)
# records each unsharded gradient on its post-backward stream (_runtime_utils.py,
# _post_backward_hook: _no_dispatch_record_stream(autograd_computed_grad, _post_backward_stream))
# and rate-limits only all-gathers (_FreeEventQueue, 2 in flight), so the compute stream may run
# ahead of the reduce-scatters for the whole backward: how many gradients wait is the run's
# timing (its inter-node bandwidth), not its configuration (the two rows differ only in the
# optimizer, which runs after backward, and held 17 and 10 GiB). memplan's FSDP is FSDP2,
# which caps the reduce-scatter inputs in flight (reduce_scatter_max_input_buffers, default 1)
# as the synthesized trace does (memplan.alloctrace): it holds 3.3 GiB beyond its tensors
# where these runs held 21 and 16.
_70B = EXPRESSIBLE[0][2]
RESERVED_MISSED = [
    ("'pure_bf16'", _70B, "reserved 45.3 GiB against 63: -28 %"),
    ("'pure_bf16 + anyprecisionAdamW'", _70B, "reserved 45.3 GiB against 58: -22 %"),
]


def test_every_row_that_gives_reserved_is_compared():
    # max_reserved as the row's measure (#100) or in its notes (#120's alt_measure); the
    # Lightning rows give peak allocated only (their reserved is inferred from the text)
    rows = published_rows()
    as_measure = [r for r in rows if r["measure_kind"].startswith("max_reserved")]
    in_notes = [r for r in rows if "max_reserved=" in r["notes"]]
    assert len(as_measure) == 2 and len(in_notes) == 2
    # each by exactly one case of its own (the two #100 rows differ in their attention)
    assert all(sum(s in r["source"] and r["strategy"] == t for s, t, _ in EXPRESSIBLE) == 1 for r in as_measure)
    assert all(sum(r["source"].endswith(f"block {b}") for b, *_ in RESERVED_MISSED) == 1 for r in in_notes)


def _alt_reserved_bytes(row) -> int:
    alt = row["notes"].split("max_reserved=")[1]
    return int(alt.split(" GiB")[0]) * GIB


@pytest.mark.parametrize(
    "block,flags",
    [pytest.param(b, f, marks=pytest.mark.xfail(strict=True, reason=why), id=b) for b, f, why in RESERVED_MISSED],
)
def test_reserved_against_published_reserved(block, flags):
    [row] = [r for r in published_rows() if "issue #120" in r["source"] and r["source"].endswith(f"block {block}")]
    trust = row["notes"].split(".")[0].removeprefix("trust:")
    [est] = estimate(**flags, calibration=None).estimates
    assert reserved_bytes(est) == pytest.approx(_alt_reserved_bytes(row), rel=TOLERANCE[trust])


def test_the_replay_reserves_more_than_the_tensors_where_the_runs_did():
    # the direction both #120 rows show (reserved 1.38-1.50 x allocated); the size is the xfail above
    rows = [r for r in published_rows() if "issue #120" in r["source"]]
    [est] = estimate(**_70B, calibration=None).estimates
    assert all(_alt_reserved_bytes(r) > float(r["measured_gib"]) * GIB for r in rows)
    assert reserved_bytes(est) > est.allocated_bytes


# torchtitan's published Llama-3.1-8B runs (benchmarks/llama3_h100_202412_torchtitan.md in
# pytorch/torchtitan, Dec 2024, Tables 1 and 3: FSDP, local batch 2, seq 8192, selective (op)
# AC, H100 with 96 GB HBM2e): torchtitan logs max_reserved (components/metrics.py
# DeviceMemoryMonitor), so memplan's replayed reserved is what compares; the allocated this
# derives (published reserved × memplan's allocated / reserved) is within the same fraction.
# Not in ../shared/published: outside the data set's trust grades, held to the loop issue's 10 %.
TORCHTITAN_8B = [(8, 82.4), (128, 67.0)]


@pytest.mark.parametrize("gpus,reserved_gib", TORCHTITAN_8B, ids=[f"{g}-gpus" for g, _ in TORCHTITAN_8B])
def test_torchtitan_recipe_against_torchtitans_published_reserved(gpus, reserved_gib):
    flags = dict(model="llama-3.1-8b", gpus=gpus, gpu_mem="96GB", seq_len=8192, micro_batch=2)
    [est] = estimate(**flags, recipe="torchtitan", strategy="fsdp-full-shard", calibration=None).estimates
    assert est.job.train.activation_checkpointing == "op" and est.job.train.logits == "freed"
    assert reserved_bytes(est) == pytest.approx(reserved_gib * GIB, rel=0.10)
