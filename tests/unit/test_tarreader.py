"""enroot.flatten.tarreader reads every tar header as tarfile does: the same fields, or the
same error, on headers of every format and on thousands of corrupted ones; and whole archives read
through it list the same members."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

from imgpipe.enroot.flatten.tarreader import FastTarInfo

FIELDS = ("name", "mode", "uid", "gid", "size", "mtime", "chksum", "type", "linkname",
          "uname", "gname", "devmajor", "devminor")
ENCODING, ERRORS = "utf-8", "surrogateescape"
NAMES = ["usr/lib/python3/dist-packages/torch/__init__.py", "etc/", "a" * 99,
         "deep/" * 30 + "file.so", "ünïcödé/ファイル", "dir/with/slash/", ".wh..wh..opq",
         "usr/share/doc/" + "x" * 140]


def read(cls: type[tarfile.TarInfo], buf: bytes) -> tuple[str, ...] | str:
    """The fields ``cls`` reads from ``buf``, or the name of what it raises."""
    try:
        info = cls.frombuf(buf, ENCODING, ERRORS)
    except Exception as exc:  # the error class is what must match
        return type(exc).__name__
    return tuple(repr(getattr(info, field)) for field in FIELDS) + (
        repr(getattr(info, "_sparse_structs", None)),)


def header(rng: random.Random, fmt: int) -> bytes:
    info = tarfile.TarInfo(rng.choice(NAMES))
    info.type = rng.choice([tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                            tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE])
    info.size = rng.choice([0, 1, 511, 4096, 2**31 + 7, 9 * 2**30]) if info.isreg() else 0
    info.mode = rng.choice([0o644, 0o755, 0o4755, 0o1777])
    info.mtime = rng.choice([0, 1_700_000_000, 2**33 + 5])
    info.uid = info.gid = rng.choice([0, 1000, 65534, 2**21 + 3])
    info.uname, info.gname = rng.choice([("", ""), ("root", "root"), ("üser", "grp")])
    info.linkname = rng.choice(NAMES) if info.issym() or info.islnk() else ""
    if info.ischr():
        info.devmajor, info.devminor = 4, 64
    data = info.tobuf(fmt, ENCODING, ERRORS)
    return data[-tarfile.BLOCKSIZE:]  # the member's own header, after PAX or GNU records


def corrupt(rng: random.Random, buf: bytes) -> bytes:
    """``buf`` with a few bytes changed, the checksum then fixed (or not)."""
    data = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(tarfile.BLOCKSIZE)
        data[at] = rng.choice([0, 0x20, 0x2F, 0x37, 0x38, 0x80, 0xFF, rng.randrange(256)])
    if rng.random() < 0.7:
        data[148:156] = b" " * 8
        data[148:156] = b"%06o\0 " % (sum(data) & 0o777777)
    if rng.random() < 0.1:  # the old signed checksum
        data[148:156] = b" " * 8
        signed = sum(b - 256 if b > 127 else b for b in data)
        data[148:156] = b"%06o\0 " % (signed & 0o777777)
    return bytes(data)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_every_header_reads_as_tarfile_reads_it(fmt: int) -> None:
    rng = random.Random(fmt)
    checked = 0
    for _ in range(600):
        try:
            buf = header(rng, fmt)
        except ValueError:
            continue  # too long or too large for ustar: tarfile cannot write it either
        assert read(FastTarInfo, buf) == read(tarfile.TarInfo, buf)
        checked += 1
        for _ in range(5):
            bad = corrupt(rng, buf)
            assert read(FastTarInfo, bad) == read(tarfile.TarInfo, bad), bad
    assert checked > 150


def test_common_headers_take_the_short_way() -> None:
    """What a layer mostly holds is read without tarfile's own header code."""
    for name in NAMES:
        info = tarfile.TarInfo(name)
        info.size, info.mtime = 1234, 1_700_000_000
        buf = info.tobuf(tarfile.GNU_FORMAT)[-tarfile.BLOCKSIZE:]
        fast = FastTarInfo._common(buf, ENCODING, ERRORS)
        assert read(tarfile.TarInfo, buf) == read(FastTarInfo, buf)
        assert fast.size == 1234


@pytest.mark.parametrize("buf", [b"", b"\0" * 100, b"\0" * 512, b"\xff" * 512, b" " * 512],
                         ids=["empty", "short", "zeros", "ones", "spaces"])
def test_odd_blocks_raise_what_tarfile_raises(buf: bytes) -> None:
    assert read(FastTarInfo, buf) == read(tarfile.TarInfo, buf)


def test_whole_archives_list_the_same_members() -> None:
    rng = random.Random(7)
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=fmt) as tar:
            for number in range(200):
                info = tarfile.TarInfo(f"{rng.choice(NAMES)}{number}")
                payload = rng.randbytes(rng.choice([0, 5, 600]))
                info.size = len(payload)
                info.pax_headers = {"comment": "x"} if number % 7 == 0 else {}
                tar.addfile(info, io.BytesIO(payload))
        listed = []
        for cls in (tarfile.TarInfo, FastTarInfo):
            raw.seek(0)
            with tarfile.open(fileobj=raw, mode="r:", tarinfo=cls) as tar:
                listed.append([(m.name, m.size, m.offset_data, m.type, m.mode, m.mtime)
                               for m in tar])
        assert listed[0] == listed[1] and len(listed[0]) == 200
