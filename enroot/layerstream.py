"""A layer blob read as its uncompressed tar stream, verified while it is read.

gzip (ISA-L), zstd or plain, told apart by magic.  ``ForwardReader`` seeks forward by
reading (tarfile seeks over every file's data) and, when the layer is read to be published,
hashes both streams on the way: :meth:`ForwardReader.verify` then compares the blob with its
digest and the tar with the config's ``diff_id``.

Measured on the 5 GiB generated image (5.55 GB of tar in 40 layers, 2 cores): ISA-L
decompresses it in 5.3 s, hashing the tar takes 3.9 s more and the blobs 2.1 s.  A thread
decompressing and hashing ahead of pass 2's reader gained nothing (11.3 s either way):
``IGzipFile`` holds the GIL for most of its work.
"""

from __future__ import annotations

import hashlib
import io
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import zstandard
from isal import igzip
from isal.igzip_lib import IsalError

from imgpipe.enroot.errors import BlobDigestError, HostileLayerError

COPY_CHUNK = 1 << 20
# What a broken compressed stream raises, by decompressor.
STREAM_ERRORS: tuple[type[BaseException], ...] = (
    EOFError, zlib.error, OSError, cast(type[BaseException], IsalError), zstandard.ZstdError)


@dataclass(frozen=True)
class LayerSource:
    digest: str
    path: Path
    diff_id: str | None = None  # sha256 of the uncompressed tar, from the image config


class _HashingFile(io.RawIOBase):
    """The compressed blob as read by a decompressor, hashed and counted on the way."""

    def __init__(self, handle: BinaryIO, hashing: bool = True) -> None:
        self.handle, self.count = handle, 0
        self.sha256 = hashlib.sha256() if hashing else None

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        if self.sha256 is not None:
            self.sha256.update(data)
        self.count += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self.read(COPY_CHUNK):
            pass


class ForwardReader(io.RawIOBase):
    """A decompressed stream that seeks forward by reading and discarding in large steps.

    Decompressors seek forward in 8 KiB reads; tarfile seeks over every file's
    data, so big steps matter (a 1.2 GB image: 3.5 s -> ~2 s for the header pass).
    """

    STEP = 1 << 20

    def __init__(self, raw: BinaryIO, closer: BinaryIO, compressed: _HashingFile) -> None:
        self.raw, self.closer, self.position = raw, closer, 0
        self.compressed = compressed
        # Of the uncompressed stream (the diff_id), when the layer is read to be published.
        self.sha256 = hashlib.sha256() if compressed.sha256 is not None else None
        self.last_start, self.last = 0, b""  # the latest read, for the end-of-archive check

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        if self.sha256 is not None:
            self.sha256.update(data)
        self.last_start, self.last = self.position, data
        self.position += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else self.position + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self.position:
            raise OSError("a layer stream only seeks forward")
        while self.position < target:
            chunk = self.raw.read(min(self.STEP, target - self.position))
            if not chunk:
                break  # past the end: the next read finds nothing, as tarfile expects
            if self.sha256 is not None:
                self.sha256.update(chunk)
            self.position += len(chunk)
        return self.position

    def verify(self, layer: LayerSource) -> None:
        """Read both streams to their ends (the decompressor checks its trailer) and compare
        the blob with its digest and the tar with the config's diff_id."""
        assert self.sha256 is not None and self.compressed.sha256 is not None
        try:
            while self.read(self.STEP):
                pass
            self.compressed.drain()
        except STREAM_ERRORS as exc:
            raise HostileLayerError(layer.digest, "(stream)", "corrupt compressed stream at "
                                    f"byte {self.compressed.count}: {exc}") from exc
        found = f"sha256:{self.compressed.sha256.hexdigest()}"
        if found != layer.digest:
            raise BlobDigestError(layer.digest, found, layer.path)
        tar_digest = f"sha256:{self.sha256.hexdigest()}"
        if layer.diff_id is not None and tar_digest != layer.diff_id:
            raise HostileLayerError(layer.digest, "(content)",
                                    f"its uncompressed content hashes to {tar_digest[:19]}, "
                                    f"not to the image config's diff_id {layer.diff_id[:19]}")

    def close(self) -> None:
        self.raw.close()
        self.closer.close()
        super().close()


def open_layer(path: Path, verify: bool = True) -> ForwardReader:
    """The uncompressed tar stream of a layer blob (gzip, zstd or plain, by magic), hashed
    on the way for :meth:`ForwardReader.verify` unless ``verify`` is False."""
    handle = open(path, "rb")
    magic = handle.read(4)
    handle.seek(0)
    compressed = _HashingFile(handle, hashing=verify)
    if magic[:2] == b"\x1f\x8b":
        raw: BinaryIO = igzip.IGzipFile(  # type: ignore[no-untyped-call,assignment]
            fileobj=compressed, mode="rb")
    elif magic == b"\x28\xb5\x2f\xfd":
        raw = zstandard.ZstdDecompressor().stream_reader(
            compressed, read_across_frames=True)  # type: ignore[arg-type]
    else:
        raw = compressed  # type: ignore[assignment]
    return ForwardReader(raw, handle, compressed)
