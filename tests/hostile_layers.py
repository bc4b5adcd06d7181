"""Hostile and broken layers, built in memory: the cases the converter must refuse.

Shared by tests/unit/test_hostile_layers.py (the flattening code alone, on files) and
tests/e2e/test_hostile_layers.py (pushed to a real registry and converted by the CLI).
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile


def entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"pwned\n",
          link: str = "", pax: dict[str, str] | None = None) -> tuple:
    return (name, kind, data, link, pax)


def layer(*entries: tuple, compress: bool = True) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, link, pax in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
            if pax:
                info.pax_headers = pax
            if kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    raw = buffer.getvalue()
    return gzip.compress(raw) if compress else raw


def raw_pax_layer(name_bytes: bytes) -> bytes:
    """A layer whose PAX path record holds bytes tarfile would never write itself."""
    record_body = b" path=" + name_bytes + b"\n"
    length = len(record_body)
    length += len(str(length + len(str(length))))
    record = str(length).encode() + record_body
    header = tarfile.TarInfo("././@PaxHeader")
    header.type = tarfile.XHDTYPE
    header.size = len(record)
    buffer = io.BytesIO()
    buffer.write(header.tobuf(tarfile.USTAR_FORMAT))
    buffer.write(record + b"\0" * (-len(record) % 512))
    body = tarfile.TarInfo("placeholder")
    body.size = 6
    buffer.write(body.tobuf(tarfile.USTAR_FORMAT))
    buffer.write(b"pwned\n" + b"\0" * 506 + b"\0" * 1024)
    return gzip.compress(buffer.getvalue())


BASE = layer(entry("etc/", tarfile.DIRTYPE), entry("etc/passwd", data=b"root:x:0:0\n"))
FIVE = layer(*[entry(f"f{i}", data=b"x" * 100) for i in range(5)], compress=False)
# Each of the five: one header block and one data block, so the third header is at 2048.
MEMBERS_END = 5 * 1024


def garbage_header() -> bytes:
    """GNU tar lists 5 files and exits 2; Python's tarfile sees 2 and stops quietly."""
    raw = bytearray(FIVE)
    raw[2048:2560] = (b"not a header " * 40)[:512]
    return gzip.compress(bytes(raw))


def bad_gzip_trailer() -> bytes:
    packed = bytearray(gzip.compress(FIVE))
    packed[-8] ^= 0xFF  # the CRC32 of the uncompressed data
    return bytes(packed)

# name -> (layers bottom first, expected words in the error)
CASES: dict[str, tuple[list[bytes], str]] = {
    "dotdot path": ([layer(entry("../escape"))], "'..' in the path"),
    "nested dotdot": ([layer(entry("a/b/../../../escape"))], "'..' in the path"),
    "absolute path": ([layer(entry("/etc/pwned"))], "absolute path"),
    "absolute symlink then write through it": (
        [layer(entry("sneaky", tarfile.SYMTYPE, link="/tmp")),
         layer(entry("sneaky/pwned"))], "its parent 'sneaky' is a symlink"),
    "symlink and write through it in one layer": (
        [layer(entry("root-link", tarfile.SYMTYPE, link="/"), entry("root-link/etc/pwned"))],
        "its parent 'root-link' is a symlink"),
    "relative symlink to a directory then write": (
        [BASE, layer(entry("lib", tarfile.SYMTYPE, link="etc"), entry("lib/pwned"))],
        "its parent 'lib' is a symlink"),
    "symlink climbing above the root": (
        [layer(entry("usr/", tarfile.DIRTYPE),
               entry("usr/up", tarfile.SYMTYPE, link="../../../etc/shadow"))],
        "climbs above the root"),
    "hard link outside with dotdot": (
        [layer(entry("evil", tarfile.LNKTYPE, link="../../etc/passwd"))],
        "'..' in the hard link target"),
    "hard link to an absolute path": (
        [layer(entry("evil", tarfile.LNKTYPE, link="/etc/passwd"))],
        "absolute hard link target"),
    "hard link to a missing file": (
        [layer(entry("evil", tarfile.LNKTYPE, link="does/not/exist"))],
        "which is not a file in the image"),
    "hard link to a directory": (
        [BASE, layer(entry("evil", tarfile.LNKTYPE, link="etc"))],
        "which is not a file in the image"),
    "whiteout climbing out": ([layer(entry("../.wh.passwd"))], "'..' in the path"),
    "huge name": ([layer(entry("a" * 100 + "/" + "b" * 4100))], "longer than 4095 bytes"),
    "huge component": ([layer(entry("d/" + "c" * 300))], "component longer than 255 bytes"),
    "NUL in a name": ([raw_pax_layer(b"etc/pa\x00sswd")], "NUL byte"),
    "truncated gzip": ([BASE[: len(BASE) // 2]], "truncated or corrupt layer"),
    "not a tar at all": ([gzip.compress(os.urandom(4096))], "truncated or corrupt layer"),
    "file data cut short": ([gzip.compress(layer(entry("big", data=b"x" * 20000),
                                                 compress=False)[:4096])],
                            "truncated or corrupt layer at byte"),
    "garbage header mid-layer": ([garbage_header()], "a header that does not parse at byte 2048"),
    "no end-of-archive": ([gzip.compress(FIVE[:MEMBERS_END])], "no end-of-archive"),
    "data after the end-of-archive": ([gzip.compress(FIVE + b"trailing junk" + b"\0" * 499)],
                                      f"data after the end-of-archive at byte {len(FIVE)}"),
    "bad gzip trailer": ([bad_gzip_trailer()], "corrupt layer"),
    "whiteout of dotdot": ([BASE, layer(entry("etc/.wh.."))], "which is not a plain name"),
    "whiteout of a whiteout": ([BASE, layer(entry("etc/.wh..wh.x"))], "not a plain name"),
}
