"""The chunk pipeline of ``enroot.distribution: broadcast`` without a cluster
(enroot.published.relay): what a receiver takes from a header, the chain's segments gathered
into units written and hashed one by one, what it keeps of a broken copy for its own fetch,
the sender's wait on its fetch, and the stage times every node sends back."""

from __future__ import annotations

import hashlib
import io
import os
import queue
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from imgpipe.enroot.published.chain import MESSAGE, SEGMENT, segment_count, stamp
from imgpipe.enroot.published.relay import (
    SLOT,
    UNIT,
    Assembler,
    Header,
    NodeTimes,
    Prefix,
    Receiver,
    RelayError,
    gather_slot,
    parse_stages,
    per_hop,
    read_slot,
    stages_line,
)
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


def _messages(data: bytes, stop_at: int | None = None) -> list[bytearray]:
    """The chain's messages of ``data``, as the batch host sends them."""
    out = []
    for index in range(segment_count(len(data))):
        message = bytearray(MESSAGE)
        if index == stop_at:
            stamp(message, -1, 0, len(data))
            out.append(message)
            break
        offset = index * SEGMENT
        length = min(SEGMENT, len(data) - offset)
        message[:length] = data[offset:offset + length]
        stamp(message, offset, length, len(data))
        out.append(message)
    return out


def _assemble(tmp_path: Path, header: Header, messages: list[bytearray]
              ) -> tuple[Receiver, Assembler]:
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700, exist_ok=True)
    receiver = Receiver(header, folder / "blob.part", tmp_path / "entry.sqsh", 0o644)
    assembler = Assembler(receiver)
    for message in messages:
        assembler.take(message)  # waits while every unit buffer is busy
    assembler.flush()
    return receiver, assembler


def test_segments_become_units_and_the_entry(tmp_path: Path, image: bytes) -> None:
    header = _header(image)
    receiver, assembler = _assemble(tmp_path, header, _messages(image))
    assert assembler.why == "" and receiver.queued == len(image)
    got = receiver.finish()
    assert got == tmp_path / "entry.sqsh" and got.read_bytes() == image


def test_a_unit_broken_after_assembly_is_said_as_the_e2e_test_expects(
        tmp_path: Path, image: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/e2e/test_broadcast.py breaks a byte of the third unit that ``put`` is handed
    (relay.UNIT and Receiver.queued): the assembler hands units of UNIT bytes, so the line
    names chunk 2 of the 8 MiB chunks as the first to fetch."""
    put = Receiver.put

    def broken(self: Receiver, buffer: bytearray, length: int) -> None:
        if self.queued == 2 * UNIT:
            buffer[100] ^= 0xFF
        put(self, buffer, length)

    monkeypatch.setattr(Receiver, "put", broken)
    header = _header(image)
    receiver, _ = _assemble(tmp_path, header, _messages(image))
    why = receiver.finish()
    assert isinstance(why, str) and why.endswith(
        "keeping chunks 0-1, fetching chunks 2-2 from the registry"), why


def test_a_message_out_of_place_or_a_stop_ends_the_taking(tmp_path: Path, image: bytes
                                                           ) -> None:
    header = _header(image)
    messages = _messages(image)
    messages[3], messages[4] = messages[4], messages[3]
    receiver, assembler = _assemble(tmp_path, header, messages)
    assert assembler.why == f"a message at byte {4 * SEGMENT} of {len(image)} came out of order"
    assert receiver.queued == 3 * SEGMENT  # what came in order was handed over
    assert receiver.abandon(assembler.why).endswith("; fetching it from the registry")
    receiver, assembler = _assemble(tmp_path, header, _messages(image, stop_at=40))
    assert assembler.why == "the batch host stopped sending"
    why = receiver.abandon(assembler.why)
    assert why == ("the batch host stopped sending; keeping chunks 0-0, fetching chunks 1-2 "
                   "from the registry")


def test_the_assembler_waits_for_a_free_unit_buffer() -> None:
    freed: queue.Queue[bytearray] = queue.Queue()

    class Busy:
        header = Header("sha256:" + "a" * 64, 2 * SEGMENT)
        queued = 0

        def buffer(self) -> bytearray:
            return freed.get(timeout=10)

    assembler = Assembler(Busy())
    first = _messages(b"x" * (2 * SEGMENT))[0]
    taking = threading.Thread(target=assembler.take, args=(first,))
    taking.start()
    taking.join(0.2)
    assert taking.is_alive() and assembler.offset == 0  # every unit buffer still written
    freed.put(bytearray(UNIT))
    taking.join(10)
    assert not taking.is_alive() and assembler.offset == SEGMENT


def test_the_sender_polls_its_fetch_without_blocking(tmp_path: Path) -> None:
    prefix, blob = Prefix(), "sha256:" + "a" * 64
    assert prefix.poll(blob, UNIT, 0) is None and prefix.first_at == 0.0
    prefix(Checked(blob, tmp_path / "p", 3 * UNIT, UNIT, (), UNIT))
    assert prefix.poll(blob, UNIT, 0) is True and prefix.poll(blob, 2 * UNIT, 0.01) is None
    assert prefix.first_at > 0
    prefix.finish(None)
    assert prefix.poll(blob, 2 * UNIT, None) is False and prefix.done_at >= prefix.first_at


def test_each_nodes_times_come_back_in_its_gather_slot() -> None:
    times = NodeTimes(ready=100.5, first=101.25, last=120.0, checked=120.5)
    slot = gather_slot(True, "node7", times)
    assert len(slot) == SLOT and read_slot(slot) == (True, "node7", times)
    assert read_slot(gather_slot(False, "n" * 300, NodeTimes()))[:2] == (False, "n" * 63)
    # what another user's task might send: no times, never an exception
    for junk in (bytes(SLOT), b"1node\0[1,2]", b"0node\0{\"ready\": \"x\"}", b"1a\0{bad"):
        took, name, got = read_slot(junk)
        assert got == NodeTimes() and isinstance(name, str)


def test_the_stage_line_says_each_stage_and_the_cost_of_a_hop() -> None:
    start = 1000.0
    nodes = [NodeTimes(ready=1001.0, first=1003.0 + 0.05 * i, last=1018.0 + 0.05 * i,
                       checked=1018.5 + 0.05 * i) for i in range(4)]
    line = stages_line(start, {"ready": 1001.5, "first_chunk": 1002.7, "fetch": 1017.9,
                               "gathered": 1019.0}, nodes)
    stages = parse_stages(f"imgpipe: node1: broadcast sha256:… took it\nimgpipe: node1: "
                          f"{line}\nfirst node2 1019.5\n")
    assert stages is not None
    assert stages["start"] == 1000.0 and stages["nodes"] == 4
    assert stages["ready_last"] == 1.5 and stages["first_chunk"] == 2.7
    assert stages["fetch"] == 17.9 and stages["first_byte_last_node"] == 3.15
    assert stages["last_unit"] == 18.15 and stages["final_check"] == 18.65
    assert stages["per_hop_s"] == stages["per_hop_last_s"] == 0.05
    assert stages["first_by_node"] == [3.0, 3.05, 3.1, 3.15]
    assert per_hop([None, 1.0]) is None and parse_stages("no such line") is None
