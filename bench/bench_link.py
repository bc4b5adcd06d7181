"""A cold conversion over a head node's link: fetch and convert at once, or one after the other.

``imgpipe convert`` starts the one pass on the top layer while the lower layers are still
fetched.  On this 2-core machine, with the registry on loopback, the cold conversion is
CPU-bound either way (the registry, the fetch and the conversion share two cores), so the
overlap shows where the link is the slower part: a compute or login node fetching from the
head node over 1 Gbit/s.  This bench puts a pacing proxy (one link's rate shared by all
connections, server to client) in front of a running registry and measures, each in a
process of its own:

- cold: ``imgpipe convert`` through the link into an empty cache (fetch and pass overlap);
- fetch alone: every blob of the image through the link into an empty cache;
- warm: ``imgpipe convert`` again, the blobs cached, the squashfs removed.

Fetch alone + warm is what the conversion cost when it fetched everything first.

    .venv/bin/imgpipe registry up && .venv/bin/python bench/ngc_image.py --size 5G --layers 40
    .venv/bin/python bench/bench_link.py --image scale/ngc:5g --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RATES = {"gbit": 1e9 / 8, "mbit": 1e6 / 8}
PUMP_CHUNK = 256 << 10


def parse_rate(text: str) -> float:
    """``1gbit`` or ``400mbit`` as bytes per second."""
    for unit, scale in RATES.items():
        if text.endswith(unit):
            return float(text[:-len(unit)]) * scale
    raise SystemExit(f"error: --rate {text!r}: give it as 1gbit or 400mbit")


class Link:
    """One link's rate, shared by every connection through it."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def pace(self, count: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + count / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


def _pump(source: socket.socket, sink: socket.socket, link: Link | None) -> None:
    try:
        while data := source.recv(PUMP_CHUNK):
            if link is not None:
                link.pace(len(data))
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve_link(upstream_port: int, link: Link) -> int:
    """A proxy on 127.0.0.1 (a free port, returned) to the registry on ``upstream_port``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            server = socket.create_connection(("127.0.0.1", upstream_port))
            for args in ((client, server, None), (server, client, link)):
                threading.Thread(target=_pump, args=args, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


def timed(argv: list[str], cwd: Path) -> float:
    started = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv)} exited {done.returncode}: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    return time.monotonic() - started


def fetch_alone(ref: str, folder: str) -> None:
    """Every blob of ``ref`` into an empty cache under ``folder`` (a process of its own)."""
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.fetch.blobs import fetch_image
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.reference import Reference

    parsed = Reference.parse(ref)
    client = RegistryClient(f"http://{parsed.registry}")
    digest = client.manifest(parsed.repository, parsed.reference).digest
    fetch_image(client, Storage(Path(folder) / "blobs"), parsed.repository, digest)


def run(image: str, port: int, rate: float, out: Path) -> dict[str, float]:
    imgpipe = str(Path(sys.executable).parent / "imgpipe")
    proxy = serve_link(port, Link(rate))
    ref = f"127.0.0.1:{proxy}/{image}"
    with tempfile.TemporaryDirectory(prefix="imgpipe-link-", dir=out) as scratch:
        work = Path(scratch)
        (work / "imgpipe.yaml").write_text(json.dumps({
            "registry": {"port": proxy}, "outputs": {"squashfs_dir": str(work / "sqsh")}}))
        subprocess.run(["sync"], check=True)
        cold = timed([imgpipe, "convert", ref, "--json"], work)
        blobs = sum(path.stat().st_size for path in
                    (work / "sqsh/.imgpipe/blobs").rglob("*") if path.is_file())
        for squashfs in (work / "sqsh").glob("*.sqsh"):
            squashfs.unlink()
        subprocess.run(["sync"], check=True)
        warm = timed([imgpipe, "convert", ref, "--json"], work)
        shutil.rmtree(work / "sqsh")
        subprocess.run(["sync"], check=True)
        fetch = timed([sys.executable, __file__, "--fetch-alone", ref, "--work", scratch],
                      work)
    return {"rate_bytes_s": rate, "blob_bytes": blobs, "cold": cold, "fetch": fetch,
            "warm": warm, "one_after_the_other": fetch + warm}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="scale/ngc:5g", help="repository:tag in the registry")
    parser.add_argument("--port", type=int, default=5000, help="the registry's port on 127.0.0.1")
    parser.add_argument("--rate", default="1gbit", help="the link's rate (1gbit, 400mbit)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    parser.add_argument("--fetch-alone", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fetch_alone:
        fetch_alone(args.fetch_alone, args.work)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.image, args.port, parse_rate(args.rate), args.out)
    print(f"{args.image} over {args.rate} ({result['blob_bytes'] / 1e9:.2f} GB of blobs):")
    print(f"  fetch alone {result['fetch']:.1f} s, warm conversion {result['warm']:.1f} s: "
          f"one after the other {result['one_after_the_other']:.1f} s")
    print(f"  cold conversion, fetch and pass at once: {result['cold']:.1f} s "
          f"({result['cold'] / result['one_after_the_other']:.2f}x)")
    path = ROOT / "bench" / "results" / "link.json"  # one entry per image and rate
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept[f"{args.image} {args.rate}"] = result
    path.write_text(json.dumps(kept, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
