"""Chunk digests of a published squashfs: hashed in one pass whatever the read sizes,
checked when read from a manifest anyone who can push may write, and the record of done
chunks read only from this user's own regular file."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from requests.adapters import BaseAdapter

from imgpipe.enroot.cache.storage import STALE_AFTER_S, Storage
from imgpipe.enroot.published.artifact import (
    ARTIFACT_TYPE,
    CHUNK_SIZE,
    CHUNKS,
    SQUASHFS_MEDIA_TYPE,
    PublishedSquashfs,
    _from_manifest,
)
from imgpipe.enroot.published.policy import PublishedPolicy, _choose
from imgpipe.registry import chunks, rangeget
from imgpipe.registry.chunkrecord import (
    WRITE_EVERY_S,
    DoneRecord,
    done_in,
    list_identity,
    read_record,
    sidecar_path,
)
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
from imgpipe.registry.manifests import Manifest
from imgpipe.registry.mediatypes import OCI_MANIFEST, REGISTRY_HEADER
from imgpipe.registry.ranges import (
    MAX_CHUNKS,
    MIN_CHUNK_SIZE,
    ChunkHasher,
    chunk_digests,
    chunks_problem,
    fetch_ranges,
    own_chunk_size,
)

SUBJECT = "sha256:" + "a" * 64
BLOB = "sha256:" + "b" * 64
CHUNK = MIN_CHUNK_SIZE


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_chunk_digests_do_not_depend_on_how_the_stream_is_cut(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK + 1234)
    expected = [hashlib.sha256(data[i:i + CHUNK]).hexdigest()
                for i in range(0, len(data), CHUNK)]
    for piece in (1000, CHUNK, CHUNK + 7, len(data)):
        hasher = ChunkHasher(CHUNK)
        for start in range(0, len(data), piece):
            hasher.update(data[start:start + piece])
        assert hasher.digests() == expected
    (tmp_path / "f").write_bytes(data)
    assert chunk_digests(tmp_path / "f", CHUNK) == expected
    assert len(expected) == 4 and chunks_problem(len(data), CHUNK, expected) is None


def test_a_20_gb_file_lists_few_enough_digests_for_a_manifest() -> None:
    digests = ["c" * 64] * 320
    assert chunks_problem(20 << 30, 64 << 20, digests) is None
    assert len(",".join(digests)) < 22_000  # the document cap is 4 MiB


@pytest.mark.parametrize(("size", "chunk_size", "digests", "why"), [
    (3 * CHUNK, CHUNK, ["c" * 64] * 2, "expected 3"),
    (3 * CHUNK, CHUNK, ["c" * 64] * 4, "expected 3"),
    (3 * CHUNK, CHUNK, ["c" * 64, "C" * 64, "c" * 64], "64 lowercase hex"),
    (3 * CHUNK, CHUNK, ["c" * 64, "xyz", "c" * 64], "64 lowercase hex"),
    (3, 1, ["c" * 64] * 3, "below"),
    (3 << 40, 2 << 40, ["c" * 64] * 2, "above"),
])
def test_an_impossible_chunk_list_is_named(size: int, chunk_size: int, digests: list[str],
                                           why: str) -> None:
    problem = chunks_problem(size, chunk_size, digests)
    assert problem is not None and why in problem


def _manifest(notes: dict[str, object], size: int = 3 * CHUNK) -> Manifest:
    body = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
            "layers": [{"mediaType": SQUASHFS_MEDIA_TYPE, "digest": BLOB, "size": size}],
            "subject": {"digest": SUBJECT}, "annotations": notes}
    return Manifest("sha256:" + "d" * 64, OCI_MANIFEST, json.dumps(body).encode())


def test_published_chunk_digests_are_read_back() -> None:
    digests = ["e" * 64] * 3
    published, problem = _from_manifest("r", SUBJECT, _manifest(
        {CHUNK_SIZE: str(CHUNK), CHUNKS: ",".join(digests)}))
    assert published is not None and problem == ""
    assert published.chunk_size == CHUNK and published.chunks == tuple(digests)
    before, problem = _from_manifest("r", SUBJECT, _manifest({}))  # published before them
    assert before is not None and before.chunks == () and problem == ""


@pytest.mark.parametrize("notes", [
    {CHUNK_SIZE: str(CHUNK), CHUNKS: ",".join(["e" * 64] * 2)},  # one missing
    {CHUNK_SIZE: str(CHUNK), CHUNKS: ",".join(["e" * 64, "g" * 64, "e" * 64])},
    {CHUNK_SIZE: "-1", CHUNKS: ",".join(["e" * 64] * 3)},
    {CHUNK_SIZE: "9" * 40, CHUNKS: "e" * 64},
    {CHUNK_SIZE: 65536, CHUNKS: ["e" * 64] * 3},  # not strings
    {CHUNKS: ",".join(["e" * 64] * 3)},  # no size
])
def test_hostile_chunk_annotations_leave_the_whole_digest_alone(notes: dict) -> None:
    published, problem = _from_manifest("r", SUBJECT, _manifest(notes))
    assert published is not None and published.blob == BLOB  # still usable
    assert published.chunks == () and published.chunk_size == 0 and problem
    assert "\n" not in problem


def _record(partial: Path, blob: str, size: int, chunk_size: int, done: set[int],
            identity: str = "") -> DoneRecord:
    record = DoneRecord(partial, blob, size, chunk_size, identity, done)
    record.save()
    return record


def test_the_record_of_done_chunks_is_this_users_regular_file(tmp_path: Path) -> None:
    partial = tmp_path / "x.part"
    _record(partial, BLOB, 3 * CHUNK, CHUNK, {0, 2})
    assert os.stat(sidecar_path(partial)).st_mode & 0o777 == 0o600
    record = read_record(partial)
    assert done_in(record, BLOB, 3 * CHUNK, CHUNK, "") == {0, 2}
    assert done_in(record, BLOB, 3 * CHUNK, 2 * CHUNK, "") is None  # another plan's
    assert done_in(record, SUBJECT, 3 * CHUNK, CHUNK, "") is None
    assert done_in(record, BLOB, 3 * CHUNK, CHUNK, list_identity(["e" * 64] * 3)) is None
    sidecar_path(partial).write_text(json.dumps(
        {"blob": BLOB, "size": 3 * CHUNK, "chunk_size": CHUNK, "done": [1, 7, -1, "2"]}))
    assert done_in(read_record(partial), BLOB, 3 * CHUNK, CHUNK, "") == {1}
    sidecar_path(partial).unlink()
    (tmp_path / "elsewhere").write_text(json.dumps(record))
    sidecar_path(partial).symlink_to(tmp_path / "elsewhere")  # planted
    assert read_record(partial) == {}
    sidecar_path(partial).unlink()
    sidecar_path(partial).write_text("not json")
    assert read_record(partial) == {}


def test_the_record_is_written_at_most_once_a_second_and_at_the_end(tmp_path: Path) -> None:
    """Writes counted against a clock the test moves: a record of thousands of chunks is
    not rewritten after each one."""
    now = [0.0]
    partial = tmp_path / "x.part"
    record = DoneRecord(partial, BLOB, MAX_CHUNKS * CHUNK, CHUNK, "", set(), lambda: now[0])
    record.save()  # when the download starts
    for index in range(MAX_CHUNKS // 2):
        record.add(index)
        now[0] += WRITE_EVERY_S / 100
    assert record.writes == 1 + (MAX_CHUNKS // 2) // 100
    written = done_in(read_record(partial), BLOB, MAX_CHUNKS * CHUNK, CHUNK, "")
    assert written is not None and len(written) < MAX_CHUNKS // 2  # the rest: not yet
    for index in range(MAX_CHUNKS // 2, MAX_CHUNKS):
        record.add(index)  # the clock stands still
    before = record.writes
    record.flush()  # when the download stops
    record.flush()  # nothing new: no write
    assert record.writes == before + 1
    assert done_in(read_record(partial), BLOB, MAX_CHUNKS * CHUNK, CHUNK, "") == set(
        range(MAX_CHUNKS))
    assert sidecar_path(partial).stat().st_size < 25_000  # every chunk of the cap done
    record.remove()
    record.flush()  # removed: not written again
    assert not sidecar_path(partial).exists()


def test_a_huge_file_gets_chunks_few_enough_for_the_cap() -> None:
    assert own_chunk_size(20 << 30) == 16 << 20  # 1,280 chunks
    assert own_chunk_size(100 << 30) == 25 << 20  # 6,400 at 16 MiB: raised to 4,096 of 25 MiB
    huge = own_chunk_size(1 << 40)  # 1 TiB: 65,536 chunks of 16 MiB
    assert huge % (1 << 20) == 0 and -(-(1 << 40) // huge) <= MAX_CHUNKS


def test_a_stale_record_goes_with_its_partial_download(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    partial = storage.partial_download(BLOB)
    partial.write_bytes(b"x")
    _record(partial, BLOB, 3 * CHUNK, CHUNK, {0})
    fresh = storage.partial_download(SUBJECT)
    _record(fresh, SUBJECT, 3 * CHUNK, CHUNK, {1})
    old = os.stat(partial).st_mtime - STALE_AFTER_S - 60
    for path in (partial, sidecar_path(partial)):
        os.utime(path, (old, old))
    storage.sweep()
    assert not partial.exists() and not sidecar_path(partial).exists()
    assert sidecar_path(fresh).exists()  # a download resumed within the day keeps its record


# -- bounds on what a pusher's chunk list can cost (issue #53, points 4 and 5) ---------------

class OneBlob(BaseAdapter):
    """Serves one blob as registry:2 does (206 to a range, 200 without one) and notes each
    Range asked and what the record of done chunks held when it was asked: a stand-in for
    the pure logic here; tests/e2e/test_ranges.py proves the same against registry:2."""

    def __init__(self, data: bytes, partial: Path) -> None:
        super().__init__()
        self.data, self.partial = data, partial
        self.asked: list[str] = []
        self.records: list[str] = []

    def send(self, request: requests.PreparedRequest,  # type: ignore[override]
             **kwargs: object) -> requests.Response:
        asked = str(request.headers.get("Range") or "")
        self.asked.append(asked)
        with contextlib.suppress(OSError):
            self.records.append(sidecar_path(self.partial).read_text())
        response = requests.Response()
        response.request, response.url = request, request.url or ""
        response.headers[REGISTRY_HEADER] = "registry/2.0"
        body, response.status_code = self.data, 200
        if asked:
            first, _, last = asked.removeprefix("bytes=").partition("-")
            start, end = int(first), int(last) if last else len(self.data) - 1
            body, response.status_code = self.data[start:end + 1], 206
            response.headers["Content-Range"] = f"bytes {start}-{end}/{len(self.data)}"
        response.headers["Content-Length"] = str(len(body))
        response.raw = io.BytesIO(body)
        return response

    def close(self) -> None:
        pass


def _served(data: bytes, partial: Path) -> tuple[RegistryClient, OneBlob]:
    client = RegistryClient("http://registry.invalid:5000")
    server = OneBlob(data, partial)
    client.session.mount("http://", server)
    return client, server


def _digests(data: bytes, chunk_size: int) -> list[str]:
    return [hashlib.sha256(data[i:i + chunk_size]).hexdigest()
            for i in range(0, len(data), chunk_size)]


def test_a_chunk_list_below_the_minimum_or_over_the_cap_is_refused() -> None:
    """A pusher's list of 64 KiB chunks, every digest right, made a 40 MB fetch 612
    requests instead of 2; one at the old 50,000 cap rewrote the record after each."""
    tiny = chunks_problem(20 << 20, 64 << 10, ["c" * 64] * 320)
    assert tiny is not None and "below" in tiny
    assert MIN_CHUNK_SIZE >= 8 << 20
    assert MAX_CHUNKS <= 4096
    many = chunks_problem(MAX_CHUNKS * (8 << 20) + 1, 8 << 20, ["c" * 64] * (MAX_CHUNKS + 1))
    assert many is not None and "at most" in many
    assert chunks_problem(20 << 30, 8 << 20, ["c" * 64] * 2560) is None  # 20 GiB at 8 MiB


def test_published_chunks_below_the_minimum_are_fetched_by_the_default_size(
        tmp_path: Path) -> None:
    data = os.urandom((20 << 20) + 123)
    partial, said = tmp_path / "x.part", list[str]()
    client, server = _served(data, partial)
    fetch_ranges(client, "r", _sha256(data), partial, len(data), 64 << 10,
                 _digests(data, 64 << 10), 4, None, said.append)
    assert partial.read_bytes() == data
    assert len(server.asked) <= 2, len(server.asked)  # 321 before
    assert len(said) == 1 and "ignored the chunk digests" in said[0], said


def test_the_record_of_done_chunks_is_not_rewritten_after_every_chunk(tmp_path: Path) -> None:
    """Counted as the distinct records the server's requests find: at most one write a
    second (and at the start and end), not one per chunk."""
    data = os.urandom(300 * 4096)
    partial = tmp_path / "x.part"
    client, server = _served(data, partial)
    fetch_ranges(client, "r", _sha256(data), partial, len(data), 4096, (), 4)
    assert partial.read_bytes() == data and len(server.asked) == 300
    assert len(set(server.records)) <= 4, len(set(server.records))  # ~300 before


def _planted(partial: Path, data: bytes, chunk_size: int, done: list[int],
             listed: str = "") -> None:
    """A broken-off ranged download: the file preallocated, a record of ``done`` chunks."""
    partial.write_bytes(bytes(len(data)))
    sidecar_path(partial).write_text(json.dumps(
        {"blob": _sha256(data), "size": len(data), "chunk_size": chunk_size, "done": done,
         "list": listed}))


def test_a_record_of_another_chunk_size_starts_the_download_over(tmp_path: Path) -> None:
    """A record from an artifact with chunk digests, then a newer one without: the full
    preallocated length counted as done, the file failed verification, the job converted."""
    data = os.urandom(8 * (64 << 10))
    partial, said = tmp_path / "x.part", list[str]()
    _planted(partial, data, 32 << 10, [0, 1, 2])
    client, server = _served(data, partial)
    fetch_ranges(client, "r", _sha256(data), partial, len(data), 64 << 10, (), 4, None,
                 said.append)
    assert partial.read_bytes() == data and len(server.asked) == 8
    assert len(said) == 1 and "starting over" in said[0], said


def test_a_record_made_under_another_chunk_list_starts_the_download_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks checked against one list prove nothing under another (same chunk size)."""
    monkeypatch.setattr(chunks, "MIN_CHUNK_SIZE", 64 << 10)  # 8 chunks in 512 KiB
    data = os.urandom(8 * (64 << 10))
    partial, said = tmp_path / "x.part", list[str]()
    _planted(partial, data, 64 << 10, [0, 1, 2], listed="another list")
    client, server = _served(data, partial)
    fetch_ranges(client, "r", _sha256(data), partial, len(data), 64 << 10,
                 _digests(data, 64 << 10), 4, None, said.append)
    assert partial.read_bytes() == data and len(server.asked) == 8
    assert len(said) == 1 and "starting over" in said[0], said


