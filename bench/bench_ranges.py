"""A published squashfs fetched as one stream against as 4 verified ranges, in one run.

A registry started here holds a ~1 GiB blob of random bytes published as a squashfs artifact
(publish does not read what the file holds) with 64 MiB chunk digests; each round fetches it
into an empty partial file both ways, whole digest verified:

  one stream   registry.transfer.fetch_resumable (what the importer did before)
  ranges       registry.ranges.fetch_ranges, 4 connections, each chunk checked as it lands

``--per-connection-mbps`` puts a front in this process between them that paces every
answer to that rate, the way a link that limits each TCP stream (a long path, per-flow
shaping) does; without it both read the registry over loopback.

    .venv/bin/python bench/bench_ranges.py [--size 1G] [--rounds 3] [--per-connection-mbps 50]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.base.units import parse_size  # noqa: E402
from imgpipe.enroot.published.artifact import PublishedSquashfs, publish  # noqa: E402
from imgpipe.registry.client import RegistryClient  # noqa: E402
from imgpipe.registry.ranges import fetch_ranges  # noqa: E402
from imgpipe.registry.transfer import fetch_resumable  # noqa: E402
from tests import services  # noqa: E402

BLOCK = 64 << 20
PASSED = ("Content-Type", "Content-Range", "Content-Length",
          "Docker-Distribution-Api-Version", "Docker-Content-Digest")


def make_blob(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for start in range(0, size, BLOCK):
            block = os.urandom(min(BLOCK, size - start))
            digest.update(block)
            out.write(block)
    return "sha256:" + digest.hexdigest()


def paced_front(upstream: str, rate: float) -> ThreadingHTTPServer:
    """A front that passes GETs on and sends each answer at ``rate`` bytes/s."""
    session = services.plain_session()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked = self.headers.get("Range")
            answer = session.get(upstream + self.path, stream=True, timeout=60,
                                 headers={"Range": asked} if asked else {})
            self.send_response(answer.status_code)
            for name in PASSED:
                if name in answer.headers:
                    self.send_header(name, answer.headers[name])
            self.end_headers()
            started, sent = time.monotonic(), 0
            for block in answer.iter_content(1 << 20):
                self.wfile.write(block)
                sent += len(block)
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def timed(fetch: Callable[[Path], int], partial: Path) -> float:
    partial.unlink(missing_ok=True)
    started = time.perf_counter()
    fetch(partial)
    took = time.perf_counter() - started
    partial.unlink()
    return took


def run(size: int, rounds: int, rate: float | None) -> None:
    with tempfile.TemporaryDirectory(prefix="imgpipe-bench-ranges-", dir=ROOT / "build") as work:
        folder = Path(work)
        registry = services.start_registry(folder / "registry")
        front = None
        try:
            session = services.plain_session()
            subject = services.push_image(session, registry.url, "bench/ranges", "v1",
                                          [services.tar_layer({"f": b"bench"})])
            client = RegistryClient(registry.url)
            squashfs = folder / "blob.sqsh"
            blob = make_blob(squashfs, size)
            published, _ = publish(client, "bench/ranges",
                                   client.manifest("bench/ranges", subject), squashfs, blob,
                                   "zstd", 0)
            squashfs.unlink()
            if rate:
                front = paced_front(registry.url, rate)
                client = RegistryClient(f"http://127.0.0.1:{front.server_address[1]}")
            one, ranged = measure(client, published, folder / "blob.part", rounds)
        finally:
            if front is not None:
                front.shutdown()
            registry.stop()
    link = f"{rate / 1e6:g} MB/s per connection" if rate else "loopback"
    print(f"{size / 2**30:.2f} GiB, {len(published.chunks)} chunks, {link}, "
          f"median of {rounds}:", file=sys.stderr)
    print(f"one stream:      {statistics.median(one):6.2f} s  "
          f"({', '.join(f'{t:.2f}' for t in one)})", file=sys.stderr)
    print(f"4 ranges:        {statistics.median(ranged):6.2f} s  "
          f"({', '.join(f'{t:.2f}' for t in ranged)})", file=sys.stderr)
    print(f"ranges / stream: {statistics.median(ranged) / statistics.median(one):6.2f}",
          file=sys.stderr)


def measure(client: RegistryClient, published: PublishedSquashfs, partial: Path,
            rounds: int) -> tuple[list[float], list[float]]:
    def one_stream(path: Path) -> int:
        return fetch_resumable(client, published.repository, published.blob, path, None,
                               published.size)

    def ranges(path: Path) -> int:
        return fetch_ranges(client, published.repository, published.blob, path,
                            published.size, published.chunk_size, published.chunks, 4)

    one: list[float] = []
    ranged: list[float] = []
    for turn in range(rounds):  # alternating, so neither always runs on a warmer machine
        order = [(one_stream, one), (ranges, ranged)]
        for fetch, times in order if turn % 2 == 0 else reversed(order):
            times.append(timed(fetch, partial))
    return one, ranged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="the blob's size (default 1G = 1 GiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-connection-mbps", type=float, default=None,
                        help="pace each answer to this many MB/s (a front in this process)")
    args = parser.parse_args()
    (ROOT / "build").mkdir(exist_ok=True)
    rate = args.per_connection_mbps * 1e6 if args.per_connection_mbps else None
    run(parse_size(args.size), args.rounds, rate)


if __name__ == "__main__":
    main()
