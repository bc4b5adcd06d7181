"""A published squashfs fetched as parallel, verified ranges (registry.ranges), against a
real registry and, where a server must misbehave, a front in this process that passes
requests to it and answers 200 to ranges, corrupts one chunk once, or breaks off.

Each test counts the requests per range at the front: a bad chunk is fetched again alone,
a resumed download asks only for the chunks it lacks.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import subprocess
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from imgpipe.base.directio import ALIGN
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.flatten.view import MergedView
from imgpipe.enroot.published.artifact import (
    ARTIFACT_TYPE,
    CHUNK_SIZE,
    CHUNKS,
    CREATED,
    PublishedSquashfs,
    fetch,
    find_published,
    publish,
)
from imgpipe.enroot.published.policy import Fetched, PublishedPolicy, fetch_trusted
from imgpipe.registry import chunks
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.mediatypes import OCI_MANIFEST
from imgpipe.registry.ranges import (
    DEFAULT_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    chunk_count,
    chunk_digests,
    fetch_ranges,
    sidecar_path,
)
from imgpipe.registry.referrers import attach, detach, referrers
from imgpipe.registry.transfer import put_manifest
from tests import services

pytestmark = pytest.mark.slow

CHUNK = 256 << 10
PASSED = ("Content-Type", "Content-Range", "Docker-Distribution-Api-Version",
          "Docker-Content-Digest")


@dataclass
class Front:
    """An HTTP front of the registry: ``mode`` is pass, corrupt (the first answer for the
    range starting at ``target`` has a byte flipped), no-ranges (200, the whole blob), or
    break (after ``keep`` ranges, every answer stops half-way and the connection closes)."""

    upstream: str
    mode: str = "pass"
    target: int = 0
    keep: int = 0
    asked: collections.Counter[str] = field(default_factory=collections.Counter)
    blob_gets: int = 0  # GETs of a blob, ranged or not
    answered: int = 0  # ranged answers
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def ranges(self) -> set[int]:
        """The starts of the ranges asked for."""
        return {int(r.split("=")[1].split("-")[0]) for r in self.asked if r}


def _handler(front: Front) -> type[BaseHTTPRequestHandler]:
    session = services.plain_session()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked = self.headers.get("Range", "")
            with front.lock:
                front.asked[asked] += 1
                seen = front.asked[asked]
                front.blob_gets += self.command == "GET" and "/blobs/" in self.path
            sent = {"Range": asked} if asked and front.mode != "no-ranges" else {}
            if "Accept" in self.headers:  # manifests are served by what the client accepts
                sent["Accept"] = ", ".join(self.headers.get_all("Accept") or [])
            upstream = session.request(self.command, front.upstream + self.path, headers=sent,
                                       timeout=60)
            body = upstream.content
            if (front.mode == "corrupt" and seen == 1
                    and asked.startswith(f"bytes={front.target}-")):
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            self.send_response(upstream.status_code)
            for name in PASSED:
                if name in upstream.headers:
                    self.send_header(name, upstream.headers[name])
            self.send_header("Content-Length", upstream.headers.get("Content-Length", "0")
                             if self.command == "HEAD" else str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            with front.lock:
                front.answered += bool(asked)
                broken = (front.mode == "break" and front.answered > front.keep) or (
                    front.mode == "break-once" and seen == 1
                    and asked.startswith(f"bytes={front.target}-"))
            if broken:
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

        do_HEAD = do_GET  # noqa: N815 (http.server's name)

    return Handler


@pytest.fixture
def front(registry_server: services.RegistryProcess) -> Iterator[Front]:
    made = Front(registry_server.url)
    made.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(made))
    made.server.daemon_threads = True
    thread = threading.Thread(target=made.server.serve_forever, daemon=True)
    thread.start()
    yield made
    made.server.shutdown()
    made.server.server_close()


@dataclass(frozen=True)
class Blob:
    published: PublishedSquashfs
    data: bytes


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _squashfs(folder: Path, sizes: tuple[int, int] = (3 << 20, (1 << 20) + 12345)) -> Path:
    """A real squashfs of about 4.5 MB (or ``sizes``) that does not compress (random
    contents)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, size in zip(("a.bin", "b.bin"), sizes, strict=True):
            payload = os.urandom(size)
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    out = folder / "random.sqsh"
    subprocess.run(["tar2sqfs", "--quiet", "--compressor", "zstd", str(out)],
                   input=buffer.getvalue(), check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture
def blob(registry_server: services.RegistryProcess, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Blob:
    """A squashfs published with chunk digests of CHUNK bytes beside a fresh image (the
    minimum chunk size lowered to CHUNK, so that 4.5 MB are many chunks; the tests of the
    bounds themselves, at the end, keep the real one)."""
    monkeypatch.setattr(chunks, "MIN_CHUNK_SIZE", CHUNK)
    session, url = services.plain_session(), registry_server.url
    repository = f"ranges/{tmp_path.name.lower().replace('_', '-')[:40]}"
    digest = services.push_image(session, url, repository, "v1",
                                 [services.tar_layer({"f": tmp_path.name.encode()})])
    client = RegistryClient(url)
    squashfs = _squashfs(tmp_path)
    data = squashfs.read_bytes()
    published, pushed = publish(client, repository, client.manifest(repository, digest),
                                squashfs, _sha256(data), "zstd", 2, chunk_size=CHUNK)
    assert pushed and published.chunk_size == CHUNK
    assert len(published.chunks) == chunk_count(len(data), CHUNK) > 8
    [found] = find_published(client, repository, digest, "zstd")
    assert found == published  # what a reader finds is what was published
    return Blob(published, data)


def _fetch(front: Front, blob: Blob, partial: Path, said: list[str],
           chunks: bool = True) -> int:
    got = blob.published
    return fetch_ranges(RegistryClient(front.url), got.repository, got.blob, partial,
                        got.size, CHUNK, got.chunks if chunks else (), 4, None, said.append)


def test_a_published_squashfs_arrives_as_parallel_verified_ranges(front: Front, blob: Blob,
                                                                 tmp_path: Path) -> None:
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    final = tmp_path / "out.sqsh"
    counted: list[int] = []
    said: list[str] = []
    received, entries = fetch(RegistryClient(front.url), storage, blob.published, final, None,
                              counted.append, connections=4, say=said.append)
    assert final.read_bytes() == blob.data and received == len(blob.data) == sum(counted)
    assert entries >= 2 and said == []
    count = chunk_count(len(blob.data), CHUNK)
    assert front.ranges() == {i * CHUNK for i in range(count)}  # one request per chunk
    assert set(front.asked.values()) == {1}
    assert not sidecar_path(storage.partial_download(blob.published.blob)).exists()


def test_the_importers_path_takes_ranges_as_the_policy_says(front: Front, blob: Blob,
                                                            tmp_path: Path) -> None:
    """fetch_trusted, as a conversion and the Pyxis importer call it, for a pinned blob."""
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    got, said, counted = blob.published, [], []

    def count(total: int | None) -> Callable[[int], None]:
        assert total == len(blob.data)
        return counted.append

    def no_layers() -> MergedView:
        raise AssertionError("a pinned fetch reads no layers")

    for connections, ranged in ((4, True), (1, False)):
        storage.fetched(got.repository, got.blob).unlink(missing_ok=True)
        front.asked.clear()
        counted.clear()
        policy = PublishedPolicy(pins=frozenset({got.blob}), range_connections=connections)
        fetched = fetch_trusted(RegistryClient(front.url), storage, got.repository, got.subject,
                                "zstd", policy, no_layers, said.append, count)
        assert fetched is not None and fetched.path.read_bytes() == blob.data, said
        assert sum(counted) == len(blob.data)
        ranges = [r for r in front.asked.elements() if r.startswith("bytes=")]
        assert len(ranges) == (chunk_count(len(blob.data), CHUNK) if ranged else 0), said


def test_a_corrupted_chunk_alone_is_fetched_again(front: Front, blob: Blob,
                                                  tmp_path: Path) -> None:
    front.mode, front.target = "corrupt", 5 * CHUNK
    partial, said = tmp_path / "blob.part", []
    _fetch(front, blob, partial, said)
    assert partial.read_bytes() == blob.data
    again = [r for r, n in front.asked.items() if n > 1]
    assert again == [f"bytes={5 * CHUNK}-{6 * CHUNK - 1}"] and front.asked[again[0]] == 2
    assert len(said) == 1 and "chunk 5 " in said[0] and "fetching it again" in said[0]
    assert blob.published.chunks[5] in said[0]


def test_a_server_that_ignores_ranges_gets_one_stream(front: Front, blob: Blob,
                                                      tmp_path: Path) -> None:
    front.mode = "no-ranges"
    partial, said = tmp_path / "blob.part", []
    _fetch(front, blob, partial, said)
    assert partial.read_bytes() == blob.data
    assert said == [f"{front.url.split('://')[1]} answered 200 to a range request: "
                    "downloading in one stream"]
    assert not sidecar_path(partial).exists()


def test_a_broken_download_resumes_with_the_missing_chunks_only(front: Front, blob: Blob,
                                                                tmp_path: Path) -> None:
    front.mode, front.keep = "break", 6
    partial, said = tmp_path / "blob.part", []
    with pytest.raises(RegistryError, match="broke off"):
        _fetch(front, blob, partial, said)
    done = json.loads(sidecar_path(partial).read_text())["done"]
    count = chunk_count(len(blob.data), CHUNK)
    assert len(done) >= 6
    front.mode, front.asked = "pass", collections.Counter()
    received = _fetch(front, blob, partial, said)
    assert partial.read_bytes() == blob.data and not sidecar_path(partial).exists()
    asked = front.ranges()
    assert asked == {i * CHUNK for i in range(count) if i not in done}
    assert 0 < len(asked) <= count - 6 and set(front.asked.values()) == {1}
    assert received == sum(min(CHUNK, len(blob.data) - start) for start in asked)


def test_a_range_that_breaks_off_once_is_fetched_again_alone(front: Front, blob: Blob,
                                                             tmp_path: Path) -> None:
    """Many nodes through one link: a transfer times out now and then.  The range is asked
    again (one line), the download goes on, nothing else is fetched twice."""
    front.mode, front.target = "break-once", 3 * CHUNK
    partial, said = tmp_path / "blob.part", []
    _fetch(front, blob, partial, said)
    assert partial.read_bytes() == blob.data
    again = [line for line in said if "broke off" in line]
    assert len(again) == 1 and again[0].startswith(f"bytes {3 * CHUNK}-"), said
    assert "fetching them again" in again[0]
    twice = {asked for asked, times in front.asked.items() if times > 1}
    assert twice == {f"bytes={3 * CHUNK}-{4 * CHUNK - 1}"}, front.asked


def test_one_stream_goes_on_from_a_ranged_downloads_first_chunks(front: Front, blob: Blob,
                                                                 tmp_path: Path) -> None:
    """enroot.range_connections set to 1 after a ranged fetch broke off: the single stream
    resumes from the run of done chunks at the start, not from the preallocated length."""
    front.mode, front.keep = "break", 10  # 4 connections: chunks 0-6 at least are whole
    partial, said = tmp_path / "blob.part", []
    with pytest.raises(RegistryError, match="broke off"):
        _fetch(front, blob, partial, said)
    done = set(json.loads(sidecar_path(partial).read_text())["done"])
    run = next(i for i in range(len(blob.published.chunks) + 1) if i not in done)
    front.mode, front.asked = "pass", collections.Counter()
    got = blob.published
    received = fetch_ranges(RegistryClient(front.url), got.repository, got.blob, partial,
                            got.size, CHUNK, got.chunks, 1, None, said.append)
    assert partial.read_bytes() == blob.data and not sidecar_path(partial).exists()
    kept = run * CHUNK - run * CHUNK % ALIGN  # the single stream resumes aligned
    assert received == len(blob.data) - kept and kept > 0
    assert list(front.asked) == [f"bytes={kept}-"]


def test_without_chunk_digests_a_bad_range_redoes_the_whole_download(
        front: Front, blob: Blob, registry_server: services.RegistryProcess,
        tmp_path: Path) -> None:
    """An artifact published before chunk digests: ranges still, the whole digest decides."""
    front.mode, front.target = "corrupt", 3 * CHUNK
    partial, said = tmp_path / "blob.part", []
    with pytest.raises(DigestMismatchError, match="failed verification"):
        _fetch(front, blob, partial, said, chunks=False)
    assert partial.stat().st_size == 0 and not sidecar_path(partial).exists()
    _fetch(front, blob, partial, said, chunks=False)  # the corruption was once
    assert partial.read_bytes() == blob.data and said == []
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    old = replace(blob.published, chunk_size=0, chunks=())
    said.clear()
    client = RegistryClient(registry_server.url)
    fetch(client, storage, old, tmp_path / "old.sqsh", None, connections=4, say=said.append)
    assert (tmp_path / "old.sqsh").read_bytes() == blob.data  # under 1 chunk of 16 MiB
    assert said == []


def test_hostile_chunk_digests_are_ignored_in_one_line(front: Front, blob: Blob,
                                                       tmp_path: Path) -> None:
    partial, said = tmp_path / "blob.part", []
    wrong = replace(blob.published, chunks=blob.published.chunks[:-1])
    fetch_ranges(RegistryClient(front.url), wrong.repository, wrong.blob, partial, wrong.size,
                 CHUNK, wrong.chunks, 4, None, said.append)
    assert partial.read_bytes() == blob.data
    assert len(said) == 1 and "ignored the chunk digests" in said[0], said
    # A list that names other bytes throughout: the whole digest decides, after one chunk
    # came twice with the same bytes.
    partial.unlink()
    said.clear()
    front.asked.clear()
    lying = tuple("0" * 64 for _ in blob.published.chunks)
    fetch_ranges(RegistryClient(front.url), wrong.repository, wrong.blob, partial, wrong.size,
                 CHUNK, lying, 4, None, said.append)
    assert partial.read_bytes() == blob.data
    assert sum(front.asked.values()) <= len(lying) + 4  # at most one retry per connection
    assert len([line for line in said if "not trusted" in line]) == 1


def test_a_plain_registry_answers_ranges_with_206(registry_server: services.RegistryProcess,
                                                  blob: Blob) -> None:
    """What the ranged fetch relies on: registry 2.8 serves a blob's byte range."""
    got = blob.published
    answer = requests.get(f"{registry_server.url}/v2/{got.repository}/blobs/{got.blob}",
                          headers={"Range": f"bytes={CHUNK}-{2 * CHUNK - 1}"}, timeout=60)
    assert answer.status_code == 206 and answer.content == blob.data[CHUNK:2 * CHUNK]


# -- what a pusher's artifact can cost a pinned fetch (issue #53, points 4 and 5) -----------
# The file is two chunks of 64 MiB, so its genuine artifact published with them is 2 ranges.

@pytest.fixture(scope="module")
def big_squashfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real squashfs of about 73 MB: over one default chunk, nine of the minimum."""
    return _squashfs(tmp_path_factory.mktemp("big"), (40 << 20, (30 << 20) + 12345))


def _publish_big(registry_server: services.RegistryProcess, tmp_path: Path, squashfs: Path,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[RegistryClient,
                                                                PublishedSquashfs]:
    session, url = services.plain_session(), registry_server.url
    repository = f"ranges/{tmp_path.name.lower().replace('_', '-')[:40]}"
    digest = services.push_image(session, url, repository, "v1",
                                 [services.tar_layer({"f": tmp_path.name.encode()})])
    client = RegistryClient(url)
    blob = "sha256:" + hashlib.sha256(squashfs.read_bytes()).hexdigest()
    published, pushed = publish(client, repository, client.manifest(repository, digest),
                                squashfs, blob, "zstd", 2, chunk_size=chunk_size)
    assert pushed and published.chunk_size == chunk_size
    return client, published


def _pushers_artifact(client: RegistryClient, genuine: PublishedSquashfs, squashfs: Path,
                      chunk_size: int | None, first: bool = False) -> str:
    """A second artifact naming the genuine blob, as anyone who can push may write it: with
    chunk digests of ``chunk_size`` (every one right) or none; listed after the genuine one
    (newer) or, the index rewritten, before it."""
    body = client.manifest_exactly(genuine.repository, genuine.artifact).body
    notes = {k: v for k, v in body["annotations"].items() if k not in (CHUNK_SIZE, CHUNKS)}
    notes[CREATED] = "2099-01-01T00:00:00+00:00"
    if chunk_size is not None:
        notes |= {CHUNK_SIZE: str(chunk_size),
                  CHUNKS: ",".join(chunk_digests(squashfs, chunk_size))}
    raw = json.dumps({**body, "annotations": notes}, sort_keys=True).encode()
    digest = put_manifest(client, genuine.repository, f"{genuine.tag}.pusher", raw,
                          OCI_MANIFEST)
    attach(client, genuine.repository, genuine.subject,
           {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(raw),
            "artifactType": ARTIFACT_TYPE})
    if first:  # attaching the genuine one again lists it last
        [listed] = [d for d in referrers(client, genuine.repository, genuine.subject)
                    if d["digest"] == genuine.artifact]
        attach(client, genuine.repository, genuine.subject, listed)
    return digest


def _fetch_pinned(front: Front, storage: Storage, got: PublishedSquashfs,
                  said: list[str]) -> Fetched | None:
    def no_layers() -> MergedView:
        raise AssertionError("a pinned fetch reads no layers")

    policy = PublishedPolicy(pins=frozenset({got.blob}), range_connections=4)
    return fetch_trusted(RegistryClient(front.url), storage, got.repository, got.subject,
                         "zstd", policy, no_layers, said.append, lambda _: lambda _: None)


@pytest.mark.parametrize("first", [False, True], ids=["newer", "listed-first"])
@pytest.mark.parametrize("chunk_size", [64 << 10, MIN_CHUNK_SIZE], ids=["64KiB", "minimum"])
def test_a_pushers_small_chunks_leave_a_pinned_fetch_a_bounded_number_of_ranges(
        front: Front, registry_server: services.RegistryProcess, big_squashfs: Path,
        tmp_path: Path, chunk_size: int, first: bool) -> None:
    """A second artifact naming the pinned squashfs with small chunks, every digest right,
    made a fetch 612 requests instead of 2: now the pinned blob's oldest artifact decides
    the chunking, and no list is taken below MIN_CHUNK_SIZE (one line), whatever order a
    pusher lists them in."""
    client, genuine = _publish_big(registry_server, tmp_path, big_squashfs, 64 << 20)
    _pushers_artifact(client, genuine, big_squashfs, chunk_size, first)
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    said: list[str] = []
    fetched = _fetch_pinned(front, storage, genuine, said)
    assert fetched is not None, said
    assert _sha256(fetched.path.read_bytes()) == genuine.blob
    if not first:  # the genuine (oldest) artifact's own 2 ranges
        assert front.blob_gets == 2, (front.blob_gets, said)
    assert front.blob_gets <= chunk_count(genuine.size, MIN_CHUNK_SIZE), said
    ignored = [line for line in said if "ignored the chunk digests" in line]
    assert len(ignored) == (chunk_size < MIN_CHUNK_SIZE), said


def test_a_record_from_a_chunked_artifact_then_one_without_digests_starts_over(
        front: Front, registry_server: services.RegistryProcess, big_squashfs: Path,
        tmp_path: Path) -> None:
    """A ranged fetch by the artifact's 8 MiB chunks breaks off; the artifact goes and a
    newer one without chunk digests names the same blob: the record is of another plan, so
    the fetch starts over in one line (the preallocated length once counted as done: the
    file failed verification and the job converted)."""
    client, genuine = _publish_big(registry_server, tmp_path, big_squashfs, MIN_CHUNK_SIZE)
    storage = Storage(tmp_path / "cache")
    storage.prepare()
    said: list[str] = []
    front.mode, front.keep = "break", 4
    assert _fetch_pinned(front, storage, genuine, said) is None
    assert any("broke off" in line for line in said), said
    partial = storage.partial_download(genuine.blob)
    record = json.loads(sidecar_path(partial).read_text())  # written at the end, at least
    assert record["chunk_size"] == MIN_CHUNK_SIZE and len(record["done"]) == 4
    detach(client, genuine.repository, genuine.subject, {genuine.artifact})
    _pushers_artifact(client, genuine, big_squashfs, None)
    front.mode, front.blob_gets, said[:] = "pass", 0, []
    front.asked.clear()
    fetched = _fetch_pinned(front, storage, genuine, said)
    assert fetched is not None, said
    assert _sha256(fetched.path.read_bytes()) == genuine.blob
    assert fetched.received == genuine.size and front.ranges() == set(
        range(0, genuine.size, DEFAULT_CHUNK_SIZE))
    assert len([line for line in said if "starting over" in line]) == 1, said
    assert not partial.exists() and not sidecar_path(partial).exists()
