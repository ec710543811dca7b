"""The allocator replay's answers kept on disk, so that a job replayed once is not replayed again
by the next command, process or notebook kernel: ``memplan estimate`` asked twice, with another
``--gpu-mem``, ``--priority`` or format, or ``recommend`` after ``estimate``, replays nothing.

One file per trace shape and allocator configuration, under a folder named by a checksum of the
code that turns a shape into its answer (``alloctrace.py``, ``allocator.py``): an edited or
upgraded replay never reads an older one's answers. Each file holds the answer and the key it
answers, compared on reading, so that two keys meeting in one file name cost a replay, never a
wrong number. The folder is ``$MEMPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/memplan``, else
``~/.cache/memplan``; ``MEMPLAN_CACHE_DIR=none`` keeps nothing. A folder that cannot be read or
written is passed over in silence: the replay runs as without it.

Deliberately small: no hashing module (hashlib took 5–10 ms to import here, zlib 2.3 ms, a
sizeable part of the main job's start-up), as the key's file name is its ``hash()``: a trace shape and an
``AllocConf`` hold ints, bools and floats only, whose hashes Python does not salt per process."""

from __future__ import annotations

import contextlib
import os
from functools import cache
from pathlib import Path

ENV = "MEMPLAN_CACHE_DIR"
OFF = "none"
_CHECKSUM_MODULUS = 2**61 - 1
_SOURCES = ("alloctrace.py", "allocator.py")


def cache_root() -> Path | None:
    """The folder the answers go under (None: keep nothing)."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", OFF) else Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path("~", ".cache").expanduser()  # XDG ignores a relative one
    return base / "memplan" if base.is_absolute() else None  # no home to expand: keep nothing


@cache
def _folder(root: Path) -> Path | None:
    """``root``'s folder for this replay code: named by its sources' checksum (their bytes read
    as one integer, modulo a Mersenne prime); None where the sources cannot be read."""
    here = Path(__file__).parent
    try:
        data = b"".join((here / name).read_bytes() for name in _SOURCES)
    except OSError:
        return None
    return root / f"replay-{int.from_bytes(data, 'little') % _CHECKSUM_MODULUS:016x}"


def _path(key: object) -> Path | None:
    root = cache_root()
    folder = _folder(root) if root is not None else None
    return None if folder is None else folder / f"{hash(key) & (2**64 - 1):016x}"


def load(key: object) -> int | None:
    """The answer kept for ``key``; None: none kept (or unreadable). The key's text is made only
    where a file is found (0.24 ms for the 13B job's, 0.68 ms for the 405B's)."""
    path = _path(key)
    if path is None:
        return None
    try:
        value, _, kept = path.read_text().partition("\n")
        return int(value) if kept == repr(key) else None
    except (OSError, ValueError):
        return None


def store(key: object, value: int) -> None:
    """Keep ``value`` as ``key``'s answer: written beside under a name of its own, then renamed
    into place (readers in other processes, other hosts on a shared home too, see the whole file
    or none)."""
    path = _path(key)
    if path is None:
        return
    part = path.with_name(f"{path.name}.{os.urandom(8).hex()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part.write_text(f"{value}\n{key!r}")
        os.replace(part, path)
    except OSError:
        with contextlib.suppress(OSError):
            part.unlink()  # a disk full midway leaves no part behind
