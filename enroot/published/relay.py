"""A published squashfs relayed between the nodes of one job (``enroot.distribution:
broadcast``), whatever carries the bytes (``commands.node.broadcast``: a chain of TCP
connections, ``enroot.published.chain``).

The batch host's fetch tells ``Prefix`` how far it has written and checked the file
(registry.ranges, chunk by chunk in order), and the sender sends each segment of the file
(``enroot.published.chain``) as soon as it is inside that prefix, while later chunks still
arrive from the registry.  Every other node gathers the segments into units (``Assembler``)
and writes each unit into its own partial download of the blob (the file a fetch of its own
would have written, in its private folder) and hashes it on a thread of its own
(``Receiver``), so the last unit's hash ends a moment after the last byte arrives: no pass
over the whole file is left, and a slow disk holds up the stream only once every unit
buffer is being written.

Each node's stage times travel back in the final gather (``NodeTimes``, one SLOT each), and
the batch host can say them all in one machine-readable line (``stages_line``,
``parse_stages``: what bench/bench_fanout.py reads).

A receiver trusts nothing it is sent but bytes: the job's own connections are not
authenticated beyond a token that crossed MPI's unencrypted transport, so the blob must be a
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
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from imgpipe.base.directio import DirectWriter
from imgpipe.base.errors import ImgpipeError
from imgpipe.enroot.published.chain import SEGMENT, trailer
from imgpipe.enroot.published.contents import publish_partial
from imgpipe.registry.chunkrecord import open_partial, sidecar_path
from imgpipe.registry.chunks import Checked, chunks_problem

UNIT = 8 << 20  # bytes a receiver writes and hashes at a time (a multiple of SEGMENT)
HEADER_MAX = 1 << 20  # 4,096 chunk digests and the rest fit in a third of it
BUFFERS = 3  # units a receiver holds: one filling, two being written and hashed
SLOT = 256  # bytes per node in the final gather: took it or not, its name, its times
STAGES = "broadcast stages "  # how the batch host's line of stage times starts


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
        self.first_at = 0.0  # when the first chunk was checked (seconds since the epoch)
        self.done_at = 0.0  # when the fetch ended

    def __call__(self, checked: Checked) -> None:
        with self._ready:
            if self.checked is None or checked.blob != self.checked.blob \
                    or checked.upto > self.checked.upto:
                self.first_at = self.first_at or time.time()
                self.checked = checked
            self._ready.notify_all()

    def finish(self, entry: Path | None) -> None:
        with self._ready:
            self.done, self.entry, self.done_at = True, entry, time.time()
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
        return bool(self.poll(blob, end, None))

    def poll(self, blob: str, end: int, timeout: float | None) -> bool | None:
        """Whether the bytes before ``end`` of ``blob`` are checked: True, False (the fetch
        ended first) or None (not yet, after waiting up to ``timeout`` seconds)."""
        with self._ready:
            def there() -> bool:
                return self.checked is not None and self.checked.blob == blob \
                    and self.checked.upto >= end
            self._ready.wait_for(lambda: there() or self.done, timeout)
            return True if there() else False if self.done else None



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


class Assembler:
    """The chain's messages, in order, into a Receiver's units (``take``: each message's
    bytes copied into a free unit buffer, every whole unit handed over).  A message that is
    not the next one, or a stop, ends the taking with why (``why``); the messages after it
    are still forwarded by the chain, only not taken."""

    def __init__(self, receiver: Receiver) -> None:
        assert UNIT % SEGMENT == 0
        self.receiver = receiver
        self.offset = 0  # bytes taken
        self.why = ""
        self._unit: bytearray | None = None
        self._filled = 0

    def take(self, message: bytearray) -> None:
        """Take one message (its bytes copied: the caller reuses ``message``); waits while
        every unit buffer is being written, so a slow disk holds up the chain."""
        header = self.receiver.header
        if self.why or self.offset >= header.size:
            return
        offset, length, size = trailer(message)
        if offset != self.offset or length != min(SEGMENT, header.size - offset) \
                or size != header.size:
            self.why = "the batch host stopped sending" if offset < 0 else \
                f"a message at byte {offset} of {size} came out of order"
            return
        if self._unit is None:  # waits while every unit buffer is being written
            self._unit = self.receiver.buffer()
        self._unit[self._filled:self._filled + length] = memoryview(message)[:length]
        self._filled += length
        self.offset += length
        if self._filled == UNIT or self.offset == header.size:
            self.flush()

    def flush(self) -> None:
        """Hand over the unit being filled, whole or not (the stream ended)."""
        if self._unit is not None and self._filled:
            self.receiver.put(self._unit, self._filled)
            self._unit, self._filled = None, 0


def _sha256_range(fd: int, start: int, end: int) -> str:
    hasher, offset = hashlib.sha256(), start
    while offset < end:
        block = os.pread(fd, min(UNIT, end - offset), offset)
        if not block:
            break
        hasher.update(block)
        offset += len(block)
    return hasher.hexdigest()


@dataclass
class NodeTimes:
    """When a receiving node got to each stage (seconds since the epoch; 0: never): the
    job's MPI step ready, the first and the last message, its copy checked (or refused)."""

    ready: float = 0.0
    first: float = 0.0
    last: float = 0.0
    checked: float = 0.0


