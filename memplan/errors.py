"""memplan's exceptions. A message names the inputs it is about through ``Names``, so the same
error reads ``micro_batch`` from Python and ``--micro-batch`` (or ``micro-batch``) from the command."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Names:
    """How a message spells an input, given by its Python keyword (``micro_batch``)."""

    flag_prefix: str = ""
    separator: str = "_"

    def __call__(self, keyword: str) -> str:
        """Where the command writes the flag: ``--micro-batch``; Python: ``micro_batch``."""
        return self.flag_prefix + self.word(keyword)

    def word(self, keyword: str) -> str:
        """Where the command writes the bare word: ``micro-batch``; Python: ``micro_batch``."""
        return keyword.replace("_", self.separator)


KEYWORDS = Names()
FLAGS = Names(flag_prefix="--", separator="-")

Message = Callable[[Names], str]


class MemplanError(ValueError):
    """A bad input or an impossible request, worded for the user (one line).

    ``message`` is the text, or a function of ``Names`` where it names inputs; ``str()`` spells
    them as Python keywords, ``render(FLAGS)`` as the command's flags.
    """

    def __init__(self, message: str | Message):
        self.message: Message = message if callable(message) else (lambda names: message)
        super().__init__(self.message(KEYWORDS))

    def render(self, names: Names) -> str:
        return self.message(names)


class InputError(MemplanError):
    """One input's value is not accepted: ``field`` is its keyword (``micro_batch``), ``value``
    what was given, ``accepted`` what would be."""

    def __init__(self, message: str | Message, *, field: str, value: object, accepted: str):
        super().__init__(message)
        self.field, self.value, self.accepted = field, value, accepted


class UnknownKeywordError(MemplanError, TypeError):
    """A keyword that is no input of memplan (a misspelt ``micro_bach=``); a TypeError, as Python's own."""

    def __init__(self, message: str, *, keyword: str, accepted: tuple[str, ...]):
        super().__init__(message)
        self.keyword, self.accepted = keyword, accepted
