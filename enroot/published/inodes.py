"""What a squashfs file holds, read from its binary tables: every entry's path, kind and mode,
the owners it uses and whether it has extended attributes.

A published squashfs comes from whoever could push, so what it holds is read from the
structures the kernel itself reads, never from a tool's text listing (``rdsquashfs
--describe`` escapes ``"`` but not ``\\``, and keeps a newline in a name as it is: a crafted
name could make a set-uid file read as mode 0644).  The directory table gives each entry's name
and inode reference, the inode table its kind and mode, the id table the owners.  Every read is
bounded by the file's own size and by limits no real image reaches; anything that does not
parse raises :class:`SquashfsFormatError`, a one-line refusal.  Only metadata is read (a few
MB for an NGC image), never file data.

Layout (squashfs 4.0, little-endian): a 96-byte superblock; metadata blocks of at most 8 KiB
behind a 2-byte header (the size, bit 15 set when stored uncompressed); an inode reference is
``block offset in the table << 16 | offset in the uncompressed block``.
"""

from __future__ import annotations

import lzma
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lz4.block
import zstandard

from imgpipe.base.files import open_regular
from imgpipe.base.lzo import LzoError
from imgpipe.base.lzo import decompress as lzo_decompress
from imgpipe.enroot.errors import ConvertError

SUPERBLOCK = struct.Struct("<IIIIIHHHHHHQQQQQQQQ")  # 96 bytes
MAGIC = 0x73717368
NO_TABLE = 0xFFFFFFFFFFFFFFFF
METADATA_SIZE = 8192
METADATA_UNCOMPRESSED = 0x8000
INODE_HEADER = struct.Struct("<HHHHII")  # type, mode, uid index, gid index, mtime, number
_KIND_MODE = struct.Struct("<HH")  # an inode header's first two fields
DIR_HEADER = struct.Struct("<III")  # entries - 1, inode block, first inode number
DIR_ENTRY = struct.Struct("<HhHH")  # offset, inode number delta, type, name size - 1
MAX_DEPTH = 4096  # folders inside folders: far past what PATH_MAX allows
KINDS = {1: "dir", 2: "file", 3: "slink", 4: "blkdev", 5: "chrdev", 6: "pipe", 7: "sock"}
_KIND_OF = {**KINDS, **{number + 7: kind for number, kind in KINDS.items()}}  # extended: +7
_NUMBER_OF = {kind: number for number, kind in KINDS.items()}
_BASIC = [0, *range(1, 8), *range(1, 8)]  # an inode type number's basic type (0: none)
COMPRESSORS = {1: "gzip", 2: "lzma", 3: "lzo", 4: "xz", 5: "lz4", 6: "zstd"}


class SquashfsFormatError(ConvertError):
    """A squashfs file whose tables do not parse: refused, in one line."""


class Entry(NamedTuple):  # a tuple: one is made per entry (35,000 in bert's image)
    path: str  # relative to the root
    kind: str  # dir, file, slink, pipe, sock, blkdev, chrdev
    mode: int  # permission bits, set-id bits included


@dataclass(frozen=True)
class Superblock:
    inode_count: int
    compressor: int
    id_count: int
    root_inode: int
    bytes_used: int
    id_table: int
    xattr_table: int
    inode_table: int
    directory_table: int

    @classmethod
    def parse(cls, head: bytes) -> Superblock:
        if len(head) < SUPERBLOCK.size:
            raise SquashfsFormatError("too short for a squashfs superblock")
        fields = SUPERBLOCK.unpack(head[:SUPERBLOCK.size])
        if fields[0] != MAGIC:
            raise SquashfsFormatError("not a squashfs file")
        if (fields[9], fields[10]) != (4, 0):
            raise SquashfsFormatError(f"squashfs {fields[9]}.{fields[10]}, not 4.0")
        if fields[5] not in COMPRESSORS:
            raise SquashfsFormatError(f"an unknown compressor ({fields[5]})")
        return cls(inode_count=fields[1], compressor=fields[5], id_count=fields[8],
                   root_inode=fields[11], bytes_used=fields[12], id_table=fields[13],
                   xattr_table=fields[14], inode_table=fields[15], directory_table=fields[16])


