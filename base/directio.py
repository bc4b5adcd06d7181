"""Writing a large file around the page cache (``O_DIRECT``), where the file system allows.

A multi-GB download written through the page cache is throttled to the kernel's writeback:
on the 2-core build machine 6.7 GB took 22 s (300 MB/s) through the cache and 2 GB went
in 1.3 s with ``O_DIRECT`` (1.6 GB/s).  Cluster file systems (Lustre, GPFS, NFS) take
direct writes too.  ``O_DIRECT`` wants the memory, the offset and the length aligned to the
device's block size, so the writer gathers bytes in a page-aligned buffer (an anonymous
mmap) and writes whole buffers; the unaligned tail goes through an ordinary descriptor.
Where the file system refuses ``O_DIRECT`` (tmpfs, overlay) it writes through the cache.
"""

from __future__ import annotations

import mmap
import os

ALIGN = 1 << 20  # offsets a resumed download starts from (a multiple of any block size)
BUFFER = 8 << 20  # bytes gathered per direct write


class DirectWriter:
    """Appends to ``path`` from ``offset`` (a multiple of ALIGN), bypassing the page cache
    when it can; ``close()`` writes the tail and syncs.  Opened without following links."""

    def __init__(self, path: str | os.PathLike[str], offset: int) -> None:
        if offset % ALIGN:
            raise ValueError(f"offset {offset} is not a multiple of {ALIGN}")
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        self._plain = os.open(path, flags)
        self._direct: int | None
        try:
            self._direct = os.open(path, flags | os.O_DIRECT)
        except OSError:
            self._direct = None  # the file system does not take it: through the cache
        self._buffer = mmap.mmap(-1, BUFFER)
        self._view = memoryview(self._buffer)
        self._filled = 0
        self._offset = offset

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            room = BUFFER - self._filled
            take = min(room, len(view))
            self._view[self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == BUFFER:
                self._flush(BUFFER)

    def _flush(self, length: int) -> None:
        fd = self._direct if self._direct is not None else self._plain
        written = 0
        while written < length:
            try:
                written += os.pwrite(fd, self._view[written:length], self._offset + written)
            except OSError:
                if fd == self._plain:
                    raise
                # A direct write refused mid-way (some file systems refuse some sizes):
                # the rest of the file goes through the cache.
                os.close(fd)
                self._direct = None
                fd = self._plain
        self._offset += length
        self._filled = 0

    def close(self) -> int:
        """Write what is left, sync, close; the file's length."""
        try:
            filled = self._filled
            whole = filled - filled % 4096
            if whole:
                self._flush(whole)
            if filled > whole:  # the unaligned tail: through the cache
                os.pwrite(self._plain, self._view[whole:filled], self._offset)
                self._offset += filled - whole
            self._filled = 0
            os.fsync(self._plain)
            return self._offset
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without writing what is gathered (an error: the caller keeps what is on
        disk, a multiple of BUFFER from the start offset)."""
        self._view.release()
        self._buffer.close()
        for fd in (self._direct, self._plain):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._direct = None