def test_a_pinned_blob_is_fetched_by_its_oldest_artifacts_chunking() -> None:
    """Anyone who can push can name the pinned blob in a newer artifact of their own."""
    genuine = PublishedSquashfs("r", SUBJECT, "sha256:" + "1" * 64, BLOB, 3 * CHUNK, "zstd",
                                "f", chunk_size=64 << 20, chunks=("e" * 64,))
    other = replace(genuine, artifact="sha256:" + "2" * 64, chunk_size=8 << 20,
                    chunks=("f" * 64,) * 3)
    newer_blob = replace(genuine, artifact="sha256:" + "3" * 64, blob=SUBJECT)
    said: list[str] = []
    policy = PublishedPolicy(pins=frozenset({BLOB, SUBJECT}))
    chosen = _choose([genuine, other, newer_blob], policy, "r@x", said.append)
    assert [c.artifact for c in chosen] == [newer_blob.artifact, genuine.artifact]
    assert chosen[1].chunk_size == 64 << 20 and chosen[1].size == 0


def test_a_followed_fetch_streams_its_chunks_in_order_checking_each_as_it_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's broadcast follows the chunks as they are checked: one stream in order (chunk
    0 checked after one chunk's time, not four's, and no pause between requests); a chunk
    that comes broken is fetched again alone, in one line, while the stream goes on; a
    stream that breaks off goes on from the chunk it was in.  Not followed: a chunk each."""
    data = os.urandom(3 * CHUNK + 12345)
    blob, digests = _sha256(data), _digests(data, CHUNK)
    partial = tmp_path / "blob.part"
    client, server = _served(data, partial)
    send, stream = server.send, f"bytes=0-{len(data) - 1}"

    def once_broken(request: requests.PreparedRequest, **kwargs: object) -> requests.Response:
        response = send(request, **kwargs)
        if request.headers.get("Range") == stream and server.asked.count(stream) == 1:
            body = bytearray(response.raw.read())
            body[CHUNK + 5] ^= 1
            response.raw = io.BytesIO(bytes(body))
        return response

    monkeypatch.setattr(server, "send", once_broken)
    checked: list[int] = []
    said: list[str] = []
    fetch_ranges(client, "r", blob, partial, len(data), CHUNK, digests, 4, say=said.append,
                 verified=lambda c: checked.append(c.upto))
    assert partial.read_bytes() == data
    assert checked == [CHUNK, 2 * CHUNK, 3 * CHUNK, len(data)]
    assert [a for a in server.asked if a] == [stream, f"bytes={CHUNK}-{2 * CHUNK - 1}"]
    assert len(said) == 1 and "chunk 1 " in said[0] and "fetching it again" in said[0], said

    partial.unlink()  # broken off inside chunk 2: asked again from chunk 2's start
    client, server = _served(data, partial)
    send = server.send

    def cut(request: requests.PreparedRequest, **kwargs: object) -> requests.Response:
        response = send(request, **kwargs)
        if request.headers.get("Range") == stream:
            response.raw = io.BytesIO(response.raw.read()[:2 * CHUNK + 7])
        return response

    monkeypatch.setattr(server, "send", cut)
    checked.clear()
    said.clear()
    fetch_ranges(client, "r", blob, partial, len(data), CHUNK, digests, 4, say=said.append,
                 verified=lambda c: checked.append(c.upto))
    assert partial.read_bytes() == data
    assert checked == [CHUNK, 2 * CHUNK, 3 * CHUNK, len(data)]
    assert [a for a in server.asked if a] == [stream, f"bytes={2 * CHUNK}-{len(data) - 1}"]
    assert len(said) == 1 and f"bytes {2 * CHUNK}-{len(data) - 1} " in said[0], said
    partial.unlink()
    client, server = _served(data, partial)
    fetch_ranges(client, "r", blob, partial, len(data), CHUNK, digests, 4)
    assert sorted(a for a in server.asked if a) == sorted(
        f"bytes={i * CHUNK}-{min(len(data), (i + 1) * CHUNK) - 1}" for i in range(4))


def test_a_followed_fetch_whose_chunk_cannot_be_fetched_again_fails_in_one_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 1 comes broken in the stream and every fetch of it alone breaks off: the fetch
    fails with the registry's error (the chunks before it kept for a resume), never with an
    error of its own making, and tells no chunk past the last good one."""
    data = os.urandom(3 * CHUNK + 12345)
    blob, digests = _sha256(data), _digests(data, CHUNK)
    partial = tmp_path / "blob.part"
    client, server = _served(data, partial)
    send, stream = server.send, f"bytes=0-{len(data) - 1}"

    def broken(request: requests.PreparedRequest, **kwargs: object) -> requests.Response:
        response = send(request, **kwargs)
        body = response.raw.read()
        if request.headers.get("Range") == stream:
            response.raw = io.BytesIO(body[:CHUNK + 5] + bytes([body[CHUNK + 5] ^ 1])
                                      + body[CHUNK + 6:])
        else:
            response.raw = io.BytesIO(body[:100])  # broken off, every time
        return response

    monkeypatch.setattr(server, "send", broken)
    monkeypatch.setattr(rangeget.time, "sleep", lambda _: None)  # its waits between tries
    checked: list[int] = []
    with pytest.raises(RegistryError, match="broke off"):
        fetch_ranges(client, "r", blob, partial, len(data), CHUNK, digests, 4,
                     verified=lambda c: checked.append(c.upto))
    assert checked == [CHUNK]
