"""Tar headers read faster than ``tarfile`` reads them, with the same results.

The one pass reads every header of every layer in this process (340,000 at NGC scale), and
``tarfile.TarInfo.frombuf`` was a third of its time: it sums the 512 bytes twice (as
unsigned and as signed bytes, through a 504-item tuple each) and cuts each field apart on
its own.  :class:`FastTarInfo` takes the common header (a valid unsigned checksum, no old
GNU sparse map, no base-256 number) apart in one ``struct`` call and sums it once; any
other header goes to ``tarfile``'s own reading, so what a broken or unusual header raises
or yields is ``tarfile``'s answer.  Everything after the header (PAX records, GNU long
names, the member's data) is ``tarfile``'s as well: the class is handed to
``tarfile.open(..., tarinfo=FastTarInfo)``.  Tested field by field against ``tarfile`` on
random and corrupted headers (tests/unit/test_tarinfo.py).
"""

from __future__ import annotations

import struct
import tarfile

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
