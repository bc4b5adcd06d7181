"""A layer's tar members, read from its decoded stream: headers, the end, the layer's errors.

:func:`read_layer` is the one loop every converter path reads a layer with: each header as
a :class:`Member` (the few fields the converters use; a ``tarfile.TarInfo`` carries about
twenty and a PAX dictionary, and an NGC image has 300,000+ members), the end-of-archive
checked explicitly (``tarfile`` takes a header it cannot parse, a short read or the
stream's end for the end of the archive and stops quietly), and the layer's digests
verified.  A broken stream or a tar that does not parse is the layer's
:class:`HostileLayerError`, with the byte it happened at.

Headers are read faster than ``tarfile`` reads them, with the same results: the one pass
reads every header of every layer in this process (340,000 at NGC scale), and
``tarfile.TarInfo.frombuf`` was a third of its time: it sums the 512 bytes twice (as
unsigned and as signed bytes, through a 504-item tuple each) and cuts each field apart on
its own.  :class:`FastTarInfo` takes the common header (a valid unsigned checksum, no old
GNU sparse map, no base-256 number) apart in one ``struct`` call and sums it once; any
other header goes to ``tarfile``'s own reading, so what a broken or unusual header raises
or yields is ``tarfile``'s answer.  Everything after the header (PAX records, GNU long
names, the member's data) is ``tarfile``'s as well.  Tested field by field against
``tarfile`` on random and corrupted headers (tests/unit/test_tarreader.py).
"""

from __future__ import annotations

import contextlib
import struct
import tarfile
from collections.abc import Callable, Iterator

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten.layerreader import STREAM_ERRORS, LayerReader, LayerSource

# name mode uid gid size mtime chksum type linkname (magic, version) uname gname devmajor
# devminor prefix (12 bytes of padding)
_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s8x32s32s8s8s155s12x")
_CHECKSUM_SPACES = 8 * 0x20  # the checksum field counts as eight spaces
_BASE256 = (0o200, 0o377)


class _Unusual(Exception):
    """A header the fast path leaves to tarfile."""


def _number(field: bytes) -> int:
    """An octal number field, as tarfile reads it (base-256 ones are left to tarfile)."""
    if field[0] in _BASE256:
        raise _Unusual
    digits = field.partition(b"\0")[0]
    try:
        return int(digits.decode("ascii").strip() or "0", 8)
    except ValueError:
        raise _Unusual from None  # tarfile raises its InvalidHeaderError for it


class FastTarInfo(tarfile.TarInfo):
    """A ``TarInfo`` whose header parsing takes the short way when it can."""

    __slots__ = ()

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> FastTarInfo:
        if len(buf) != tarfile.BLOCKSIZE or buf[156:157] == tarfile.GNUTYPE_SPARSE:
            return super().frombuf(buf, encoding, errors)
        try:
            return cls._common(buf, encoding, errors)
        except _Unusual:
            return super().frombuf(buf, encoding, errors)

    @classmethod
    def _common(cls, buf: bytes | bytearray, encoding: str, errors: str) -> FastTarInfo:
        if buf.count(0) == tarfile.BLOCKSIZE:
            raise _Unusual  # the end-of-archive block: tarfile raises EOFHeaderError
        (name, mode, uid, gid, size, mtime, checksum, kind, linkname, uname, gname,
         devmajor, devminor, prefix) = _HEADER.unpack(buf)
        found = _number(checksum)
        if found != sum(buf[:148]) + _CHECKSUM_SPACES + sum(buf[156:]):
            raise _Unusual  # a signed-byte checksum (old tars) or a bad one: tarfile decides
        info = cls()
        info.name = name.partition(b"\0")[0].decode(encoding, errors)
        info.mode = _number(mode)
        info.uid = _number(uid)
        info.gid = _number(gid)
        info.size = _number(size)
        info.mtime = _number(mtime)
        info.chksum = found
        info.type = kind
        info.linkname = linkname.partition(b"\0")[0].decode(encoding, errors)
        info.uname = uname.partition(b"\0")[0].decode(encoding, errors)
        info.gname = gname.partition(b"\0")[0].decode(encoding, errors)
        info.devmajor = _number(devmajor)
        info.devminor = _number(devminor)
        joined = prefix.partition(b"\0")[0].decode(encoding, errors)
        if kind == tarfile.AREGTYPE and info.name.endswith("/"):
            info.type = tarfile.DIRTYPE  # an old (V7) directory: a file named with a slash
        if info.type == tarfile.DIRTYPE:
            info.name = info.name.rstrip("/")
        if joined and info.type not in tarfile.GNU_TYPES:
            info.name = f"{joined}/{info.name}"  # ustar: the name's first part
        return info


