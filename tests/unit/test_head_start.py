"""The batch host's fetch asks for its blob before its full client is ready (issue #61,
``registry.headstart``): the followed fetch takes that answer and asks the registry nothing
more; an answer to anything else is dropped and the fetch asks as always; a head start that
breaks off is picked up from the chunk it was in; broken bytes are refused as in any stream.
Served by a real HTTP server on 127.0.0.1 that answers ranges as registry 2.8 does."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from imgpipe.registry import headstart
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.ranges import fetch_ranges

CHUNK = 8 << 20


class Blobs(ThreadingHTTPServer):
    """One blob at /v2/r/blobs/DIGEST, ranges answered 206; ``asked`` records each GET's
    Range; ``cut_after`` ends the first answer early; ``flip`` breaks one byte of the first."""

    daemon_threads = True

    def __init__(self, data: bytes) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.data = data
        self.digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.asked: list[str] = []
        self.cut_after = 0
        self.flip = -1

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Blobs

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        server, data = self.server, self.server.data
        if self.path != f"/v2/r/blobs/{server.digest}":
            self.send_error(404)
            return
        asked = self.headers.get("Range", "")
        first_answer = not server.asked
        server.asked.append(asked)
        start, _, end = asked.removeprefix("bytes=").partition("-")
        lo, hi = int(start), int(end) if end else len(data) - 1
        body = bytearray(data[lo:hi + 1])
        if first_answer and 0 <= server.flip - lo < len(body):
            body[server.flip - lo] ^= 1
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if first_answer and server.cut_after:
            body = body[:server.cut_after]
        try:
            self.wfile.write(bytes(body))
        except OSError:
            pass
        if first_answer and server.cut_after:
            self.close_connection = True


@pytest.fixture
def blobs() -> Iterator[Blobs]:
    server = Blobs(os.urandom(3 * CHUNK + 4321))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    headstart.take("", "", 0, 0)  # nothing begun is left for the next test


def _digests(data: bytes) -> list[str]:
    return [hashlib.sha256(data[i:i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]


def _fetch(server: Blobs, partial: Path, said: list[str]) -> list[int]:
    client = RegistryClient(server.origin, allow_http=True)
    checked: list[int] = []
    fetch_ranges(client, "r", server.digest, partial, len(server.data), CHUNK,
                 _digests(server.data), 4, say=said.append,
                 verified=lambda c: checked.append(c.upto))
    return checked


def _begin(server: Blobs, blob: str | None = None) -> None:
    address = server.origin.removeprefix("http://")
    headstart.begin("http", address, "r", blob or server.digest)


def test_the_followed_fetch_takes_the_answer_begun_ahead(blobs: Blobs, tmp_path: Path) -> None:
    _begin(blobs)
    time.sleep(0.2)  # the answer is under way (held in memory, at most HELD blocks)
    said: list[str] = []
    checked = _fetch(blobs, tmp_path / "blob.part", said)
    data = blobs.data
    assert (tmp_path / "blob.part").read_bytes() == data
    assert checked == [CHUNK, 2 * CHUNK, 3 * CHUNK, len(data)]
    assert blobs.asked == ["bytes=0-"], blobs.asked  # the registry asked once, ahead
    assert said == []
    assert headstart.take(blobs.origin, f"/v2/r/blobs/{blobs.digest}", 0,
                          len(data) - 1) is None  # given once


def test_an_answer_begun_for_another_blob_is_dropped(blobs: Blobs, tmp_path: Path) -> None:
    _begin(blobs, "sha256:" + "0" * 64)  # 404: no answer to take either
    checked = _fetch(blobs, tmp_path / "blob.part", [])
    assert checked[-1] == len(blobs.data)
    assert blobs.asked == [f"bytes=0-{len(blobs.data) - 1}"], blobs.asked


def test_a_head_start_that_breaks_off_goes_on_from_its_chunk(blobs: Blobs,
                                                             tmp_path: Path) -> None:
    blobs.cut_after = 2 * CHUNK + 99  # inside chunk 2
    _begin(blobs)
    said: list[str] = []
    checked = _fetch(blobs, tmp_path / "blob.part", said)
    assert (tmp_path / "blob.part").read_bytes() == blobs.data
    assert checked == [CHUNK, 2 * CHUNK, 3 * CHUNK, len(blobs.data)]
    assert blobs.asked == ["bytes=0-", f"bytes={2 * CHUNK}-{len(blobs.data) - 1}"]
    assert len(said) == 1 and "broke off" in said[0], said


def test_broken_bytes_in_the_head_start_are_fetched_again(blobs: Blobs,
                                                          tmp_path: Path) -> None:
    blobs.flip = CHUNK + 17  # in chunk 1 of the answer begun ahead
    _begin(blobs)
    said: list[str] = []
    checked = _fetch(blobs, tmp_path / "blob.part", said)
    assert (tmp_path / "blob.part").read_bytes() == blobs.data
    assert checked == [CHUNK, 2 * CHUNK, 3 * CHUNK, len(blobs.data)]
    assert blobs.asked == ["bytes=0-", f"bytes={CHUNK}-{2 * CHUNK - 1}"]
    assert len(said) == 1 and "chunk 1 " in said[0] and "fetching it again" in said[0]


def test_the_head_start_holds_a_bounded_part_of_the_blob(blobs: Blobs) -> None:
    blobs.data = os.urandom((headstart.HELD + 40) * headstart.BLOCK)
    blobs.digest = "sha256:" + hashlib.sha256(blobs.data).hexdigest()
    begun = headstart.HeadStart("http", blobs.origin.removeprefix("http://"),
                                f"/v2/r/blobs/{blobs.digest}")
    try:
        time.sleep(1.0)
        assert begun._blocks.qsize() <= headstart.HELD
        assert begun.size == len(blobs.data)
        got = b"".join(begun.blocks())
        assert got == blobs.data
    finally:
        begun.close()


@pytest.mark.parametrize("quick", [
    {"plain": False, "scheme": "http"},  # a login or a CA of the site's own
    {"plain": True, "scheme": "http", "blob_cache": "http://rack:5080"},
    {"plain": True, "scheme": "file"},
])
def test_a_registry_the_plain_client_does_not_reach_gets_no_head_start(quick: dict) -> None:
    assert not headstart.plain_site(quick)
    assert headstart.plain_site({"plain": True, "scheme": "https"})
