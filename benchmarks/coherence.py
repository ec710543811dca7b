"""How many random jobs (presets × recipes × precisions × AC × LoRA × TP) are incoherent:
the recommendation re-asked with ``estimate`` (the same option, explicitly) gives another total,
or a command fails where the other runs. Run against any checkout (PYTHONPATH):

    python benchmarks/coherence.py [jobs] [seed]
"""

import json
import random
import sys

from click.testing import CliRunner

from memplan.cli import main

PRESETS = ("gpt2", "llama-2-7b", "llama-3.1-8b", "llama-3.2-1b")
RECIPES = ("plain", "hf-trainer", "torchtitan", "torchtune")
PRECISIONS = ("mixed-bf16", "bf16", "amp-bf16", "fp32")
ACS = ("none", "selective", "full")


# data parallel's pick (a checkout before --no-search-layout never searched layouts by default)
NO_LAYOUT = ["--no-search-layout"] * ("--no-search-layout" in CliRunner().invoke(main, ["recommend", "--help"]).output)


def ask(*args):
    r = CliRunner().invoke(main, [*args, "--format", "json"])
    return (json.loads(r.output) if r.exit_code == 0 else None), r.exit_code


def one(rng: random.Random) -> str | None:
    job = ["--model", rng.choice(PRESETS), "--gpus", str(rng.choice((2, 8))), "--gpu", "h100-sxm",
           "--seq-len", str(rng.choice((1024, 2048))), "--micro-batch", str(rng.choice((1, 2, 4))),
           "--precision", rng.choice(PRECISIONS), "--ac", rng.choice(ACS), "--recipe", rng.choice(RECIPES)]  # fmt: skip
    if rng.random() < 0.25:
        job += ["--finetune", "lora"]
    if rng.random() < 0.25:
        job += ["--tp", "2", "--sp"]
    rec, code = ask("recommend", *job, *NO_LAYOUT)
    if rec is None:
        est, code2 = ask("estimate", *job)
        return None if code2 == code else f"recommend exit {code}, estimate exit {code2}: {job}"
    if rec.get("strategy") is None:
        return None
    fixed = ["--strategy", rec["strategy"], "--offload", rec["offload"]]
    est, code = ask("estimate", *job, *fixed)
    if est is None:
        return f"estimate exit {code} for the recommended option: {job}"
    total = est["estimates"][0]["bytes"]["total"]
    return None if total == rec["total_bytes"] else f"table {total} != recommendation {rec['total_bytes']}: {job}"


def main_(n: int = 60, seed: int = 28) -> None:
    rng = random.Random(seed)
    bad = [m for m in (one(rng) for _ in range(n)) if m]
    for m in bad:
        print(m)
    print(f"{len(bad)} of {n} incoherent")


if __name__ == "__main__":
    main_(*(int(a) for a in sys.argv[1:3]))
