"""Large downloads written around the page cache: the bytes land exactly, wherever the file
system stands on O_DIRECT, and a resumed write starts only at an aligned offset."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from imgpipe.base.directio import ALIGN, BUFFER, DirectWriter


def _chunks(data: bytes) -> list[bytes]:
    rng, out, at = random.Random(7), [], 0
    while at < len(data):
        size = rng.choice([1, 4095, 4096, 65537, 1 << 20, 3 << 20])
        out.append(data[at:at + size])
        at += size
    return out


@pytest.mark.parametrize("folder", ["tmp_path", "/dev/shm"])
def test_every_byte_lands_in_order_direct_or_not(folder: str, tmp_path: Path) -> None:
    where = tmp_path if folder == "tmp_path" else Path(folder)
    path = where / f"directio-{os.getpid()}.bin"
    data = random.Random(1).randbytes(2 * BUFFER + 12345)
    head = data[:ALIGN]
    try:
        path.write_bytes(head)  # what an interrupted run kept
        writer = DirectWriter(path, ALIGN)
        for chunk in _chunks(data[ALIGN:]):
            writer.write(chunk)
        assert writer.close() == len(data)
        assert path.read_bytes() == data
    finally:
        path.unlink(missing_ok=True)


def test_a_resume_starts_only_at_an_aligned_offset(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="not a multiple"):
        DirectWriter(path, 100)


def test_a_link_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "target").write_bytes(b"")
    with pytest.raises(OSError):
        DirectWriter(tmp_path / "link", 0)