class _Tables:
    """The file's metadata blocks, read on demand and kept (a few MB at NGC scale)."""

    def __init__(self, fd: int, superblock: Superblock, size: int) -> None:
        self.fd = fd
        self.sb = superblock
        self.size = min(size, superblock.bytes_used)
        self.blocks: dict[int, tuple[bytes, int]] = {}

    def block(self, position: int) -> tuple[bytes, int]:
        """The uncompressed bytes of the metadata block at ``position``, and where the next
        block starts."""
        cached = self.blocks.get(position)
        if cached is not None:
            return cached
        if not 0 < position <= self.size - 2:
            raise SquashfsFormatError(f"a metadata block outside the file (at {position})")
        (header,) = struct.unpack("<H", os.pread(self.fd, 2, position))
        length = header & ~METADATA_UNCOMPRESSED
        if not 0 < length <= METADATA_SIZE or position + 2 + length > self.size:
            raise SquashfsFormatError(f"a metadata block of a bad size (at {position})")
        raw = os.pread(self.fd, length, position + 2)
        data = raw if header & METADATA_UNCOMPRESSED else self._inflate(raw, position)
        self.blocks[position] = (data, position + 2 + length)
        if len(self.blocks) > 1 << 20:
            raise SquashfsFormatError("more metadata than any image holds")
        return self.blocks[position]

    def _inflate(self, raw: bytes, position: int) -> bytes:
        method = COMPRESSORS[self.sb.compressor]
        try:
            if method == "gzip":
                inflater = zlib.decompressobj()
                data = inflater.decompress(raw, METADATA_SIZE)
                if inflater.unconsumed_tail:
                    raise ValueError("over 8 KiB")
            elif method in ("xz", "lzma"):
                data = lzma.LZMADecompressor().decompress(raw, METADATA_SIZE + 1)
            elif method == "zstd":
                data = zstandard.ZstdDecompressor().decompress(
                    raw, max_output_size=METADATA_SIZE)
            elif method == "lz4":
                data = lz4.block.decompress(raw, uncompressed_size=METADATA_SIZE)
            else:
                data = lzo_decompress(raw, METADATA_SIZE)
        except (zlib.error, lzma.LZMAError, zstandard.ZstdError, LzoError, ValueError,
                RuntimeError) as exc:
            raise SquashfsFormatError(f"a {method} metadata block that does not decompress "
                                      f"(at {position}: {exc})") from None
        if not data or len(data) > METADATA_SIZE:
            raise SquashfsFormatError(f"a metadata block of a bad size (at {position})")
        return data

    def read(self, table: int, block: int, offset: int, count: int) -> tuple[bytes, int, int]:
        """``count`` bytes of a table from (block, offset), across blocks; returns them and
        the (block, offset) just past them."""
        out = bytearray()
        while len(out) < count:
            data, following = self.block(table + block)
            if offset > len(data):
                raise SquashfsFormatError("a reference past the end of a metadata block")
            taken = data[offset:offset + count - len(out)]
            out += taken
            if len(out) == count:
                return bytes(out), block, offset + len(taken)
            block, offset = following - table, 0
        return b"", block, offset


