"""The chunk pipeline of ``enroot.distribution: broadcast`` without a cluster
(enroot.published.relay): what a receiver takes from a header, writing and hashing unit by
unit, what it keeps of a broken copy for its own fetch, and the sender's wait on its fetch."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from imgpipe.enroot.published.relay import UNIT, Header, Prefix, Receiver, RelayError
from imgpipe.registry.ranges import MIN_CHUNK_SIZE, Checked


def _squashfs(tmp_path: Path, size: int) -> bytes:
    """A real squashfs of about ``size`` bytes (random content: it does not compress)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("data.bin")
        info.size, info.mode = size, 0o644
        tar.addfile(info, io.BytesIO(os.urandom(size)))
    out = tmp_path / "image.sqsh"
    subprocess.run(["tar2sqfs", "--quiet", "--no-skip", "--compressor", "zstd", str(out)],
                   input=buffer.getvalue(), check=True, capture_output=True, timeout=60)
    return out.read_bytes()


def _header(data: bytes, chunk_size: int = MIN_CHUNK_SIZE) -> Header:
    digests = tuple(hashlib.sha256(data[i:i + chunk_size]).hexdigest()
                    for i in range(0, len(data), chunk_size))
    return Header("sha256:" + hashlib.sha256(data).hexdigest(), len(data), chunk_size, digests)


def _receive(tmp_path: Path, header: Header, data: bytes, broken_unit: int = -1
             ) -> tuple[Receiver, Path | str]:
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700, exist_ok=True)
    receiver = Receiver(header, folder / "blob.part", tmp_path / "entry.sqsh", 0o644)
    for index in range(header.units()):
        length = header.unit_length(index)
        buffer = receiver.buffer()
        buffer[:length] = data[index * UNIT:index * UNIT + length]
        if index == broken_unit:
            buffer[100] ^= 0xFF
        receiver.put(buffer, length)
    return receiver, receiver.finish()


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """About 20 MiB: three units, three chunks of the minimum size, the last ones shorter."""
    return _squashfs(tmp_path_factory.mktemp("relay"), 20 << 20)


def test_a_header_round_trips_and_bad_ones_are_refused() -> None:
    header = Header("sha256:" + "a" * 64, 3 * MIN_CHUNK_SIZE, MIN_CHUNK_SIZE, ("b" * 64,) * 3)
    assert Header.decode(header.encode()) == header
    header.check(frozenset({header.blob}))
    with pytest.raises(RelayError, match="is not a pin of this job"):
        header.check(frozenset({"sha256:" + "c" * 64}))
    for bad in (b"not json", b'{"blob": "x"}', b"[1]",
                Header(header.blob, 0).encode(),
                Header(header.blob, 3 * MIN_CHUNK_SIZE, 1 << 16, ("b" * 64,) * 3).encode(),
                Header(header.blob, 3 * MIN_CHUNK_SIZE, MIN_CHUNK_SIZE, ("b" * 64,)).encode(),
                b" " * (2 << 20)):
        with pytest.raises(RelayError):
            Header.decode(bad)


def test_units_arrive_written_and_hashed_and_become_the_entry(tmp_path: Path, image: bytes
                                                              ) -> None:
    header = _header(image)
    assert header.units() == 3 and header.unit_length(2) == len(image) - 2 * UNIT
    receiver, got = _receive(tmp_path, header, image)
    assert got == tmp_path / "entry.sqsh"
    assert got.read_bytes() == image and (got.stat().st_mode & 0o777) == 0o644
    assert not receiver.partial.exists()


def test_a_broken_unit_keeps_the_chunks_before_it_for_the_nodes_own_fetch(
        tmp_path: Path, image: bytes) -> None:
    header = _header(image)
    receiver, got = _receive(tmp_path, header, image, broken_unit=1)
    assert isinstance(got, str) and got.startswith("the bytes hash to sha256:")
    assert got.endswith("keeping chunks 0-0, fetching chunks 1-2 from the registry"), got
    assert receiver.partial.read_bytes() == image[:MIN_CHUNK_SIZE]
    assert not (tmp_path / "entry.sqsh").exists()
    # Without the sender's list nothing is kept: the node's fetch starts from zero.
    receiver, got = _receive(tmp_path, Header(header.blob, header.size), image, broken_unit=0)
    assert isinstance(got, str) and got.endswith("; fetching it from the registry")
    assert receiver.partial.stat().st_size == 0


def test_a_stream_that_stops_early_keeps_what_checks(tmp_path: Path, image: bytes) -> None:
    header = _header(image)
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    receiver = Receiver(header, folder / "blob.part", tmp_path / "entry.sqsh", 0o644)
    buffer = receiver.buffer()
    buffer[:UNIT] = image[:UNIT]
    receiver.put(buffer, UNIT)
    why = receiver.abandon("the batch host's fetch failed")
    assert why == ("the batch host's fetch failed; keeping chunks 0-0, fetching chunks 1-2 "
                   "from the registry")
    assert receiver.partial.read_bytes() == image[:MIN_CHUNK_SIZE]


def test_bytes_that_are_not_a_squashfs_are_refused_though_they_hash_right(tmp_path: Path
                                                                          ) -> None:
    data = os.urandom(UNIT + 5)
    _, got = _receive(tmp_path, _header(data), data)
    assert isinstance(got, str) and "fetching it from the registry" in got
    assert not (tmp_path / "entry.sqsh").exists()


def test_a_copy_that_does_not_fit_is_refused_before_anything_is_written(tmp_path: Path
                                                                        ) -> None:
    with pytest.raises(RelayError, match="do not fit"):
        Receiver(Header("sha256:" + "a" * 64, 1 << 60), tmp_path / "blob.part",
                 tmp_path / "entry.sqsh", 0o644)
    assert not (tmp_path / "blob.part").exists()


def test_the_sender_waits_for_each_unit_its_fetch_has_checked(tmp_path: Path) -> None:
    prefix, blob = Prefix(), "sha256:" + "a" * 64
    seen: list[bool] = []

    def sender() -> None:
        assert prefix.started() is not None
        seen.append(prefix.wait(blob, UNIT))
        seen.append(prefix.wait(blob, 3 * UNIT))

    thread = threading.Thread(target=sender)
    thread.start()
    time.sleep(0.05)
    assert seen == []  # nothing checked yet
    prefix(Checked(blob, tmp_path / "p", 3 * UNIT, UNIT, (), UNIT))
    time.sleep(0.05)
    assert seen == [True]
    prefix.finish(None)  # the fetch failed before the rest was checked
    thread.join(5)
    assert seen == [True, False]
    # a fetch that ends without a word (a cache hit, one stream): the sender reads the entry
    quiet = Prefix()
    quiet.finish(tmp_path / "entry")
    assert quiet.started() is None and quiet.entry == tmp_path / "entry"
