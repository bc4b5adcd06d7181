"""A blob's chunks: the size a fetch cuts it into, the published list of each chunk's
sha256 and the bounds that list must keep (a pusher writes it), and what a checked chunk
tells whoever follows a fetch (``Checked``, ``Verified``).  ``registry.ranges`` fetches by
them."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_CHUNK_SIZE", "MIN_CHUNK_SIZE", "MAX_CHUNK_SIZE", "MAX_CHUNKS", "Checked",
           "Verified", "ChunkHasher", "chunk_digests", "chunk_count", "own_chunk_size",
           "chunks_problem", "plan_chunks"]

# 16 MiB: a followed fetch (the broadcast's batch host) sends nothing of a chunk before it is
# checked, so each node's copy ends one chunk's transfer after the fetch (issue #61: 64 MiB was
# 2.7 s behind at 200 Mbit/s, 16 MiB is 0.7 s); a request still carries 2,000 times its cost.
READ_CHUNK = 4 << 20  # bytes per read of a file or a response being hashed
DEFAULT_CHUNK_SIZE = 16 << 20
# A pusher's list of 64 KiB chunks (every digest right) made a 40 MB fetch 612 requests
# instead of 2 and 6.8-8.4x slower.  At 8 MiB a request carries 128 times the bytes: its own
# cost (a round trip, a thread hop, an Event) is small beside the transfer.
MIN_CHUNK_SIZE = 8 << 20
MAX_CHUNK_SIZE = 1 << 30
# 2,560 chunks is a 20 GiB squashfs at the minimum, 1,280 at the default; 4,096 (32 GiB at the
# minimum, 64 GiB at the default) keeps the list in a manifest under 270 KB (65 bytes each:
# what every job that reads the referrers parses), the record of done chunks under 25 KB,
# and a fetch under 4,096 requests.  The old cap, 50,000, was a 3.2 MB list and 50,000
# rewrites of a record of up to 290 KB per fetch.
MAX_CHUNKS = 4096
_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Checked:
    """How far a ranged download is, told after each chunk in order: the bytes before
    ``upto`` are written and checked against their chunk digest (where the artifact lists
    them; the whole digest is checked at the end either way).  A job's broadcast sends
    them on while later chunks still land (commands.node.broadcast)."""

    blob: str
    partial: Path
    size: int
    chunk_size: int
    digests: tuple[str, ...]  # the chunk digests the download goes by (none: not listed)
    upto: int


Verified = Callable[[Checked], None]


class ChunkHasher:
    """The sha256 of each ``chunk_size`` piece of a stream fed in pieces of any length."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._digests: list[str] = []
        self._current = hashlib.sha256()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_size:
                self._digests.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def digests(self) -> list[str]:
        """The digests so far, the last (shorter) chunk's included."""
        return self._digests + ([self._current.hexdigest()] if self._filled else [])


def chunk_digests(path: Path, chunk_size: int) -> list[str]:
    """The sha256 of each ``chunk_size`` piece of the file ``path``, read once."""
    hasher = ChunkHasher(chunk_size)
    with open(path, "rb") as source:
        while block := source.read(READ_CHUNK):
            hasher.update(block)
    return hasher.digests()


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def own_chunk_size(size: int, wanted: int = DEFAULT_CHUNK_SIZE) -> int:
    """The chunk size a fetch (or a publisher) of ``size`` bytes goes by: ``wanted``, or
    larger (whole MiB) where that would make more than MAX_CHUNKS chunks."""
    if chunk_count(size, wanted) <= MAX_CHUNKS:
        return wanted
    return chunk_count(chunk_count(size, MAX_CHUNKS), 1 << 20) << 20


def chunks_problem(size: int, chunk_size: int, digests: Sequence[object]) -> str | None:
    """Why ``digests`` cannot be (or may not be used as) the chunk digests of a blob of
    ``size`` bytes (from a manifest anyone who can push may write), or None when they can."""
    if chunk_size < MIN_CHUNK_SIZE:
        return f"chunk size {chunk_size} is below the minimum {MIN_CHUNK_SIZE}"
    if chunk_size > MAX_CHUNK_SIZE:
        return f"chunk size {chunk_size} is above the maximum {MAX_CHUNK_SIZE}"
    if len(digests) > MAX_CHUNKS:
        return f"{len(digests)} chunk digests, at most {MAX_CHUNKS} are taken"
    if len(digests) != chunk_count(size, chunk_size):
        return (f"{len(digests)} chunk digests for {size} bytes in chunks of {chunk_size} "
                f"(expected {chunk_count(size, chunk_size)})")
    if not all(isinstance(d, str) and _HEX.fullmatch(d) for d in digests):
        return "a chunk digest is not 64 lowercase hex digits"
    return None


def plan_chunks(blob: str, size: int, chunk_size: int, digests: Sequence[str],
                say: Callable[[str], None]) -> tuple[int, Sequence[str]]:
    """The chunk size and digests a fetch of ``size`` bytes goes by: the published ones
    when within bounds; else (said in one line) its own size, checked by the whole digest
    alone.  Without digests: ``chunk_size`` (0: DEFAULT_CHUNK_SIZE), raised where it would
    make more than MAX_CHUNKS."""
    if digests and (problem := chunks_problem(size, chunk_size, digests)) is not None:
        own = own_chunk_size(size)
        say(f"ignored the chunk digests of {blob[:19]}: {problem}; fetching it in ranges of "
            f"{own >> 20} MiB, verified by the whole digest")
        return own, ()
    if digests:
        return chunk_size, digests
    return own_chunk_size(size, chunk_size or DEFAULT_CHUNK_SIZE), ()