def gather_slot(took: bool, name: str, times: NodeTimes) -> bytearray:
    """What a receiving node sends the batch host at the end: SLOT bytes, "1" (it took the
    copy) or "0", its name, a NUL, its times as JSON."""
    stamps = json.dumps({k: round(v, 3) for k, v in asdict(times).items()},
                        separators=(",", ":")).encode()
    slot = (b"1" if took else b"0") + name.encode()[:63] + b"\0" + stamps
    return bytearray(slot[:SLOT].ljust(SLOT, b"\0"))


def read_slot(raw: bytes | bytearray) -> tuple[bool, str, NodeTimes]:
    """A gather slot as ``gather_slot`` wrote it (bytes from an unauthenticated peer: what
    does not parse reads as no times)."""
    name, _, stamps = bytes(raw).rstrip(b"\0").partition(b"\0")
    times = NodeTimes()
    try:
        fields = json.loads(stamps) if stamps else {}
        times = NodeTimes(**{k: float(fields.get(k, 0.0)) for k in asdict(times)})
    except (ValueError, TypeError, AttributeError):
        pass
    text = name.decode(errors="replace")
    return text.startswith("1"), text[1:], times


def per_hop(arrivals: list[float | None]) -> float | None:
    """The seconds each hop adds: the least-squares slope of when something reached each
    node against its place in the chain (None with fewer than two nodes)."""
    points = [(place, t) for place, t in enumerate(arrivals, 1) if t is not None]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return round(sum((x - mean_x) * (t - mean_t) for x, t in points) / spread, 4)


def stages_line(start: float, sender: dict[str, float], nodes: list[NodeTimes]) -> str:
    """The batch host's line of stage times, in seconds since ``start`` (its fetch began;
    itself given as seconds since the epoch): its own stages (``sender``), each receiving
    node's in chain order, the last node's, and the cost of a hop."""
    def since(t: float) -> float | None:
        return round(t - start, 3) if t else None

    def latest(values: list[float | None]) -> float | None:
        return max((v for v in values if v is not None), default=None)

    columns = {k: [since(getattr(n, k)) for n in nodes] for k in ("ready", "first", "last",
                                                                   "checked")}
    fields: dict[str, object] = {"start": round(start, 3), "nodes": len(nodes)}
    fields.update({k: since(v) for k, v in sender.items()})
    fields.update({"ready_last": latest(columns["ready"] + [since(sender.get("ready", 0.0))]),
                   "first_byte_last_node": latest(columns["first"]),
                   "last_unit": latest(columns["last"]),
                   "final_check": latest(columns["checked"]),
                   "per_hop_s": per_hop(columns["first"]),
                   "per_hop_last_s": per_hop(columns["last"])})
    fields.update({f"{k}_by_node": v for k, v in columns.items()})
    return STAGES + json.dumps(fields, separators=(",", ":"))


def parse_stages(text: str) -> dict[str, object] | None:
    """The last line of stage times in ``text`` (a job's output), or None."""
    found = re.findall(re.escape(STAGES) + r"(\{.*\})\s*$", text, re.M)
    try:
        fields = json.loads(found[-1]) if found else None
    except ValueError:
        return None
    return fields if isinstance(fields, dict) else None
