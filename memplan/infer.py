"""A standard Llama-style architecture for a bare parameter count ("a 13B model").

The hidden size follows the Llama family's scaling (interpolated in log-log between real
configs); the per-layer shapes follow Meta's reference code; the number of layers is
then the one that brings the total closest to the request.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

from .errors import InputError
from .specs import ModelSpec
from .units import parse_count

MIN_PARAMS, MAX_PARAMS = 10**6, 10**14
PARAMS_ACCEPTED = f"{MIN_PARAMS:.0e} to {MAX_PARAMS:.0e}, written as 13e9, 13B, 7.2b or 350M"
"""The counts a parameter count may be, as every message about one states them."""
VOCAB = 32_000  # Llama / Llama-2 SentencePiece vocabulary
GQA_FROM = 8192  # Llama-2-70B, CodeLlama-34B and Llama-3-405B use 8 kv heads from this width
# (nominal parameters, hidden size) of real Llama configs: Llama-3.2-1B, Llama-2-7B/13B,
# CodeLlama-34B, Llama-2-70B, Llama-3.1-405B.
_HIDDEN_ANCHORS = ((1e9, 2048), (7e9, 4096), (13e9, 5120), (34e9, 8192), (70e9, 8192), (405e9, 16384))
# "7B" etc. are names, not counts (Llama-2-7B holds 6.74e9 parameters): these requests give
# the published (hidden, layers) rather than the closest count.
_LLAMA2 = {7 * 10**9: (4096, 32), 13 * 10**9: (5120, 40), 70 * 10**9: (8192, 80)}
_TOLERANCE = 0.01  # a candidate width this close to the request ends the search
_CANDIDATES = 24  # widths tried, nearest to the scaling law first


def ffn_hidden(hidden: int) -> int:
    """Meta's FeedForward: int(2/3 · 4h), times ffn_dim_multiplier, rounded up to multiple_of.

    Llama-2 7B/13B use no multiplier and multiple_of 256 (4096 → 11008); Llama-2-70B's
    params.json has ffn_dim_multiplier 1.3 and multiple_of 4096 (8192 → 28672), used here
    for every width from 8192 on (CodeLlama-34B, with 22016, and Llama-3-405B differ).
    """
    ffn = int(2 * 4 * hidden / 3)
    multiple = 256
    if hidden >= GQA_FROM:
        ffn, multiple = int(1.3 * ffn), 4096
    return multiple * math.ceil(ffn / multiple)


def llama_style(hidden: int, num_layers: int, name: str = "llama-style") -> ModelSpec:
    head_dim = 128 if hidden >= 2048 else 64  # Llama-3.2-1B (2048) and below use 64
    return ModelSpec(
        name=name,
        arch="llama",
        num_layers=num_layers,
        hidden=hidden,
        num_heads=hidden // head_dim,
        num_kv_heads=8 if hidden >= GQA_FROM else 0,
        ffn_hidden=ffn_hidden(hidden),
        vocab_size=VOCAB,
        tied_embeddings=False,
    )


def _scaled_hidden(num_params: float) -> float:
    """Hidden size of the Llama family at that size, piecewise linear in log-log."""
    xs = [math.log(p) for p, _ in _HIDDEN_ANCHORS]
    ys = [math.log(h) for _, h in _HIDDEN_ANCHORS]
    x = math.log(num_params)
    i = min(max(bisect.bisect(xs, x), 1), len(xs) - 1)  # outside the anchors: extend the end segment
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _widths(target: float) -> list[int]:
    """Valid hidden sizes nearest to ``target`` (in ratio): multiples of 128, and of 1024 from
    GQA_FROM on so that the 8 kv heads divide the 128-wide heads."""
    top = max(2 * target, 4 * GQA_FROM)
    grid = [*range(128, GQA_FROM, 128), *range(GQA_FROM, int(top) + 1024, 1024)]
    return sorted(grid, key=lambda h: abs(math.log(h / target)))[:_CANDIDATES]


def _closest_layers(hidden: int, num_params: int) -> ModelSpec:
    one = llama_style(hidden, 1)
    fixed = one.num_params - one.block_params()
    return llama_style(hidden, max(1, round((num_params - fixed) / one.block_params())))


def model_for_params(num_params: int) -> ModelSpec:
    """A Llama-style model with about ``num_params`` parameters (within 2 % from 1e8 to 2e12).

    7e9, 13e9 and 70e9 give Llama-2-7B/13B/70B exactly. Below ~1e8 the 32000-token
    embeddings dominate and the result may exceed the request.
    """
    if (
        isinstance(num_params, bool)
        or not isinstance(num_params, (int, float))
        or not MIN_PARAMS <= num_params <= MAX_PARAMS
    ):
        raise _bad_params(num_params, "is out of range")
    num_params = int(num_params)
    best: ModelSpec | None
    if num_params in _LLAMA2:
        best = llama_style(*_LLAMA2[num_params])
    else:
        best = None
        for hidden in _widths(_scaled_hidden(num_params)):
            spec = _closest_layers(hidden, num_params)
            if best is None or _miss(spec, num_params) < _miss(best, num_params):
                best = spec
            if _miss(best, num_params) <= _TOLERANCE:
                break
        assert best is not None  # _widths always gives candidates
    return replace(best, name=f"llama-style-{_short(num_params)} (inferred)")


def parse_params(text) -> int:
    """A parameter count as users write it (``13e9``, ``"13B"``, ``"7.2b"``), within the range this
    inference covers; every way it can be wrong gets one message with the accepted range."""
    try:
        count = parse_count(text, what="params")
    except InputError as exc:  # not written as a count, or not a positive one below 1e18
        raise _bad_params(text, "is not a count" if exc.accepted.startswith("a count") else "is out of range") from None
    if not MIN_PARAMS <= count <= MAX_PARAMS:
        raise _bad_params(text, "is out of range")
    return count


def _bad_params(value, why: str) -> InputError:
    return InputError(
        lambda n: f"{n.word('params')} {value!r} {why}; accepted: {PARAMS_ACCEPTED}",
        field="params",
        value=value,
        accepted=PARAMS_ACCEPTED,
    )


def _miss(spec: ModelSpec, num_params: int) -> float:
    return abs(spec.num_params - num_params) / num_params


def _short(count: int) -> str:
    """13e9 → '13B', 1.3e9 → '1.3B', 350e6 → '350M', 2e12 → '2T'."""
    value, suffix = next((count / s, x) for s, x in ((1e12, "T"), (1e9, "B"), (1e6, "M")) if count >= s)
    return f"{value:.3g}{suffix}"
