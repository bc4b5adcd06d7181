"""A published squashfs relayed between the nodes of one job (``enroot.distribution:
broadcast``), whatever carries the bytes (``commands.node.broadcast``: MPI's broadcast).

The batch host's fetch tells ``Prefix`` how far it has written and checked the file
(registry.ranges, chunk by chunk in order), and the sender sends each unit of the file as
soon as it is inside that prefix, while later chunks still arrive from the registry.  Every
other node writes each unit it receives into its own partial download of the blob (the file
a fetch of its own would have written, in its private folder) and hashes it on a thread of
its own (``Receiver``), so the last unit's hash ends a moment after the last byte arrives:
no pass over the whole file is left.

A receiver trusts nothing it is sent but bytes: the job's own connections are not
authenticated (MPI's TCP transport answers whoever knows the port), so the blob must be a
pin of the receiver's own environment (``Header.check``), the bytes must hash to it, and the
file must pass the same contents check as a fetch (``publish_partial``) before it becomes
the entry.  Anything else is said in one line; the partial file keeps the chunks before the
first one that differs from the sender's list, and the node's own fetch goes on from there
(a fetch checks kept chunks against the published list again before it keeps them).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.directio import DirectWriter
from imgpipe.base.errors import ImgpipeError
from imgpipe.enroot.published.artifact import publish_partial
from imgpipe.registry.chunkrecord import sidecar_path
from imgpipe.registry.ranges import Checked, chunks_problem
from imgpipe.registry.transfer import open_partial

UNIT = 8 << 20  # bytes per message: what each node forwards while it receives the next
HEADER_MAX = 1 << 20  # 4,096 chunk digests and the rest fit in a third of it
BUFFERS = 3  # units a receiver holds: one arriving, two being written and hashed


class RelayError(ValueError):
    """A header or a stream that cannot be what the sender should have sent."""


@dataclass(frozen=True)
class Header:
    """What the sender says before the bytes: the blob, its size, and the chunk digests the
    sender's fetch went by (none: the sender had the file already)."""

    blob: str
    size: int
    chunk_size: int = 0
    digests: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return json.dumps({"blob": self.blob, "size": self.size,
                           "chunk_size": self.chunk_size, "digests": self.digests}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Header:
        """The header in ``data``; RelayError when it is not one."""
        if len(data) > HEADER_MAX:
            raise RelayError(f"a header of {len(data)} bytes (at most {HEADER_MAX})")
        try:
            fields = json.loads(data)
            header = cls(str(fields["blob"]), int(fields["size"]), int(fields["chunk_size"]),
                         tuple(str(d) for d in fields["digests"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RelayError(f"a header that does not parse ({type(exc).__name__})") from exc
        if header.size <= 0:
            raise RelayError(f"a header with size {header.size}")
        if header.digests and (problem := chunks_problem(header.size, header.chunk_size,
                                                         header.digests)) is not None:
            raise RelayError(f"a header whose chunk digests cannot be right: {problem}")
        return header

    def check(self, pins: frozenset[str]) -> None:
        """Raise RelayError unless the blob is one of ``pins`` (this node's own)."""
        if self.blob not in pins:
            raise RelayError(f"the blob sent, {self.blob[:19]}…, is not a pin of this job "
                             f"({', '.join(p[:19] + '…' for p in sorted(pins)) or 'none'})")

    def units(self) -> int:
        return -(-self.size // UNIT)

    def unit_length(self, index: int) -> int:
        return min(UNIT, self.size - index * UNIT)


class Prefix:
    """How much of the file the sender may send: told by its fetch (``__call__``, a
    registry.ranges ``Verified``) and by the fetch's end (``finish``)."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self.checked: Checked | None = None
        self.done = False
        self.entry: Path | None = None  # what the fetch made (None: it failed)

    def __call__(self, checked: Checked) -> None:
        with self._ready:
            if self.checked is None or checked.blob != self.checked.blob \
                    or checked.upto > self.checked.upto:
                self.checked = checked
            self._ready.notify_all()

    def finish(self, entry: Path | None) -> None:
        with self._ready:
            self.done, self.entry = True, entry
            self._ready.notify_all()

    def ended(self) -> Path | None:
        """What the fetch made, once it is over (None: it failed)."""
        with self._ready:
            self._ready.wait_for(lambda: self.done)
            return self.entry

    def started(self) -> Checked | None:
        """The first word of the fetch (None: it ended without one, from a cache hit, one
        stream or a failure)."""
        with self._ready:
            self._ready.wait_for(lambda: self.checked is not None or self.done)
            return self.checked

    def wait(self, blob: str, end: int) -> bool:
        """Whether the bytes before ``end`` of ``blob`` are checked (waits until they are,
        or the fetch ended)."""
        with self._ready:
            def there() -> bool:
                return self.checked is not None and self.checked.blob == blob \
                    and self.checked.upto >= end
            self._ready.wait_for(lambda: there() or self.done)
            return there()


class Receiver:
    """One node's copy of the blob a Header names, written and hashed unit by unit as the
    units arrive (``buffer``, ``put``), then checked and made the entry (``finish``)."""

    def __init__(self, header: Header, partial: Path, final: Path, mode: int,
                 spare: int = 0) -> None:
        """``spare``: bytes each buffer has past UNIT (a transport's own trailer)."""
        self.header, self.partial, self.final, self.mode = header, partial, final, mode
        free = shutil.disk_usage(partial.parent).free
        if free < header.size:
            raise RelayError(f"{header.size} bytes do not fit in {partial.parent} ({free} "
                             "free)")
        self._fd, _ = open_partial(partial)
        os.ftruncate(self._fd, 0)  # this user's own earlier partial: written anew
        sidecar_path(partial).unlink(missing_ok=True)
        # around the page cache where the file system allows: N nodes' copies through one
        # machine's writeback (the sandbox) or one node's disk stay at the disk's speed
        self._writer = DirectWriter(partial, 0)
        self._whole = hashlib.sha256()
        self.queued = 0  # bytes handed over (``put``)
        self.written = 0  # bytes written and hashed
        self.failed = ""
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(BUFFERS):
            self._free.put(bytearray(UNIT + spare))
        self._work: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_and_hash, name="relay-writer",
                                        daemon=True)
        self._thread.start()

    def buffer(self) -> bytearray:
        """A free buffer for the next unit (waits while all are being written)."""
        return self._free.get()

    def put(self, buffer: bytearray, length: int) -> None:
        """Hand over the next unit's ``length`` bytes at the start of ``buffer``."""
        self.queued += length
        self._work.put((buffer, length))

    def _write_and_hash(self) -> None:
        while (item := self._work.get()) is not None:
            buffer, length = item
            try:
                if not self.failed:
                    view = memoryview(buffer)[:length]
                    self._writer.write(view)
                    self._whole.update(view)  # releases the GIL: the next unit arrives meanwhile
                    self.written += length
            except OSError as exc:
                self.failed = f"writing byte {self.written} failed ({exc.strerror})"
            finally:
                self._free.put(buffer)

    def _stop(self) -> None:
        self._work.put(None)
        self._thread.join()

    def finish(self) -> Path | str:
        """The entry made of the bytes received, or why none was (the partial file then
        keeps the chunks that match the sender's list, for this node's own fetch)."""
        self._stop()
        try:
            if self.failed:
                self._writer.abandon()
            else:
                try:
                    self._writer.close()  # the tail, then fsync; it lets go either way
                except OSError as exc:
                    self.failed = f"writing the copy failed ({exc.strerror})"
            if self.failed:
                return self._keep_good_chunks(self.failed)
            if self.written != self.header.size:
                return self._keep_good_chunks(f"{self.written} of {self.header.size} bytes "
                                              "arrived")
            got = "sha256:" + self._whole.hexdigest()
            if got != self.header.blob:
                return self._keep_good_chunks(f"the bytes hash to {got[:19]}…, not "
                                              f"{self.header.blob[:19]}…")
        finally:
            os.close(self._fd)
        try:
            publish_partial(self.partial, self.final, None, self.mode)
        except ImgpipeError as exc:
            return f"{exc.message}; fetching it from the registry"
        except OSError as exc:
            return f"it cannot be made the entry ({exc}); fetching it from the registry"
        return self.final

    def abandon(self, why: str) -> str:
        """Stop receiving (the sender gave up, or the transport failed): why, with the
        chunks kept."""
        self._stop()
        self._writer.abandon()
        try:
            return self._keep_good_chunks(why)
        finally:
            os.close(self._fd)

    def _keep_good_chunks(self, why: str) -> str:
        """Cut the partial file before the first chunk that differs from the sender's list
        (all of it without a list) and say so."""
        header, kept = self.header, 0
        if header.digests:
            size = min(self.written, header.size)
            for index, expected in enumerate(header.digests):
                start = index * header.chunk_size
                end = min(header.size, start + header.chunk_size)
                if end > size or _sha256_range(self._fd, start, end) != expected:
                    break
                kept = end
        os.ftruncate(self._fd, kept)
        if kept:
            first, count = kept // header.chunk_size, len(header.digests)
            return (f"{why}; keeping chunks 0-{first - 1}, fetching chunks {first}-{count - 1}"
                    " from the registry")
        return f"{why}; fetching it from the registry"


def _sha256_range(fd: int, start: int, end: int) -> str:
    hasher, offset = hashlib.sha256(), start
    while offset < end:
        block = os.pread(fd, min(UNIT, end - offset), offset)
        if not block:
            break
        hasher.update(block)
        offset += len(block)
    return hasher.hexdigest()