class Member:
    """One tar member's name, type, mode, mtime, size, data offset and link target."""

    __slots__ = ("name", "type", "mode", "mtime", "size", "offset_data", "linkname")

    def __init__(self, info: tarfile.TarInfo) -> None:
        self.name: str = info.name
        self.type: bytes = info.type
        self.mode: int = info.mode
        self.mtime: int = int(info.mtime)
        self.size: int = info.size
        self.offset_data: int = info.offset_data
        self.linkname: str = info.linkname

    def isfile(self) -> bool:
        return self.type in tarfile.REGULAR_TYPES

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE

    def issym(self) -> bool:
        return self.type == tarfile.SYMTYPE

    def islnk(self) -> bool:
        return self.type == tarfile.LNKTYPE

    def ischr(self) -> bool:
        return self.type == tarfile.CHRTYPE

    def isblk(self) -> bool:
        return self.type == tarfile.BLKTYPE

    def isfifo(self) -> bool:
        return self.type == tarfile.FIFOTYPE


def read_layer(layer: LayerSource, source: LayerReader,
               on_member: Callable[[Member], None] | None = None) -> list[Member]:
    """Every member of ``layer`` in order, then its end and its digests checked.
    ``on_member`` sees each member as it is read, the stream standing at its data (tarfile
    skips whatever of the data it leaves)."""
    members: list[Member] = []
    end = 0
    with layer_errors(layer, source):
        with tarfile.open(fileobj=source, mode="r:", errorlevel=2, tarinfo=FastTarInfo) as tar:
            while (info := tar.next()) is not None:
                member = Member(info)
                members.append(member)
                if on_member is not None:
                    on_member(member)
            end = tar.offset
    with layer_errors(layer, source):
        _check_end(source, end, layer)
        source.verify(layer)
    return members


def _check_end(raw: LayerReader, end: int, layer: LayerSource) -> None:
    """What follows the last member must be the end-of-archive (zero blocks) and nothing
    else: tarfile stops quietly at a header it cannot parse, at a short read, or at the
    end of the stream, and reads all three as the end of the archive."""
    if raw.last_start == end:
        block = raw.last
    else:  # tarfile did not read there: the stream ended earlier
        block = b""
    if len(block) < tarfile.BLOCKSIZE:
        raise HostileLayerError(layer.digest, "(stream)",
                                f"truncated at byte {max(raw.position, end)}: no "
                                "end-of-archive")
    if block.strip(b"\0"):
        raise HostileLayerError(layer.digest, "(stream)",
                                f"a header that does not parse at byte {end}")
    position = end + tarfile.BLOCKSIZE
    while chunk := raw.read(raw.STEP):
        if chunk.strip(b"\0"):
            offset = position + len(chunk) - len(chunk.lstrip(b"\0"))
            raise HostileLayerError(layer.digest, "(stream)",
                                    f"data after the end-of-archive at byte {offset}")
        position += len(chunk)


@contextlib.contextmanager
def layer_errors(layer: LayerSource, source: LayerReader) -> Iterator[None]:
    """A broken compressed stream or a tar that does not parse, as the layer's error with
    the byte it happened at; a layer with no entries is legal (its first block ends the
    archive, which tarfile calls an empty file)."""
    try:
        yield
    except (*STREAM_ERRORS, tarfile.ReadError) as exc:  # type: ignore[misc]
        why = str(exc) or type(exc).__name__
        if not (isinstance(exc, tarfile.ReadError) and "empty file" in why):
            raise HostileLayerError(layer.digest, "(stream)", "truncated or corrupt layer "
                                    f"at byte {source.position}: {why}") from exc
