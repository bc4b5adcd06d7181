"""Chunk digests of a published squashfs: hashed in one pass whatever the read sizes,
checked when read from a manifest anyone who can push may write, and the record of done
chunks read only from this user's own regular file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from imgpipe.enroot.cache.storage import STALE_AFTER_S, Storage
from imgpipe.enroot.published.artifact import (
    ARTIFACT_TYPE,
    CHUNK_SIZE,
    CHUNKS,
    SQUASHFS_MEDIA_TYPE,
    _from_manifest,
)
from imgpipe.registry.manifests import Manifest
from imgpipe.registry.mediatypes import OCI_MANIFEST
from imgpipe.registry.ranges import (
    MIN_CHUNK_SIZE,
    ChunkHasher,
    _done_in,
    _read_sidecar,
    _write_sidecar,
    chunk_digests,
    chunks_problem,
    sidecar_path,
)

SUBJECT = "sha256:" + "a" * 64
BLOB = "sha256:" + "b" * 64
CHUNK = MIN_CHUNK_SIZE


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
    (3, 1, ["c" * 64] * 3, "outside"),
    (3 << 40, 2 << 40, ["c" * 64] * 2, "outside"),
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


def test_the_record_of_done_chunks_is_this_users_regular_file(tmp_path: Path) -> None:
    partial = tmp_path / "x.part"
    _write_sidecar(partial, BLOB, 3 * CHUNK, CHUNK, {0, 2})
    assert os.stat(sidecar_path(partial)).st_mode & 0o777 == 0o600
    record = _read_sidecar(partial)
    assert _done_in(record, BLOB, 3 * CHUNK, CHUNK) == {0, 2}
    assert _done_in(record, BLOB, 3 * CHUNK, 2 * CHUNK) == set()  # another download's
    assert _done_in(record, SUBJECT, 3 * CHUNK, CHUNK) == set()
    sidecar_path(partial).write_text(json.dumps(
        {"blob": BLOB, "size": 3 * CHUNK, "chunk_size": CHUNK, "done": [1, 7, -1, "2"]}))
    assert _done_in(_read_sidecar(partial), BLOB, 3 * CHUNK, CHUNK) == {1}
    sidecar_path(partial).unlink()
    (tmp_path / "elsewhere").write_text(json.dumps(record))
    sidecar_path(partial).symlink_to(tmp_path / "elsewhere")  # planted
    assert _read_sidecar(partial) == {}
    sidecar_path(partial).unlink()
    sidecar_path(partial).write_text("not json")
    assert _read_sidecar(partial) == {}


def test_a_stale_record_goes_with_its_partial_download(tmp_path: Path) -> None:
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    partial = storage.partial_download(BLOB)
    partial.write_bytes(b"x")
    _write_sidecar(partial, BLOB, 3 * CHUNK, CHUNK, {0})
    fresh = storage.partial_download(SUBJECT)
    _write_sidecar(fresh, SUBJECT, 3 * CHUNK, CHUNK, {1})
    old = os.stat(partial).st_mtime - STALE_AFTER_S - 60
    for path in (partial, sidecar_path(partial)):
        os.utime(path, (old, old))
    storage.sweep()
    assert not partial.exists() and not sidecar_path(partial).exists()
    assert sidecar_path(fresh).exists()  # a download resumed within the day keeps its record
