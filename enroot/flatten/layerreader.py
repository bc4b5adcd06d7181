"""Layers read as their tar streams: what the decoder (``enroot.flatten.decoder``) writes, in order.

:class:`LayerPipe` starts one decoder process for a run of layers and hands it each layer
as its blob lands; :class:`LayerReader` is one layer's uncompressed stream, with what
tarfile and the converters use of it: ``read``, ``read_view`` (no copy), forward ``seek``,
``tell``, the latest read (for the end-of-archive check), ``splice_into`` (pipe to pipe),
and ``verify``, which compares the blob with its digest and the tar with the config's
``diff_id``.  Every converter path reads layers this way.
"""

from __future__ import annotations

import io
import json
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpipe.base.process import Producer
from imgpipe.enroot.errors import BlobDigestError, HostileLayerError
from imgpipe.enroot.flatten import decoder

PIPE_SIZE = 1 << 20
READ = 1 << 20  # bytes read from the pipe at a time


@dataclass(frozen=True)
class LayerSource:
    """A layer as the converters read it: its blob's digest and path, and the sha256 of its
    uncompressed tar from the image config (``diff_id``)."""

    digest: str
    path: Path
    diff_id: str | None = None
    # This process hashed the blob against its digest while it wrote the file, moments ago
    # (a file of its own, which no other user can write): it is not hashed again.
    hashed: bool = False


class DecodeError(OSError):
    """The decoder found a broken stream (or died): a layer error to its reader."""


# What reading a layer's stream raises for a broken layer (tarfile's own errors aside).
STREAM_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError)


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


# The k-th layer in reading order, once its blob is in the cache (it may wait for a fetch)
Arrival = Callable[[int], LayerSource]


class LayerPipe:
    """One decoder process streaming ``count`` layers in reading order: a thread of this
    process hands it each layer as ``arrive`` returns it (a fetch finishing), so the first
    layers stream while later ones are still on the network.  ``hash_tars``: hash each tar
    for a comparison with its ``diff_id``."""

    def __init__(self, count: int, arrive: Arrival, hash_tars: bool = True) -> None:
        argv = [sys.executable, "-m", decoder.__name__, json.dumps({"hash_tar": hash_tars})]
        self.count = count
        self._producer = Producer(argv, pipe_size=PIPE_SIZE, with_input=True)
        self.fd = self._producer.fd  # the frames' pipe
        self._arrived: queue.Queue[LayerSource | BaseException] = queue.Queue()
        self._feeder = threading.Thread(target=self._feed, args=(arrive,), name="layer-feed",
                                        daemon=True)
        self._feeder.start()

    def _feed(self, arrive: Arrival) -> None:
        try:
            for index in range(self.count):
                try:
                    layer = arrive(index)
                except BaseException as exc:  # its fetch failed: the converter raises that
                    self._arrived.put(exc)
                    return
                line = json.dumps({"path": str(layer.path), "hash_blob": not layer.hashed})
                try:
                    self._producer.send(line.encode() + b"\n")
                except OSError as exc:  # the process ended: its frames say why
                    self._arrived.put(DecodeError(f"the decoder ended: {exc}"))
                    return
                self._arrived.put(layer)
        finally:
            self._producer.end_input()

    def readers(self) -> Iterator[LayerReader]:
        for _ in range(self.count):
            layer = self._arrived.get()
            if isinstance(layer, BaseException):
                raise layer
            reader = LayerReader(self, layer)
            yield reader
            if not reader.ended:
                raise AssertionError("a layer's reader left before its end")

    def close(self) -> None:
        self._producer.close()

    def __enter__(self) -> LayerPipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_fd(self, size: int) -> bytes:
        """Up to ``size`` bytes from the pipe; empty when the process has ended."""
        return os.read(self._producer.fd, size)

    def frame(self) -> tuple[bytes, int, int]:
        """The next frame's kind, payload length and blob bytes read so far."""
        header = b""
        while len(header) < decoder.FRAME.size:
            more = self.read_fd(decoder.FRAME.size - len(header))
            if not more:
                code = self._producer.close()
                raise DecodeError(f"the decoder ended (exit {code}) mid-stream: "
                                   f"{self._producer.stderr_tail() or 'no message'}")
            header += more
        kind, length, blob_bytes = decoder.FRAME.unpack(header)
        return kind, length, blob_bytes

    def payload(self, length: int) -> bytes:
        data = b""
        while len(data) < length:
            more = self.read_fd(length - len(data))
            if not more:
                raise DecodeError("the decoder ended inside a frame")
            data += more
        return data



class LayerReader(ChunkReader):
    """One layer's uncompressed stream from a :class:`LayerPipe`, read forward only.

    The pipe is read a MiB at a time: reading each tar header on its own (512 bytes) woke
    the decoder for every few KiB it could write, and the stream crawled (a pipe
    costs here what a copy does not: 4 GB through ``cat`` 6.1 s, in 1 MiB reads 1.9 s)."""

    def __init__(self, pipe: LayerPipe, layer: LayerSource) -> None:
        super().__init__()
        self.pipe, self.layer = pipe, layer
        self.blob_bytes = 0  # compressed bytes the decoder has read of this layer
        self.ended = False
        self.summary: dict[str, Any] = {}
        self._left = 0  # bytes of the current data frame not read yet

    def _await_data(self) -> bool:
        """Read frames until one with tar bytes is under way; False at the layer's end."""
        while not self._left:
            if self.ended:
                return False
            kind, length, blob_bytes = self.pipe.frame()
            if kind == b"D":
                self._left, self.blob_bytes = length, blob_bytes
            elif kind == b"E":
                self.summary = json.loads(self.pipe.payload(length))
                self.blob_bytes = int(self.summary["blob_bytes"])
                self.ended = True
            else:
                self.ended = True
                raise DecodeError(self.pipe.payload(length).decode(errors="replace"))
        return True

    def _next_chunk(self) -> bytes | None:
        if not self._await_data():
            return None
        chunk = self.pipe.read_fd(min(self._left, READ))
        if not chunk:
            raise DecodeError("the decoder ended inside a frame")
        self._left -= len(chunk)
        return chunk

    def splice_into(self, move: Callable[[int, int], int], size: int) -> int:
        """Up to ``size`` bytes of the stream moved out of the pipe by ``move(fd, count)``
        (``os.splice`` into another pipe: the kernel hands its pages on, this process never
        copies them); 0 when bytes already read must go first, or at the layer's end."""
        if self._at < len(self._chunk) or not self._await_data():
            return 0
        moved = move(self.pipe.fd, min(size, self._left))
        if not moved:
            raise DecodeError("the decoder ended inside a frame")
        self._left -= moved
        self.position += moved
        return moved

    def verify(self, layer: LayerSource) -> None:
        """Read to the end of the layer and compare what the decoder hashed: the
        blob with its digest (unless this process hashed it as it fetched it), the tar
        with the config's diff_id (when asked to)."""
        while self.read_view(self.STEP):
            pass
        if not layer.hashed:
            found = f"sha256:{self.summary.get('blob', '')}"
            if found != layer.digest:
                raise BlobDigestError(layer.digest, found, layer.path)
        tar_digest = f"sha256:{self.summary['tar']}" if "tar" in self.summary else None
        if layer.diff_id is not None and tar_digest is not None and tar_digest != layer.diff_id:
            raise HostileLayerError(layer.digest, "(content)",
                                    f"its uncompressed content hashes to {tar_digest[:19]}, "
                                    f"not to the image config's diff_id {layer.diff_id[:19]}")
