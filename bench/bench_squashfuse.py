"""Squashfuse mode: what each compression costs to make, to store, and to read through FUSE,
and start-up mounted vs unpacked — all side by side in one run.

Pyxis's use_squashfuse=1 mounts the squashfs (squashfuse) instead of unpacking it; reads
then go through FUSE and the decompressor.  Charliecloud's ch-run mounts squashfs files the
same way (squashfuse, in-process), so it stands in for Pyxis here.  Per compression:
conversion time and size, `import torch` in the container, and reading torch's largest
library (MB/s); page cache dropped before each read when run as root.  Then start-up: ch-run
on the squashfs (mounted) against unsquashfs into a folder + ch-run on the folder (what
Pyxis does without squashfuse), time to the first Python statement, and the ratio.

    ./setup.sh demo   # the registry on 127.0.0.1:5000 holds imgpipe/bert
    .venv/bin/python bench/bench_squashfuse.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.enroot.cache.storage import Storage  # noqa: E402
from imgpipe.enroot.convert import convert  # noqa: E402
from imgpipe.enroot.squash.tools import SquashOptions  # noqa: E402
from imgpipe.recipes.runtimes import ENROOT_LIKE_START  # noqa: E402
from imgpipe.registry.client import RegistryClient  # noqa: E402
from imgpipe.registry.reference import Reference  # noqa: E402

COMPRESSIONS = ("zstd", "lz4", "lzo-enroot", "none")
BIG_FILE = ("import torch, os; lib = os.path.join(os.path.dirname(torch.__file__), 'lib'); "
            "print(max((os.path.join(lib, f) for f in os.listdir(lib)), key=os.path.getsize))")


def drop_caches() -> None:
    if os.geteuid() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def in_container(image: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv as Enroot would start it (environment file, /etc/rc, login shell)."""
    env = {**os.environ, "USER": os.environ.get("USER", "root")}
    return subprocess.run(["ch-run", str(image), "--", "/bin/sh", "-c", ENROOT_LIKE_START, "sh",
                           *argv], capture_output=True, text=True, env=env, timeout=600,
                          check=True)


def timed(image: Path, *argv: str) -> float:
    drop_caches()
    started = time.perf_counter()
    in_container(image, *argv)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="127.0.0.1:5000/imgpipe/bert:latest-cpu")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("ch-run") is None:
        raise SystemExit("ch-run is missing: apt-get install charliecloud-runtime")
    ref = Reference.parse(args.image)
    client = RegistryClient(f"http://{ref.registry}")
    with tempfile.TemporaryDirectory(prefix="bench-squashfuse-", dir="/var/tmp") as folder:
        storage = Storage(Path(folder) / "sqsh")
        rows = []
        big = None
        for compression in COMPRESSIONS:
            conversion = convert(client, storage, ref, SquashOptions(compression))  # type: ignore[arg-type]
            image = conversion.path
            if big is None:
                big = in_container(image, "python3", "-c", BIG_FILE).stdout.strip()
            size_mb = Path(image).stat().st_size / 1e6
            big_mb = int(in_container(image, "stat", "-c", "%s", big).stdout) / 1e6
            imports = [timed(image, "python3", "-c", "import torch")
                       for _ in range(args.runs)]
            reads = [timed(image, "sh", "-c", 'cat "$1" >/dev/null', "sh", big)
                     for _ in range(args.runs)]
            rows.append((compression, conversion.seconds, size_mb,
                         statistics.median(imports), big_mb / statistics.median(reads)))
            print(f"{compression:>10}: converted in {conversion.seconds:5.1f} s, "
                  f"{size_mb:6.0f} MB; import torch {statistics.median(imports):.2f} s; "
                  f"read {big_mb:.0f} MB at {big_mb / statistics.median(reads):.0f} MB/s "
                  f"(median of {args.runs})", flush=True)
        default = Path(storage.find_squashfs(  # type: ignore[arg-type]
            convert(client, storage, ref, SquashOptions("zstd")).digest, "zstd"))
        mounted, unpacked = [], []
        for _ in range(args.runs):
            mounted.append(timed(default, "python3", "-c", "pass"))
            tree = Path(folder) / "tree"
            drop_caches()
            started = time.perf_counter()
            subprocess.run(["unsquashfs", "-q", "-n", "-d", str(tree), str(default)],
                           check=True, capture_output=True)
            env = {**os.environ, "USER": os.environ.get("USER", "root")}
            subprocess.run(["ch-run", str(tree), "--", "/bin/sh", "-c", ENROOT_LIKE_START,
                            "sh", "python3", "-c", "pass"], check=True, capture_output=True,
                           env=env)
            unpacked.append(time.perf_counter() - started)
            shutil.rmtree(tree)
        m, u = statistics.median(mounted), statistics.median(unpacked)
        print(f"start-up to the first Python statement (zstd, median of {args.runs}): "
              f"mounted {m:.2f} s, unpacked first {u:.2f} s, ratio {m / u:.3f}")


if __name__ == "__main__":
    main()
