"""The record of a ranged download's done chunks, kept beside its partial file.

``<partial>.chunks`` is this user's regular file, replaced atomically, never read through a
link.  It names the plan it was made under (blob, size, chunk size, and which chunk list the
chunks were checked against), and a download resumes from it only under that same plan: a
record of another plan starts the download over (its ranges and checks say nothing of this
one's).

It is written when a download starts (before the partial file has holes), at most once every
WRITE_EVERY_S as chunks finish, and when the download stops.  Rewriting it after every chunk
cost a write of the whole list per chunk (minutes and GBs per fetch at 50,000 chunks); a crash
now loses at most a second of chunks, which the next run fetches again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from imgpipe.base.files import atomic_path
from imgpipe.registry.errors import RegistryError

SIDECAR_LIMIT = 1 << 20
WRITE_EVERY_S = 1.0


def sidecar_path(partial: Path) -> Path:
    """Where the done chunks of the download into ``partial`` are recorded."""
    return partial.with_name(partial.name + ".chunks")


def list_identity(digests: Sequence[str]) -> str:
    """What names a chunk list in a record (its sha256): "" for none."""
    return hashlib.sha256(",".join(digests).encode()).hexdigest() if digests else ""


def read_record(partial: Path) -> dict[str, object]:
    """The record beside ``partial``: this user's regular file, read without following a
    link; anything else (missing, planted, too long, not JSON) reads as no record."""
    try:
        fd = os.open(sidecar_path(partial), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_size > SIDECAR_LIMIT):
            return {}
        try:
            record = json.loads(handle.read(SIDECAR_LIMIT))
        except ValueError:
            return {}
    return record if isinstance(record, dict) else {}


def done_in(record: dict[str, object], blob: str, size: int, chunk_size: int,
            identity: str) -> set[int] | None:
    """The done chunks a record lists when it was made under this very plan; None when it
    was not (another blob, size, chunk size or chunk list)."""
    if (record.get("blob"), record.get("size"), record.get("chunk_size"),
            record.get("list", "")) != (blob, size, chunk_size, identity):
        return None
    listed = record.get("done")
    count = -(-size // chunk_size)
    if not isinstance(listed, list):
        return set()
    return {i for i in listed if isinstance(i, int) and 0 <= i < count}


def done_prefix(record: dict[str, object], blob: str, size: int) -> int:
    """How many bytes from the start a record (under its own chunk size) lists as done in an
    unbroken run: where a single stream may go on from."""
    chunk_size = record.get("chunk_size")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        return 0
    identity = record.get("list", "")
    done = done_in(record, blob, size, chunk_size, identity if isinstance(identity, str) else "")
    run = 0
    while done and run in done:
        run += 1
    return min(run * chunk_size, size)


class DoneRecord:
    """The done chunks of one ranged download, written as the module says (not thread-safe:
    its caller serializes ``add``)."""

    def __init__(self, partial: Path, blob: str, size: int, chunk_size: int, identity: str,
                 done: set[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.path = sidecar_path(partial)
        self.blob, self.size, self.chunk_size, self.identity = blob, size, chunk_size, identity
        self.done = set(done)
        self.writes = 0
        self._clock = clock
        self._written_at = float("-inf")
        self._unsaved = True

    def save(self) -> None:
        """Write the record now."""
        record = {"blob": self.blob, "size": self.size, "chunk_size": self.chunk_size,
                  "list": self.identity, "done": sorted(self.done)}
        with atomic_path(self.path, mode=0o600) as tmp:
            tmp.write_text(json.dumps(record, separators=(",", ":")))
        self.writes += 1
        self._written_at, self._unsaved = self._clock(), False

    def add(self, index: int) -> None:
        """Chunk ``index`` is done: written if the last write is WRITE_EVERY_S old."""
        self.done.add(index)
        self._unsaved = True
        if self._clock() - self._written_at >= WRITE_EVERY_S:
            self.save()

    def flush(self) -> None:
        """Write what is not written yet (when the download stops)."""
        if self._unsaved:
            self.save()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self._unsaved = False


def open_partial(partial: Path) -> tuple[int, bool]:
    """Open (or create) this user's partial file without following a link: its fd, and
    whether it was created by this call."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(partial, flags | os.O_CREAT | os.O_EXCL, 0o600), True
    except FileExistsError:
        fd = os.open(partial, flags)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            os.close(fd)
            raise RegistryError(f"{partial} is not this user's partial download",
                                hint=f"remove {partial}") from None
    return fd, False