def _inode(tables: _Tables, reference: int) -> tuple[str, int, int, int, int]:
    """(kind, mode, directory block, directory offset, listing size) of an inode; the last
    three only for a directory."""
    block, offset = reference >> 16, reference & 0xFFFF
    if block >= 1 << 32 or offset >= METADATA_SIZE:
        raise SquashfsFormatError(f"an inode reference that points nowhere ({reference:#x})")
    data, _ = tables.block(tables.sb.inode_table + block)
    if offset + INODE_HEADER.size <= len(data):  # most inodes: within one block
        kind_number, mode = _KIND_MODE.unpack_from(data, offset)
        offset += INODE_HEADER.size
    else:
        head, block, offset = tables.read(tables.sb.inode_table, block, offset,
                                          INODE_HEADER.size)
        kind_number, mode = _KIND_MODE.unpack_from(head)
    basic = kind_number - 7 if kind_number > 7 else kind_number
    if basic not in KINDS or kind_number > 14:
        raise SquashfsFormatError(f"an inode of unknown type {kind_number}")
    kind = KINDS[basic]
    if kind != "dir":
        return kind, mode, 0, 0, 0
    if kind_number == 1:  # start block, links, listing size (+3), offset, parent
        body, _, _ = tables.read(tables.sb.inode_table, block, offset, 16)
        start, _, size, dir_offset, _ = struct.unpack("<IIHHI", body)
    else:  # links, listing size (+3), start block, parent, index count, offset, xattr
        body, _, _ = tables.read(tables.sb.inode_table, block, offset, 24)
        _, size, start, _, _, dir_offset, _ = struct.unpack("<IIIIHHI", body)
    return kind, mode, start, dir_offset, max(size - 3, 0)


def entries(path: Path) -> list[Entry]:
    """Every entry of the squashfs file at ``path`` but its root (SquashfsFormatError)."""
    fd = open_regular(path)
    try:
        tables = _Tables(fd, Superblock.parse(os.pread(fd, SUPERBLOCK.size, 0)),
                         os.fstat(fd).st_size)
        return _walk(tables)[0]
    finally:
        os.close(fd)


def kinds(path: Path) -> dict[str, int]:
    """How many entries of each kind the squashfs file at ``path`` holds below its root, read
    as ``entries`` reads them (the same refusals) without making a name of each."""
    fd = open_regular(path)
    try:
        tables = _Tables(fd, Superblock.parse(os.pread(fd, SUPERBLOCK.size, 0)),
                         os.fstat(fd).st_size)
        return _walk(tables, named=False)[1]
    finally:
        os.close(fd)


