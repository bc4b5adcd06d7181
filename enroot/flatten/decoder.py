"""The decoder: layer blobs -> their tar bytes and digests, in a process of its own.

Every path that reads a layer reads it through here (``python -m imgpipe.enroot.flatten.decoder
SPEC``, SPEC a JSON object ``{"hash_tar": bool}``; ``enroot.flatten.layerreader`` starts it and
reads what it writes).  The layers arrive on stdin, one JSON line ``{"path": BLOB,
"hash_blob": bool}`` each, as their blobs land in the cache, so that the first layers stream
while the last ones are still fetched; stdin's end means no more.

Reading a blob, hashing it, decompressing it (gzip through ISA-L, zstd, or plain, told apart
by magic) and hashing the tar is most of a conversion's CPU work.  In the converter's own
process it shares the GIL with the tar handling, and threads do not help: each release and
re-take of the GIL waits for the other thread's switch interval (measured: a decompressing
thread beside a Python one ran no faster than the two one after the other).  This process
does that work on another core and hands the streams over a pipe, in frames:

* ``D`` + length + blob bytes read so far, then that many bytes of tar;
* ``E`` + length, then a JSON summary of the finished layer: tar bytes, and the sha256 of
  the blob and of the tar where asked;
* ``X`` + length, then an error message (a corrupt or truncated stream): the process then
  exits 1.

Frames are written by a thread of their own while the next ones are made.  A blob read to
its end leaves the page cache (a 16 GB image's 7 GB of blobs pushed the squashfs and
everything else a node holds out of it).

It imports only what that needs (no imgpipe modules but ``base.files``), so it starts in a
few milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import sys
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

from imgpipe.base.regular import open_regular

FRAME = struct.Struct("<cQQ")  # kind, payload length, blob bytes read so far
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BLOB_READ = 1 << 20  # compressed bytes read at a time
OUT_CHUNK = 4 << 20  # most uncompressed bytes made from one read
AHEAD = 64  # frames made but not yet written: 256 MiB at most, less where memory is short


class Blob:
    """A blob read in order, counted and (optionally) hashed."""

    def __init__(self, path: str, hashing: bool) -> None:
        self.handle = os.fdopen(open_regular(path), "rb", buffering=0)  # noqa: SIM115
        self.count = 0
        self.sha256 = hashlib.sha256() if hashing else None

    def chunks(self) -> Iterator[bytes]:
        while data := self.handle.read(BLOB_READ):
            self.count += len(data)
            if self.sha256 is not None:
                self.sha256.update(data)
            yield data

    def read(self, size: int = -1) -> bytes:  # for zstd's stream reader
        data = self.handle.read(size if size >= 0 else BLOB_READ)
        self.count += len(data)
        if self.sha256 is not None:
            self.sha256.update(data)
        return data

    def close(self) -> None:
        # Read once: its pages leave the page cache (a 16 GB image's 7 GB of blobs pushed the
        # squashfs and everything else a node holds out of it)
        try:
            os.posix_fadvise(self.handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        self.handle.close()


def gunzip(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """gzip members one after another, as ``gzip -d`` reads them: bytes after the last
    member that do not start another one are an error, and so is a member cut short."""
    from isal import isal_zlib

    inflate = isal_zlib.decompressobj(wbits=31)
    fed = False
    for data in chunks:
        while data:
            fed = True
            out = inflate.decompress(data, OUT_CHUNK)
            while True:
                if out:
                    yield out
                if not inflate.unconsumed_tail:
                    break
                out = inflate.decompress(inflate.unconsumed_tail, OUT_CHUNK)
            if not inflate.eof:
                break
            data = inflate.unused_data  # the next member's first bytes, if any
            inflate = isal_zlib.decompressobj(wbits=31)
            fed = False
    if fed and not inflate.eof:
        raise EOFError("compressed stream ended before its end-of-stream marker")


def _unzstd(blob: Blob) -> Iterator[bytes]:
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(
        cast(BinaryIO, blob), read_across_frames=True)
    while out := reader.read(OUT_CHUNK):
        yield out


def tar_chunks(blob: Blob, magic: bytes) -> Iterator[bytes]:
    """The uncompressed stream of ``blob`` (gzip, zstd or plain, by magic)."""
    if magic[:2] == GZIP_MAGIC:
        return gunzip(blob.chunks())
    if magic == ZSTD_MAGIC:
        return _unzstd(blob)
    return blob.chunks()


def _write(fd: int, *parts: bytes | memoryview) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def frames_ahead() -> int:
    """How many frames may wait for the pipe: AHEAD, or fewer so that they take at most an
    eighth of this cgroup's memory limit and of the memory available (a login node's limits:
    a conversion under a 160 MiB cgroup must not be killed for running ahead)."""
    budgets = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    budgets.append(int(line.split()[1]) * 1024)
        with open("/proc/self/cgroup") as cgroup:
            for line in cgroup:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":  # cgroup v2
                    limit = _read(f"/sys/fs/cgroup{path}/memory.max")
                elif "memory" in controllers.split(","):  # v1
                    limit = _read(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
                else:
                    continue
                if limit.isdigit():
                    budgets.append(int(limit))
    except (OSError, ValueError):
        pass
    if not budgets:
        return AHEAD
    return max(1, min(AHEAD, min(budgets) // 8 // OUT_CHUNK))


class _Writer:
    """Frames written by a thread of their own, up to AHEAD of them queued: the reader
    blocks on a full pipe (1 MiB at most), and without this the decompressing stopped
    whenever the converter was busy with headers."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.queue: queue.Queue[tuple[bytes, bytes | None, int] | None] = queue.Queue(
            frames_ahead())
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="frames", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # drain: the reader side stops at its next put
            kind, payload, blob_bytes = item
            try:
                body = payload or b""
                _write(self.fd, FRAME.pack(kind, len(body), blob_bytes), body)
            except BaseException as exc:  # a broken pipe: the converter stopped reading
                self.error = exc

    def put(self, kind: bytes, payload: bytes | None, blob_bytes: int) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((kind, payload, blob_bytes))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def stream_layer(path: str, hash_blob: bool, hash_tar: bool, frames: _Writer
                 ) -> dict[str, Any]:
    """Frames of one layer's tar onto ``frames``; its summary."""
    blob = Blob(path, hash_blob)
    try:
        magic = os.pread(blob.handle.fileno(), 4, 0)
        tar_sha256 = hashlib.sha256() if hash_tar else None
        total = 0
        for out in tar_chunks(blob, magic):
            if tar_sha256 is not None:
                tar_sha256.update(out)
            total += len(out)
            frames.put(b"D", out, blob.count)
        summary: dict[str, Any] = {"tar_bytes": total, "blob_bytes": blob.count}
        if blob.sha256 is not None:
            summary["blob"] = blob.sha256.hexdigest()
        if tar_sha256 is not None:
            summary["tar"] = tar_sha256.hexdigest()
        return summary
    finally:
        blob.close()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    frames = _Writer(sys.stdout.fileno())
    code = 0
    for line in sys.stdin.buffer:  # one layer a line, each sent once its blob is in place
        layer = json.loads(line)
        try:
            summary = stream_layer(layer["path"], layer["hash_blob"], spec["hash_tar"], frames)
        except BrokenPipeError:
            break  # the converter stopped reading: it knows why
        except Exception as exc:  # a broken stream: told to the reader, which names the layer
            message = str(exc) or type(exc).__name__
            frames.put(b"X", message.encode(errors="replace"), 0)
            code = 1
            break
        frames.put(b"E", json.dumps(summary).encode(), summary["blob_bytes"])
    try:
        frames.close()
    except BrokenPipeError:
        pass
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
