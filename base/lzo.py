"""LZO1X decompression, for the metadata blocks of squashfs files made with ``-comp lzo``.

Enroot squashes with LZO by default, so a published ``lzo-enroot`` squashfs has its inode and
directory tables in LZO1X blocks of at most 8 KiB.  No LZO binding installs from the package
registries without a compiler and liblzo2's headers (python-lzo ships no wheels), so the
decoder is written here from the format's description (the Linux kernel's
Documentation/staging/lzo.rst): a first byte that may start with literals, then instructions
whose top bits say the kind of copy, each followed by 0-3 literals it encodes.  Meant for
small blocks; every length and distance is checked, so a hostile block raises
:class:`LzoError` and never reads or writes out of bounds.
"""

from __future__ import annotations

__all__ = ["LzoError", "decompress"]


class LzoError(ValueError):
    """The block is not valid LZO1X, or it decompresses to more than allowed."""


class _Input:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise LzoError("the block ends inside an instruction")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def take(self, count: int) -> bytes:
        if self.pos + count > len(self.data):
            raise LzoError("the block ends inside a literal run")
        chunk = self.data[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def length(self, short: int, base: int) -> int:
        """``short`` if non-zero, else ``base`` plus 255 per zero byte plus the next byte."""
        if short:
            return short
        extra = 0
        while (value := self.byte()) == 0:
            extra += 255
        return base + extra + value


def _copy_match(out: bytearray, distance: int, length: int, limit: int) -> None:
    if distance > len(out) or distance <= 0:
        raise LzoError("a match reaches before the start of the block")
    if len(out) + length > limit:
        raise LzoError(f"the block decompresses to more than {limit} bytes")
    start = len(out) - distance
    if distance >= length:
        out += out[start:start + length]
    else:  # overlapping: the run repeats what it is writing
        for index in range(length):
            out.append(out[start + index])


def decompress(data: bytes, limit: int = 8192) -> bytes:
    """The bytes an LZO1X block holds, at most ``limit`` of them (raises LzoError)."""
    source = _Input(data)
    out = bytearray()
    state = 0

    def literals(count: int) -> None:
        if len(out) + count > limit:
            raise LzoError(f"the block decompresses to more than {limit} bytes")
        out.extend(source.take(count))

    first = source.byte()
    if first == 17:
        raise LzoError("an LZO-RLE stream (bitstream version 1), which squashfs never writes")
    if first > 17:
        literals(first - 17)
        state = min(first - 17, 4)
    else:
        source.pos = 0
    while True:
        op = source.byte()
        if op < 16:
            if state == 0:  # a long literal run
                count = source.length(op, 15) + 3
                literals(count)
                state = 4
                continue
            distance = (source.byte() << 2) + (op >> 2) + (1 if state < 4 else 2049)
            length = 2 if state < 4 else 3
        elif op < 32:
            length = source.length(op & 7, 7) + 2
            low = source.byte() | source.byte() << 8
            distance = 16384 + ((op & 8) << 11) + (low >> 2)
            if distance == 16384:
                return bytes(out)  # the end marker
            op = low
        elif op < 64:
            length = source.length(op & 31, 31) + 2
            low = source.byte() | source.byte() << 8
            distance = (low >> 2) + 1
            op = low
        elif op < 128:
            length = 3 + ((op >> 5) & 1)
            distance = (source.byte() << 3) + ((op >> 2) & 7) + 1
        else:
            length = 5 + ((op >> 5) & 3)
            distance = (source.byte() << 3) + ((op >> 2) & 7) + 1
        _copy_match(out, distance, length, limit)
        state = op & 3
        if state:
            literals(state)
