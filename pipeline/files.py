"""Atomic file publication: write to a unique temporary name, then rename.

Every file imgpipe publishes (lock file, rendered recipes, cache entries,
registry configuration) goes through :func:`atomic_write` or
:func:`atomic_path`, so a reader never sees a half-written file and a crash
leaves only ``.tmp-`` files that are safe to delete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"


def temporary_name(final: Path) -> Path:
    """A name beside ``final`` that is unique per host and process."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{socket.gethostname()}.{os.getpid()}")


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str], mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path; on success rename it onto ``final``, else remove it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(final)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's content, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(final: str | os.PathLike[str], data: str | bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``final`` atomically (fsync before the rename)."""
    with atomic_path(final, mode) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
    return Path(final)
