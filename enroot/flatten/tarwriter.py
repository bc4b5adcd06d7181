"""The tar writer: entries of the flattened root as a GNU tar stream, every one owned by root.

An :class:`Item` is one entry as it goes out (path, kind, mode, time, and for a file its
bytes to read); :func:`write_item` writes its header and data.  Headers are built directly
for the common case and are the same bytes ``tarfile`` writes (which writes the rest: long
names as ``././@LongLink``); data goes out in 1 MiB writes (``tarfile``'s own stream copied
every file in 16 KiB pieces through a buffer it re-slices: a third of the second pass's
time).  :class:`Out` is the squash tool's end of the stream, which may take bytes spliced
pipe to pipe.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import tarfile
from dataclasses import dataclass
from typing import IO, Protocol

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten.layerreader import STREAM_ERRORS, ChunkReader, LayerSource
from imgpipe.enroot.flatten.rules import IMPLICIT_DIR_MODE
from imgpipe.enroot.flatten.tarreader import Member

TAR_ENCODING = "utf-8"  # tarfile's default on Linux (the file system encoding)
COPY_CHUNK = 1 << 20
END_OF_ARCHIVE = bytes(2 * tarfile.BLOCKSIZE)
_TAR_TYPES = {"dir": tarfile.DIRTYPE, "file": tarfile.REGTYPE, "hardlink": tarfile.LNKTYPE,
              "symlink": tarfile.SYMTYPE, "fifo": tarfile.FIFOTYPE}
# A GNU header's fields, in order (name, mode, uid, gid, size, mtime, chksum, typeflag,
# linkname, magic+version, uname, gname, devmajor, devminor, prefix, padding).
_GNU_HEADER = struct.Struct("100s8s8s8s12s12s8s1s100s8s32s32s8s8s155s12x")
_OCTAL_11 = 8 ** 11  # sizes and times from here need tarfile's base-256 encoding


class Readable(Protocol):
    """What an entry's bytes come from: a file, a spool, a layer stream."""

    def read(self, size: int = ..., /) -> bytes | memoryview:
        ...


class Writable(Protocol):
    """Where the stream goes: tar2sqfs's stdin, a file, a buffer."""

    def write(self, data: bytes | memoryview, /) -> object:
        ...


@dataclass(frozen=True)
class Item:
    """One entry of the flattened root, as it is written."""

    path: str
    kind: str  # dir | file | hardlink | symlink | fifo
    mode: int
    mtime: int
    size: int = 0
    data: Readable | None = None  # for files: exactly ``size`` bytes to read
    link: str | None = None  # symlink target, or the path a hard link shares bytes with


def implicit_dir(path: str) -> Item:
    """A folder no layer described, only implied by a path below it."""
    return Item(path, "dir", IMPLICIT_DIR_MODE, 0)


def tar_header(item: Item) -> bytes:
    """An entry's header: GNU format (long names as ././@LongLink), owned by root.

    Built directly for the common case, a name and link of at most 100 bytes (tarfile's
    ``TarInfo.tobuf`` takes 18.7 us an entry, this 4.0 us: 4.6 s at the 315,000 entries
    of an NGC image); the same bytes as tarfile's, which writes the rest."""
    name = item.path.encode(TAR_ENCODING, "surrogateescape")
    if item.kind == "dir" and not name.endswith(b"/"):
        name += b"/"  # as tarfile names directories
    link = (item.link or "").encode(TAR_ENCODING, "surrogateescape")
    if (len(name) > tarfile.LENGTH_NAME or len(link) > tarfile.LENGTH_LINK
            or not 0 <= item.size < _OCTAL_11 or not 0 <= item.mtime < _OCTAL_11):
        return _tarfile_header(item)
    block = _GNU_HEADER.pack(
        name, b"%07o\0" % (item.mode & 0o7777), b"0000000\0", b"0000000\0",
        b"%011o\0" % item.size, b"%011o\0" % item.mtime, b"        ",
        _TAR_TYPES[item.kind], link, tarfile.GNU_MAGIC, b"root", b"root", b"", b"", b"")
    return block[:148] + b"%06o\0" % sum(block) + block[155:]


def _tarfile_header(item: Item) -> bytes:
    info = tarfile.TarInfo(item.path)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = item.mode
    info.mtime = item.mtime
    info.type = _TAR_TYPES[item.kind]
    if item.kind == "file":
        info.size = item.size
    if item.link is not None:
        info.linkname = item.link
    return info.tobuf(tarfile.GNU_FORMAT, TAR_ENCODING, "surrogateescape")


def write_item(item: Item, out: Writable) -> None:
    """One entry of the flattened root: its header, its data."""
    out.write(tar_header(item))
    if item.kind == "file" and item.size:
        assert item.data is not None
        left = item.size
        while left:
            chunk = item.data.read(min(COPY_CHUNK, left))
            if not chunk:
                raise OSError(f"{item.path}: the data ended {left} bytes early")
            out.write(chunk)
            left -= len(chunk)
        write_padding(item.size, out)


def write_padding(size: int, out: Writable) -> None:
    """The zeros that fill a file's data to a whole tar block."""
    if size % tarfile.BLOCKSIZE:
        out.write(bytes(tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE))


class WriteFailed(Exception):
    """Writing the stream failed (the squash tool stopped reading, a full disk): not the
    layer's fault, whatever OSError it was."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class Out:
    """The stream's consumer; a failed write raises :class:`WriteFailed`."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.is_pipe = False  # the squash tool's stdin: bytes may be spliced into it
        with contextlib.suppress(OSError, ValueError):
            self.is_pipe = stat.S_ISFIFO(os.fstat(raw.fileno()).st_mode)

    def write(self, data: bytes | memoryview, /) -> int:
        try:
            self.raw.write(data)
        except OSError as exc:
            raise WriteFailed(exc) from exc
        return len(data)

    def splice(self, source: int, count: int) -> int:
        """Up to ``count`` bytes moved from the pipe ``source`` into this one, after what
        is buffered."""
        try:
            self.raw.flush()
            return os.splice(source, self.raw.fileno(), count)
        except OSError as exc:
            raise WriteFailed(exc) from exc


class Exact:
    """One member's data, read from its layer's stream without a copy (a read may return
    fewer bytes than asked); a stream that ends early is the layer's error."""

    def __init__(self, source: ChunkReader, size: int, layer: LayerSource,
                 member: Member) -> None:
        self.source, self.left, self.layer, self.member = source, size, layer, member

    def read(self, n: int = -1) -> bytes | memoryview:
        n = self.left if n < 0 else min(n, self.left)
        if not n:
            return b""
        try:
            data = self.source.read_view(n)
        except STREAM_ERRORS as exc:
            raise HostileLayerError(self.layer.digest, self.member.name,
                                    f"truncated or corrupt layer at byte "
                                    f"{self.source.position}: {exc}") from exc
        if not data:
            raise HostileLayerError(self.layer.digest, self.member.name,
                                    f"truncated or corrupt layer at byte "
                                    f"{self.source.position}: it ends inside this file")
        self.left -= len(data)
        return data
