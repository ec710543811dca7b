"""The end of a block's backward (inside its input norm's backward) under fsdp-no-shard and
full shard, and where that instant outgrows what memplan models: a record measured on CPU
(``memplan calibrate run --mode local``, 1–2 gloo ranks, llama 2 layers h256, seq 199 × 11,
full AC; validation/records/block_end_cpu.jsonl)."""

from pathlib import Path

import pytest

from calibrate.records import job_from_spec, read
from memplan.memory import estimate

RECORDS = read([Path(__file__).resolve().parent.parent / "validation/records/block_end_cpu.jsonl"])


def _error(record: dict) -> float:
    measured = record["measurement"]["peak_allocated_bytes"]
    return estimate(job_from_spec(record["spec"])).allocated_bytes / measured - 1


def _by(strategy: str) -> dict:
    return next(r for r in RECORDS if r["spec"]["plan"]["strategy"] == strategy)


def test_no_shard_holds_at_least_full_shards_bytes_as_measured():
    # fully_shard over a shard group of one runs full shard's hooks without its shards: measured
    # 27,519,104 B against 27,387,776; memplan had no-shard below full shard (one moment per
    # block, no block end) until no-shard took full shard's block instants
    no_shard, full = _by("fsdp-no-shard"), _by("fsdp-full-shard")
    assert no_shard["measurement"]["peak_allocated_bytes"] >= full["measurement"]["peak_allocated_bytes"]
    assert (
        estimate(job_from_spec(no_shard["spec"])).allocated_bytes
        >= estimate(job_from_spec(full["spec"])).allocated_bytes
    )


@pytest.mark.parametrize(
    "record",
    [r for r in RECORDS if r["spec"]["plan"]["strategy"] == "single"],
    ids=lambda r: f"ffn{r['spec']['model']['ffn_hidden']}",
)
def test_a_narrow_mlp_is_the_only_miss(record):
    # an MLP at least twice the hidden size (every dense model memplan's presets hold: 2.67–4·h)
    # is within 1 %; narrower, the attention's backward in the recomputed block outgrows the MLP's,
    # an instant memplan does not model: ffn = h −0.89 %, ffn = h/4 −7.46 % (measured)
    model = record["spec"]["model"]
    error = _error(record)
    if model["ffn_hidden"] >= 2 * model["hidden"]:
        assert abs(error) < 0.01
    else:
        assert -0.08 < error < 0
