"""What verifying cached blobs on use costs, against a warm-blob conversion of the same image.

A conversion verifies every byte it publishes: in pass 2, the compressed blob against its
digest and the uncompressed stream against the config's diff_id.  The extra work
is exactly those sha256 updates; this bench times them on the image's real layers, in the
same run as warm-blob conversions (blobs cached, squashfs removed) of that image, and prints
the ratio.  Goal: <= 0.10.

    ./setup.sh demo   # the registry on 127.0.0.1:5000 holds imgpipe/bert
    .venv/bin/python bench/bench_verify.py [--image 127.0.0.1:5000/imgpipe/bert:latest-cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.enroot.cache.storage import Storage  # noqa: E402
from imgpipe.enroot.convert import convert  # noqa: E402
from imgpipe.enroot.flatten.decoder import Blob, tar_chunks  # noqa: E402
from imgpipe.enroot.squash.tools import SquashOptions  # noqa: E402
from imgpipe.registry.client import RegistryClient  # noqa: E402
from imgpipe.registry.reference import Reference  # noqa: E402

CHUNK = 1 << 20


def hashing_seconds(blob: Path) -> tuple[float, float, int, int]:
    """(seconds hashing the compressed bytes, seconds hashing the uncompressed stream,
    compressed bytes, uncompressed bytes), reading the blob as a conversion does."""
    compressed = uncompressed = 0.0
    c_bytes = u_bytes = 0
    with open(blob, "rb") as handle:
        digest = hashlib.sha256()
        while data := handle.read(CHUNK):
            started = time.perf_counter()
            digest.update(data)
            compressed += time.perf_counter() - started
            c_bytes += len(data)
    source = Blob(str(blob), hashing=False)
    try:
        digest = hashlib.sha256()
        magic = os.pread(source.handle.fileno(), 4, 0)
        for data in tar_chunks(source, magic):
            started = time.perf_counter()
            digest.update(data)
            uncompressed += time.perf_counter() - started
            u_bytes += len(data)
    finally:
        source.close()
    return compressed, uncompressed, c_bytes, u_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="127.0.0.1:5000/imgpipe/bert:latest-cpu")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ref = Reference.parse(args.image)
    client = RegistryClient(f"http://{ref.registry}")
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as folder:
        storage = Storage(Path(folder))
        options = SquashOptions("zstd")
        first = convert(client, storage, ref, options)  # fills the blob cache
        warm = []
        for _ in range(args.runs):
            first.path.unlink()
            started = time.perf_counter()
            again = convert(client, storage, ref, options)
            warm.append(time.perf_counter() - started)
            assert again.converted
        manifest = client.manifest(ref.repository, again.digest)
        totals = [hashing_seconds(storage.blob(layer["digest"])) for layer in manifest.layers]
    c_s = sum(t[0] for t in totals)
    u_s = sum(t[1] for t in totals)
    c_b = sum(t[2] for t in totals)
    u_b = sum(t[3] for t in totals)
    cost = c_s + u_s  # pass 2 hashes the compressed and the uncompressed bytes
    median = statistics.median(warm)
    print(f"image {args.image}: {len(totals)} layers, {c_b / 1e6:.0f} MB compressed, "
          f"{u_b / 1e6:.0f} MB uncompressed")
    print(f"warm-blob conversion (zstd), median of {args.runs}: {median:.2f} s "
          f"({', '.join(f'{w:.2f}' for w in warm)})")
    print(f"verification: sha256 of compressed {c_s:.2f} s + uncompressed "
          f"{u_s:.2f} s = {cost:.2f} s")
    print(f"ratio verification / warm conversion: {cost / median:.3f} (goal <= 0.10)")


if __name__ == "__main__":
    main()
