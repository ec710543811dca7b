"""memplan against published GPU peak-memory figures (../shared/published), where the
published configuration is one memplan expresses. A check at GPU scale, not a fit target:
the tolerance follows each row's trust level as the data set grades it."""

import csv
import dataclasses
from pathlib import Path

import pytest

from memplan import catalog
from memplan.api import estimate
from memplan.overheads import reserved_bytes
from memplan.units import GIB

CSV = Path(__file__).resolve().parents[2] / "shared" / "published" / "measured_memory.csv"
TOLERANCE = {"high": 0.05, "medium-high": 0.05, "medium": 0.075, "medium-low": 0.10, "low": 0.25}

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
# Hugging Face's BERT-large runs (perf_train_gpu_one.mdx, Jan 2022: transformers 4.15, torch 1.10,
# one V100 16GB): BertForSequenceClassification with 2 labels, seq 512, the Trainer's loop,
# eager attention (transformers had no sdpa then), adamw_hf (a per-parameter loop: single).
# They are nvidia-smi readings after training: the allocator's pool plus the CUDA context, which
# memplan's total is on one GPU (replayed reserved + tables/cuda_context.csv's V100 1343 MiB).
# The Trainer cleared gradients with model.zero_grad(), torch 1.10's set_to_none=False: zeros.
_BERT_2022 = dict(
    model=dataclasses.replace(catalog.model_preset("bert-large-uncased"), num_labels=2),
    seq_len=512,
    gpus=1,
    gpu="v100-16gb",
    strategy="single",
    recipe="hf-trainer",
    attention="eager",
    optimizer_impl="single",
    zero_grad="zeros",
)
_BERT_GA = _BERT_2022 | dict(micro_batch=1, grad_accum=4)
_BERT_SINGLE = "single GPU (no DDP)"
_LLAMA_70B = dict(
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
)
EXPRESSIBLE = [
    ("issue #120", "FSDP1 FULL_SHARD over 16 (2 nodes)", _LLAMA_70B),
    ("issue #100 comment by HamidShojanazeri 2023-08-07 (default attention)", "FSDP1 FULL_SHARD over 4", _7B_100),
    # use_fast_kernels: optimum's BetterTransformer, torch's scaled_dot_product_attention
    ("use_fast_kernels", "FSDP1 FULL_SHARD over 4", _7B_100 | dict(attention="sdpa")),
    # torchtune full_finetune_single_device, no wrapper: its model returns fp32 logits
    # (recipes.csv logits_upcast) and copies k and v per query head (kv_copies), its _loss_step
    # applies nn.CrossEntropyLoss and dels them
    (
        "row '+ Packed Dataset'",
        "single GPU (standard CE loss, eager)",
        _TORCHTUNE_3B | dict(recipe="torchtune", loss="ce", ac="none"),
    ),
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
    # the second #120 block: AnyPrecisionAdamW with bf16 momentum and variance and no Kahan
    # summation keeps what torch's AdamW keeps for bf16 parameters
    ("block 'pure_bf16 + anyprecisionAdamW'", "FSDP1 FULL_SHARD over 16", _LLAMA_70B),
    ("section 'Gradient Accumulation (bs1, GA4)'", _BERT_SINGLE, _BERT_GA | dict(precision="fp32")),
    ("section 'Gradient Checkpointing (bs1, GA4)'", _BERT_SINGLE, _BERT_GA | dict(precision="fp32", ac="full")),
    ("section 'FP16 + bs1 GA4 + grad ckpt'", _BERT_SINGLE, _BERT_GA | dict(precision="amp-fp16", ac="full")),
    (
        "section 'Adafactor + bs1 GA4 + grad ckpt + fp16'",
        _BERT_SINGLE,
        _BERT_GA | dict(precision="amp-fp16", ac="full", optimizer="adafactor"),
    ),
    (
        "section '8-bit Adam + bs1 GA4 + grad ckpt + fp16'",
        _BERT_SINGLE,
        _BERT_GA | dict(precision="amp-fp16", ac="full", optimizer="adam8bit"),
    ),
]
_BERT_BS4 = (
    "with the 2022 Trainer's zero-filled fp32 gradients (--zero-grad zeros: 1.25 GiB, 8.6-9.9 points of the "
    "16-21 % it missed before) 1.1-1.5 GiB more that grows with the batch (the batch-1 rows are within 5 %) is "
    "not found: the shape scaled down on CPU (eager, seq 512, batch 1 and 4) is within 0.5 % "
    "(validation/records/finetune_matrix_cpu.md), so it is CUDA-side"
)
# rows memplan expresses but misses at their tolerance: (source, strategy, flags, what is off)
_QWEN3_32B = dataclasses.replace(
    catalog.model_preset("qwen3-14b"),
    name="qwen3-32b",
    num_layers=64,
    num_heads=64,
    ffn_hidden=25600,
    head_dim=128,
)
"""Qwen/Qwen3-32B config.json (64 layers, hidden 5120, 64 heads of 128, 8 KV heads, ffn 25600,
vocab 151936, q/k norms, untied): 32,762,123,264 parameters, the row's count."""
MISSED = [
    (
        "llama3_h100_202412_torchtitan.md Table 2 row 'FSDP 8, CP 1'",
        "FSDP 8, CP 1 (context parallel) + torch.compile; NOTE FSDP shards params over the combined dp_shard x cp "
        "mesh = 8 GPUs in every row",
        dict(
            model="llama-3.1-8b",
            seq_len=32768,
            micro_batch=1,
            precision="mixed-bf16",
            ac="full",
            gpus=8,
            gpu="h100-sxm",
            strategy="fsdp-full-shard",
            recipe="torchtitan",
            compile=True,
            float8=True,
        ),
        "-46.6 % (44.8 GiB reserved against 83.9): torchtitan's compiled float8 blocks at 32,768 tokens, "
        "nothing of which is measured at that size here; on an H200 compile alone is -35.6 % at 4,096 tokens "
        "(validation/records/gpu_campaign_h200.md)",
    ),
    (
        "PR #1690 '[Qwen3] Add 32b training configs'",
        "FSDP2 4 x TP 8",
        dict(
            model=_QWEN3_32B,
            seq_len=4096,
            micro_batch=16,
            precision="mixed-bf16",
            ac="full",
            gpus=32,
            gpu="h100-sxm",
            strategy="fsdp-full-shard",
            recipe="torchtitan",
            tp=8,
            sp=True,
        ),
        "+131 % (100.3 GiB reserved against 43.45; 38.6 GiB allocated): the replay's 61.7 GiB beyond the "
        "tensors at TP 8, which real runs of that size do not show",
    ),
    (
        "row '+ Compile'",
        "single GPU (torch.compile, standard CE)",
        _TORCHTUNE_3B | dict(recipe="torchtune", loss="ce", ac="none", compile=True),
        "-7.8 % (47.0 GiB against 51.0; -18.9 % before torchtune's fp32 logits and per-head k/v copies were "
        "modelled): torchtune's compiled layer measured on CPU saves memplan's compiled block to the byte and "
        "the loss is within 1 % (held-out), so the 3.9 GiB left is what inductor keeps on CUDA (or flex "
        "attention, the packed rows' attention, keeps): not measurable here",
    ),
    (
        "row '+ 8-bit AdamW'",
        "single GPU (compile + chunked CE)",
        _TORCHTUNE_3B
        | dict(
            recipe="torchtune", compile=True, optimizer_in_backward=True, offload_activations=True, optimizer="adam8bit"
        ),
        "-6.8 % (16.4 GiB against 17.6; -6.2 % before offloading kept no block at the end of forward) "
        "with the 8-bit states counted. The config's default, bitsandbytes "
        "PagedAdamW8bit, keeps them in cudaMallocManaged memory (functional.py get_paged: torch.frombuffer "
        "over cget_managed_ptr), which max_active cannot count: as paged-adamw8bit the row is 10.5 GiB "
        "(-40.2 %). The published drop from the row before, 4.2 GiB, is less than counted 8-bit states "
        "save (5.9), so the run's states were counted (not paged); 1.1 GiB not found",
    ),
    # the four batch-4 BERT rows: 16-21 % under with gradients freed between steps, 8-11 % under
    # with the 2022 Trainer's zero-filled ones (_BERT_2022's zero_grad); the rest is not found
    *(
        (source, _BERT_SINGLE, _BERT_2022 | dict(micro_batch=4) | flags, f"{error}; {_BERT_BS4}")
        for source, flags, error in [
            ("section 'Vanilla Training'", dict(precision="fp32"), "-7.9 % (13.44 GiB against 14.60)"),
            ("section 'FP16 Training (bs4)'", dict(precision="amp-fp16"), "-10.4 % (12.20 GiB against 13.61)"),
            (
                "section 'Adafactor (bs4)'",
                dict(precision="fp32", optimizer="adafactor"),
                "-9.2 % (10.90 against 12.01)",
            ),
            (
                "section '8-bit Adam (bs4)'",
                dict(precision="fp32", optimizer="adam8bit"),
                "-11.3 % (11.33 against 12.78)",
            ),
        ]
    ),
]


