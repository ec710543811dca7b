"""Count the incoherent combinations the CLI property suite finds, per property, instead of
stopping at the first (tests/test_cli_properties.py).

    PYTHONPATH=. python scripts/cli_property_count.py [--scale 4] [--seed 0] [--show 3]

Each property of the suite runs ``scale`` times its CI example count, from a fixed seed, with
hypothesis's generation phase only (no shrinking); every failing example is counted under the
property and its first line kept, so the same command before and after a fix gives the
before -> after figures.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

from hypothesis import Phase, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_cli_properties as props

PROPERTIES = [
    "test_estimate_exits_cleanly_and_its_bytes_are_coherent",
    "test_table_json_and_csv_give_the_same_bytes",
    "test_explain_terms_are_positive_and_sum_to_their_moments",
    "test_explain_and_estimate_give_the_same_bytes",
    "test_more_micro_batch_never_less_memory",
    "test_longer_sequence_never_less_memory",
    "test_more_layers_never_less_memory",
    "test_more_gpus_under_full_shard_never_more_state_bytes",
    "test_micro_batch_max_fits_and_one_more_does_not",
    "test_recommendation_reasked_with_estimate_gives_the_same_bytes",
    "test_estimate_table_and_its_recommendation_give_the_same_bytes",
    "test_the_layout_search_refuses_nothing_data_parallel_answers",
]


REFUSED: collections.Counter = collections.Counter()
_init = props.Run.__init__


def _recording_init(self, args):
    _init(self, args)
    key = "exit 0" if self.code == 0 else re.sub(r"[\d.,]{2,}", "N", self.err.strip())[:100]
    REFUSED[key] += 1


props.Run.__init__ = _recording_init  # type: ignore[method-assign]


def count(name: str, scale: float, at: int, show: int) -> tuple[int, int, collections.Counter, list[str]]:
    test = getattr(props, name)
    inner = test.hypothesis.inner_test
    strategies = test.hypothesis._given_kwargs
    n = max(1, int(test._hypothesis_internal_use_settings.max_examples / props.SCALE * scale))
    seen, failed = [0], [0]
    kinds: collections.Counter = collections.Counter()
    shown: list[str] = []

    def body(**kwargs):
        try:
            inner(**kwargs)
            seen[0] += 1
        except AssertionError as exc:
            seen[0] += 1
            failed[0] += 1
            first = (str(exc).splitlines() or ["(no message)"])[0]
            kinds[re.sub(r"[\d,]{4,}", "N", first)[:90]] += 1
            if len(shown) < show:
                shown.append("memplan " + " ".join(next(iter(kwargs.values()))) + f"\n      -> {first}")
        except Exception as exc:  # hypothesis's own (assume) pass through
            if type(exc).__module__.startswith("hypothesis"):
                raise
            seen[0] += 1
            failed[0] += 1
            kinds[f"{type(exc).__name__}: {str(exc)[:70]}"] += 1

    run = seed(at)(
        settings(
            max_examples=n,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(props.HealthCheck),
        )(given(**strategies)(body))
    )
    run()
    return seen[0], failed[0], kinds, shown


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=2)
    parser.add_argument("--only", action="append")
    parser.add_argument("--refusals", type=int, default=0, help="show the N commonest exit-2 messages")
    args = parser.parse_args(argv)
    total_seen = total_failed = 0
    for name in args.only or PROPERTIES:
        t = time.perf_counter()
        seen, failed, kinds, shown = count(name, args.scale, args.seed, args.show)
        total_seen, total_failed = total_seen + seen, total_failed + failed
        print(f"{name}: {failed} of {seen} examples incoherent ({time.perf_counter() - t:.0f} s)", flush=True)
        for kind, k in kinds.most_common(8):
            print(f"    {k:4d}  {kind}")
        if args.refusals:
            for kind, k in REFUSED.most_common(args.refusals):
                print(f"    run {k:4d}  {kind}")
            REFUSED.clear()
        for line in shown:
            print(f"    e.g. {line}")
    print(f"total: {total_failed} of {total_seen} examples incoherent")


if __name__ == "__main__":
    main()
