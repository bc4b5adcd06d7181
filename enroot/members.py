"""What pass 1 keeps of each tar member: the few fields pass 2 and the checks read.

An NGC image has 300,000+ members, and a ``tarfile.TarInfo`` carries about twenty fields and
a PAX header dictionary each: kept for every member of every layer they were most of the
converter's memory, which grew with the file count (238 MiB of RSS at 105,000 files).  A
``Member`` has seven slots; the ``TarInfo`` objects of a layer are dropped once it is read.
"""

from __future__ import annotations

import tarfile


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
