"""Sizes and counts as users write them, and bytes as humans read them."""

import math
import re

from .errors import InputError

GIB = 2**30

_BYTE_UNITS = {
    "": GIB,
    "gib": GIB,
    "g": GIB,
    "gb": 10**9,
    "mib": 2**20,
    "mb": 10**6,
    "tib": 2**40,
    "tb": 10**12,
    "kib": 2**10,
    "kb": 10**3,
    "b": 1,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_count(text, *, what: str) -> int:
    """'13e9', '13B', '7.2b', '350M', 125000000 → a positive integer count."""
    m = re.fullmatch(_NUMBER + r"\s*([kmbt]?)", str(text).strip().lower())
    if not m:
        raise InputError(
            lambda n: f"{n.word(what)} {text!r} is not a count; use e.g. 13e9, 13B, 7.2b or 350M",
            field=what,
            value=text,
            accepted="a count: 13e9, 13B, 7.2b or 350M",
        )
    value = float(m.group(1)) * _COUNT_SUFFIXES[m.group(2)]
    return positive_int(value, what=what)


def parse_bytes(text, *, what: str) -> int:
    """'80' (GiB), '80GB', '81559MiB', '40GiB' → bytes."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip().lower())
    if not m or m.group(2) not in _BYTE_UNITS:
        units = "GiB, GB, MiB, MB, TiB, TB"
        raise InputError(
            lambda n: f"{n.word(what)} {text!r} is not a memory size; use GiB (80) or a unit: {units}",
            field=what,
            value=text,
            accepted=f"GiB (80) or a unit: {units}",
        )
    return positive_int(float(m.group(1)) * _BYTE_UNITS[m.group(2)], what=what)


def positive_int(value, *, what: str, maximum: float = 1e18) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(
            lambda n: f"{n.word(what)} {value!r} is not a number", field=what, value=value, accepted="a number"
        ) from None
    if not math.isfinite(number) or number <= 0 or number > maximum:
        raise InputError(
            lambda n: f"{n.word(what)} must be a positive number below {maximum:.0e}, got {value!r}",
            field=what,
            value=value,
            accepted=f"a positive number below {maximum:.0e}",
        )
    if number != int(number) and number < 1e6:
        raise InputError(
            lambda n: f"{n.word(what)} must be a whole number, got {value!r}",
            field=what,
            value=value,
            accepted="a whole number",
        )
    return round(number)


def gib(num_bytes: int) -> float:
    return num_bytes / GIB