# rows memplan cannot express: (source, why). Lightning's Fabric FSDP example trains torch's
# nn.Transformer, an encoder-decoder: 32 encoder layers (self-attention, MLP, 2 LayerNorms: the
# count of a GPT-2 block) and 32 decoder layers that add cross-attention over the encoder's
# output (4·h² + 4·h more parameters and a third LayerNorm each), plus the encoder's and the
# decoder's final norms. ModelSpec describes one kind of block repeated (decoder-only, ViT or
# BERT-style encoders), so neither the 1,008,763,390 parameters (32 × 12,596,224 + 32 ×
# 16,796,672 + 4,096 + 2 × 34,076,672 + 33,278) nor the FSDP units (one per layer, two sizes)
# can be stated; a model of the same count with equal blocks would change the largest unit
# FSDP gathers and the per-tensor optimizer temporaries, so it is not substituted.
_LIGHTNING = (
    "torch nn.Transformer encoder-decoder (cross-attention decoder layers unlike the encoder's): "
    "ModelSpec has one block kind per model"
)
NOT_EXPRESSIBLE = [
    ("column 'DDP'", _LIGHTNING),
    ("column 'FSDP NO_SHARD'", _LIGHTNING),
    ("column 'FSDP SHARD_GRAD_OP (ZeRO-2-like)'", _LIGHTNING),
    ("column 'FSDP FULL_SHARD'", _LIGHTNING),
    ("column 'FSDP FULL_SHARD + CPU offload (cpu_offload=True)'", _LIGHTNING),
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


def test_every_row_is_expressed_or_says_why():
    rows = published_rows()
    expressed = {(source, strategy) for source, strategy, *_ in EXPRESSIBLE + MISSED}
    said = [source for source, _ in NOT_EXPRESSIBLE]
    for row in rows:
        compared = any(s in row["source"] and row["strategy"] == t for s, t in expressed)
        refused = [s for s in said if row["source"].endswith(s)]
        assert compared != bool(refused), f"{row['source']} is {'both' if compared else 'neither'} compared and refused"
    assert len(rows) == 27


@pytest.mark.parametrize("source,why", NOT_EXPRESSIBLE, ids=[s for s, _ in NOT_EXPRESSIBLE])
def test_not_expressible_rows_are_the_encoder_decoder(source, why):
    [row] = [r for r in published_rows() if r["source"].endswith(source)]
    assert "nn.Transformer enc-dec" in row["model"]
    h, f, V = (int(row[k]) for k in ("hidden", "ffn", "vocab"))
    encoder = 4 * h * h + 2 * h * f + 3 * h + h + f + h + 4 * h  # in_proj, out_proj, linear1/2, 2 norms
    decoder = encoder + 4 * h * h + 4 * h + 2 * h  # + cross-attention (in_proj, out_proj) and a norm
    half = int(row["layers"]) // 2
    # nn.Transformer's two final norms, the embedding and the untied decoder (with its bias)
    assert half * (encoder + decoder) + 2 * 2 * h + 2 * V * h + V == int(row["params"])
    pytest.skip(f"not expressible: {why}")


@pytest.mark.parametrize("source,strategy,flags", _CASES)
def test_estimate_against_published_peak(source, strategy, flags):
    for row in matching(published_rows(), source, strategy):
        trust = row["notes"].split(".")[0].removeprefix("trust:")
        measured = float(row["measured_gib"]) * GIB
        [est] = estimate(**flags, calibration=None).estimates
        assert est.job.model.num_params == int(row["params"])
        # max_reserved is the allocator's pool (replayed); max_allocated is tensor bytes alone;
        # nvidia-smi's 'used' is the pool and the CUDA context: memplan's total on one GPU
        predicted = reserved_bytes(est) if "reserved" in row["measure_kind"] else est.allocated_bytes
        if "nvidia-smi" in row["measure_kind"]:
            assert est.job.cluster.gpus == 1
            predicted = est.total_bytes
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
    # max_reserved as the row's measure (#100, torchtitan's) or in its notes (#120's alt_measure); the
    # Lightning rows give peak allocated only (their reserved is inferred from the text)
    rows = published_rows()
    as_measure = [r for r in rows if r["measure_kind"].startswith("max_reserved")]
    in_notes = [r for r in rows if "max_reserved=" in r["notes"]]
    assert len(as_measure) == 4 and len(in_notes) == 2
    # each by exactly one case of its own (the two #100 rows differ in their attention; the two
    # torchtitan rows are known misses)
    cases = [(s, t) for s, t, *_ in EXPRESSIBLE + MISSED]
    assert all(sum(s in r["source"] and r["strategy"] == t for s, t in cases) == 1 for r in as_measure)
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
# The train.py of those runs cleared gradients with optimizers.zero_grad() (torch's default,
# set_to_none=True); the 0.3.0 recipe's zero-filled ones (CUDA graphs) came later: zero_grad none.
TORCHTITAN_8B = [(8, 82.4), (128, 67.0)]


@pytest.mark.parametrize("gpus,reserved_gib", TORCHTITAN_8B, ids=[f"{g}-gpus" for g, _ in TORCHTITAN_8B])
def test_torchtitan_recipe_against_torchtitans_published_reserved(gpus, reserved_gib):
    flags = dict(model="llama-3.1-8b", gpus=gpus, gpu_mem="96GB", seq_len=8192, micro_batch=2, zero_grad="none")
    [est] = estimate(**flags, recipe="torchtitan", strategy="fsdp-full-shard", calibration=None).estimates
    assert est.job.train.activation_checkpointing == "op" and est.job.train.logits == "freed"
    assert reserved_bytes(est) == pytest.approx(reserved_gib * GIB, rel=0.10)