def _walk(tables: _Tables, named: bool = True) -> tuple[list[Entry], dict[str, int]]:
    """Every entry below the root, each name's inode read by its reference (what the
    kernel follows): the entries (none unless ``named``) and how many of each kind.  One
    loop, not a generator per listing and a call per inode: it is the last thing every
    receiving node of a broadcast does, on a file of 35,000 entries (issue #61)."""
    kind, mode, start, offset, size = _inode(tables, tables.sb.root_inode)
    if kind != "dir":
        raise SquashfsFormatError("its root is not a directory")
    found: list[Entry] = []
    tally = [0] * len(_BASIC)  # entries by inode type number
    pending = [("", start, offset, size, 0)]
    seen: set[tuple[int, int]] = set()
    total, limit = 0, max(tables.sb.inode_count, 1) * 64
    inode_table, directory_table = tables.sb.inode_table, tables.sb.directory_table
    blocks, kind_mode, entry_at = tables.blocks, _KIND_MODE.unpack_from, DIR_ENTRY.unpack_from
    while pending:
        prefix, start, offset, size, depth = pending.pop()
        if size == 0:
            continue  # an empty folder: writers may point every one at the same place
        if (start, offset) in seen or depth > MAX_DEPTH:
            raise SquashfsFormatError("a directory listed twice, or inside itself")
        seen.add((start, offset))
        data, _, _ = tables.read(directory_table, start, offset, size)
        position, end = 0, len(data)
        while position < end:
            if position + DIR_HEADER.size > end:
                raise SquashfsFormatError("a directory listing cut inside a header")
            count, inode_block, _ = DIR_HEADER.unpack_from(data, position)
            position += DIR_HEADER.size
            if count >= 256:
                raise SquashfsFormatError("a directory header over 256 entries")
            total += count + 1
            if total > limit:
                raise SquashfsFormatError("more entries than its inodes allow")
            for _ in range(count + 1):
                if position + DIR_ENTRY.size > end:
                    raise SquashfsFormatError("a directory listing cut inside an entry")
                inode_offset, _, listed, name_size = entry_at(data, position)
                position += DIR_ENTRY.size
                raw = data[position:position + name_size + 1]
                position += name_size + 1
                if len(raw) != name_size + 1 or b"/" in raw or b"\0" in raw \
                        or raw in (b".", b".."):
                    raise SquashfsFormatError(f"a name no squashfs writer makes ({raw[:40]!r})")
                reference = inode_block << 16 | inode_offset
                cached = blocks.get(inode_table + inode_block)  # most: a block already read
                if cached is not None and inode_offset + INODE_HEADER.size <= len(cached[0]):
                    number, mode = kind_mode(cached[0], inode_offset)
                else:
                    number, mode = _kind_number(tables, inode_table, reference)
                if not 0 < number < len(_BASIC):
                    raise SquashfsFormatError(f"an inode of unknown type {number}")
                if _BASIC[number] != listed:  # an extended inode lists as its basic type
                    raise SquashfsFormatError(f"{prefix}{_name(raw)!r}: listed as one kind, "
                                              "stored as another")
                tally[number] += 1
                if named:
                    found.append(Entry(prefix + _name(raw), _KIND_OF[number], mode))
                if number == 1 or number == 8:  # a folder, basic or extended
                    _, _, child_start, child_offset, child_size = _inode(tables, reference)
                    pending.append((f"{prefix}{_name(raw)}/" if named else "", child_start,
                                    child_offset, child_size, depth + 1))
    counted: dict[str, int] = {}
    for number, count in enumerate(tally):
        if count:
            counted[_KIND_OF[number]] = counted.get(_KIND_OF[number], 0) + count
    return found, counted


def _name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _kind_number(tables: _Tables, inode_table: int, reference: int) -> tuple[int, int]:
    """An inode's type number and mode, read from its block (``_inode`` where its header
    crosses into the next block)."""
    block, offset = reference >> 16, reference & 0xFFFF
    if block < 1 << 32 and offset + INODE_HEADER.size <= METADATA_SIZE:
        cached = tables.blocks.get(inode_table + block) or tables.block(inode_table + block)
        if offset + INODE_HEADER.size <= len(cached[0]):
            number, mode = _KIND_MODE.unpack_from(cached[0], offset)
            return number, mode
    kind, mode, _, _, _ = _inode(tables, reference)
    return _NUMBER_OF[kind], mode


def owners_and_xattrs(path: Path) -> tuple[set[int], bool]:
    """The uids and gids a squashfs file uses (its id table) and whether it has extended
    attributes (file capabilities live there)."""
    fd = open_regular(path)
    try:
        superblock = Superblock.parse(os.pread(fd, SUPERBLOCK.size, 0))
        tables = _Tables(fd, superblock, os.fstat(fd).st_size)
        count = superblock.id_count
        blocks = (count * 4 + METADATA_SIZE - 1) // METADATA_SIZE
        if not 0 < blocks <= 64 or superblock.id_table + 8 * blocks > tables.size:
            raise SquashfsFormatError(f"an id table of {count} ids")
        pointers = struct.unpack(f"<{blocks}Q", os.pread(fd, 8 * blocks, superblock.id_table))
        ids: list[int] = []
        for pointer in pointers:
            data, _ = tables.block(pointer)
            ids += struct.unpack(f"<{len(data) // 4}I", data[:len(data) // 4 * 4])
        if len(ids) < count:
            raise SquashfsFormatError(f"an id table shorter than its {count} ids")
        return set(ids[:count]), superblock.xattr_table != NO_TABLE
    finally:
        os.close(fd)
