"""A layer blob read as its uncompressed tar stream, verified while it is read.

gzip (ISA-L), zstd or plain, told apart by magic.  A thread of the layer's own reads the
blob, hashes it, decompresses it and (when the layer is read to be published) hashes the
tar, a few MiB ahead of the reader: hashlib, ISA-L's ``decompressobj`` and zstd leave the
GIL while they work, so the converter's Python (tar headers, the stream it writes) runs
beside them on another core.  ``ForwardReader`` hands that stream out, seeks forward by
skipping (tarfile seeks over every file's data), and :meth:`ForwardReader.verify` compares
the blob with its digest and the tar with the config's ``diff_id``.

Measured on the 5 GiB generated image (5.55 GB of tar in 40 layers, 2 cores): ISA-L
decompresses it in 5.3 s, hashing the tar takes 3.9 s more and the blobs 2.1 s, all of it
on the reader's thread before this thread did it (``IGzipFile``, used before, holds the
GIL for most of its work).
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

import zstandard
from isal.igzip_lib import IsalError

from imgpipe.base.files import open_regular
from imgpipe.enroot.errors import BlobDigestError, HostileLayerError
from imgpipe.enroot.inflate import gunzip

COPY_CHUNK = 1 << 20
# What a broken compressed stream raises, by decompressor.
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    EOFError, zlib.error, OSError, cast(type[BaseException], IsalError), zstandard.ZstdError)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BLOB_READ = 1 << 20  # compressed bytes read at a time
OUT_CHUNK = 4 << 20  # most uncompressed bytes made from one read at a time
AHEAD = 8  # uncompressed chunks the reader's thread may be ahead
_END = object()


@dataclass(frozen=True)
class LayerSource:
    digest: str
    path: Path
    diff_id: str | None = None  # sha256 of the uncompressed tar, from the image config
    # This process hashed the blob against its digest while it wrote the file, moments ago
    # (a file of its own, which no other user can write): it is not hashed again.
    hashed: bool = False


class TarSource(Protocol):
    """What the end-of-archive check reads of a layer stream (in-process or piped)."""

    position: int
    last_start: int
    last: bytes

    def read(self, size: int = -1, /) -> bytes:
        ...


class _Inflater:
    """The reading thread: blob -> hash -> decompress -> hash -> a bounded queue."""

    def __init__(self, handle: BinaryIO, magic: bytes, hashing: bool,
                 tar_hashing: bool = True) -> None:
        self.handle, self.magic, self.count = handle, magic, 0
        self.sha256 = hashlib.sha256() if hashing else None  # of the blob
        # of the tar (the diff_id)
        self.tar_sha256 = hashlib.sha256() if hashing and tar_hashing else None
        self.queue: queue.Queue[object] = queue.Queue(maxsize=AHEAD)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layer-reader", daemon=True)
        self._thread.start()

    def _blob(self) -> Iterator[bytes]:
        while not self._stop.is_set():
            data = self.handle.read(BLOB_READ)
            if not data:
                return
            self.count += len(data)
            if self.sha256 is not None:
                self.sha256.update(data)
            yield data

    def _tar(self) -> Iterator[bytes]:
        if self.magic[:2] == GZIP_MAGIC:
            yield from gunzip(self._blob())
        elif self.magic == ZSTD_MAGIC:
            reader = zstandard.ZstdDecompressor().stream_reader(
                _Chunks(self._blob()), read_across_frames=True)  # type: ignore[arg-type]
            while out := reader.read(OUT_CHUNK):
                yield out
        else:
            yield from self._blob()

    def _run(self) -> None:
        try:
            for out in self._tar():
                if self.tar_sha256 is not None:
                    self.tar_sha256.update(out)
                if not self._put(out):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the reader, which raises it
            self._put(exc)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.handle.close()


class _Chunks(io.RawIOBase):
    """An iterator of byte strings as a readable file (for zstd's stream reader)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.rest = chunks, b""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if not self.rest:
            self.rest = next(self.chunks, b"")
        if size < 0:
            size = len(self.rest)
        data, self.rest = self.rest[:size], self.rest[size:]
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


class ChunkReader(io.RawIOBase):
    """A stream that arrives in chunks, read and skipped forward without copies where it
    can be: subclasses say what the next chunk is."""

    STEP = 1 << 20

    def __init__(self) -> None:
        self.position = 0
        self._chunk: bytes = b""
        self._at = 0
        self.last_start, self.last = 0, b""  # the latest read, for the end-of-archive check

    def _next_chunk(self) -> bytes | None:
        """The next piece of the stream; None at its end."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def read_view(self, size: int) -> memoryview:
        """Up to ``size`` bytes without a copy (fewer at a chunk's end; empty at the end)."""
        while self._at >= len(self._chunk):
            chunk = self._next_chunk()
            if chunk is None:
                return memoryview(b"")
            self._chunk, self._at = chunk, 0
        take = min(size, len(self._chunk) - self._at)
        view = memoryview(self._chunk)[self._at:self._at + take]
        self._at += take
        self.position += take
        return view

    def read(self, size: int = -1) -> bytes:
        start = self.position
        if 0 <= size <= len(self._chunk) - self._at:  # the common case: one slice
            data = self._chunk[self._at:self._at + size]
            self._at += size
            self.position += size
        else:
            pieces = []
            left = size if size >= 0 else -1
            while left != 0:
                piece = self.read_view(left if left > 0 else self.STEP)
                if not piece:
                    break
                pieces.append(piece)
                if left > 0:
                    left -= len(piece)
            data = b"".join(pieces)
        self.last_start, self.last = start, data
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else self.position + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self.position:
            raise OSError("a layer stream only seeks forward")
        while self.position < target:
            if not self.read_view(target - self.position):
                break  # past the end: the next read finds nothing, as tarfile expects
        return self.position


class ForwardReader(ChunkReader):
    """The uncompressed stream a layer's reading thread makes, read and skipped forward.

    ``compressed`` is that thread (``count``: blob bytes read so far).
    """

    def __init__(self, inflater: _Inflater) -> None:
        super().__init__()
        self.compressed = inflater
        self._ended = False

    def _next_chunk(self) -> bytes | None:
        if self._ended:
            return None
        item = self.compressed.queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return cast(bytes, item)

    def verify(self, layer: LayerSource) -> None:
        """Read the stream to its end (the decompressor checks its trailer) and compare the
        blob with its digest and the tar with the config's diff_id."""
        inflater = self.compressed
        assert inflater.sha256 is not None
        try:
            while self.read_view(self.STEP):
                pass
        except STREAM_ERRORS as exc:
            raise HostileLayerError(layer.digest, "(stream)", "corrupt compressed stream at "
                                    f"byte {inflater.count}: {exc}") from exc
        found = f"sha256:{inflater.sha256.hexdigest()}"
        if found != layer.digest:
            raise BlobDigestError(layer.digest, found, layer.path)
        if layer.diff_id is None or inflater.tar_sha256 is None:
            return
        tar_digest = f"sha256:{inflater.tar_sha256.hexdigest()}"
        if tar_digest != layer.diff_id:
            raise HostileLayerError(layer.digest, "(content)",
                                    f"its uncompressed content hashes to {tar_digest[:19]}, "
                                    f"not to the image config's diff_id {layer.diff_id[:19]}")

    def close(self) -> None:
        if not self.closed:
            self.compressed.close()
        super().close()


def open_layer(path: Path, verify: bool = True, tar_hashing: bool = True) -> ForwardReader:
    """The uncompressed tar stream of a layer blob (gzip, zstd or plain, by magic), hashed
    on the way for :meth:`ForwardReader.verify` unless ``verify`` is False (the tar itself
    too unless ``tar_hashing`` is False: only a diff_id check needs it)."""
    handle = os.fdopen(open_regular(path), "rb", buffering=0)
    try:
        magic = handle.read(4)
        handle.seek(0)
    except OSError:
        handle.close()
        raise
    return ForwardReader(_Inflater(cast(BinaryIO, handle), magic, verify, tar_hashing))
