"""What the trusted cache writer costs a start: a job user's cold `get` converted by the
service account through sudo (enroot.cache_writer), against the same user converting for
itself, side by side; then another user's warm `get` of the shared entry.

A shared cache that root set up (node-config --make-cache) with the layout owned by the
service account, a sudoers line letting every user run exactly the writer as it (removed at
the end), the importer installed as compute nodes have it.  Each cold start on an empty
cache.  Run as root, with the image in the registry:

    ./setup.sh demo   # the registry on 127.0.0.1:5000 holds imgpipe/bert
    .venv/bin/python bench/bench_writer.py [--image imgpipe/bert:latest-cpu] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.enroot.cache.layout import make_layout  # noqa: E402
from imgpipe.enroot.cache.storage import Storage  # noqa: E402
from imgpipe.enroot.cache.trust import CacheTrust  # noqa: E402
from tests.cluster import USERS, ensure_users, system_imgpipe  # noqa: E402

SERVICE = "imgpipe-cache"


def ensure_service() -> None:
    try:
        pwd.getpwnam(SERVICE)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SERVICE], check=True)


def timed_get(importer: Path, user: str, uri: str, config: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(["runuser", "-u", user, "--", "env", f"IMGPIPE_CONFIG={config}",
                           str(importer), "get", uri], capture_output=True, text=True,
                          timeout=1800, cwd="/tmp")
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"get as {user} failed: {done.stderr.strip()}")
    return took, done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default="127.0.0.1:5000")
    parser.add_argument("--image", default="imgpipe/bert:latest-cpu")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    ensure_users()
    ensure_service()
    alice, bob = USERS
    bin_dir = system_imgpipe(ROOT)
    importer, writer = bin_dir / "imgpipe-pyxis-importer", bin_dir / "imgpipe-cache-writer"
    host, port = args.registry.rsplit(":", 1)
    repository, tag = args.image.rsplit(":", 1)
    uri = f"docker://{host}:{port}#{repository}:{tag}"
    folder = Path(tempfile.mkdtemp(prefix="bench-writer-"))
    os.chmod(folder, 0o755)
    cache = folder / "squashfs"
    sudoers = Path(f"/etc/sudoers.d/imgpipe-bench-{os.getpid()}")
    configs = {}
    for name, enroot in (("own", {"cache_owner": SERVICE}),
                         ("writer", {"cache_owner": SERVICE, "cache_writer": f"{writer} "
                                     f"--config {folder / 'writer.yaml'}"})):
        configs[name] = folder / f"{name}.yaml"
        configs[name].write_text(json.dumps({"registry": {"host": host, "port": int(port)},
                                             "outputs": {"squashfs_dir": str(cache)},
                                             "enroot": enroot}))
        os.chmod(configs[name], 0o644)
    try:
        sudoers.write_text(f"ALL ALL=({SERVICE}) NOPASSWD: {writer} --config "
                           f"{configs['writer']} *\n")
        os.chmod(sudoers, 0o440)
        results: dict[str, list[float]] = {"own": [], "writer": [], "warm": []}
        for _ in range(args.runs):
            for name in ("own", "writer"):
                shutil.rmtree(cache, ignore_errors=True)
                make_layout(Storage(cache, CacheTrust.of(SERVICE)))
                took, said = timed_get(importer, alice, uri, configs[name])
                assert ("asking" in said) == (name == "writer"), said
                results[name].append(took)
            results["warm"] += [timed_get(importer, bob, uri, configs["writer"])[0]
                                for _ in range(5)]
    finally:
        sudoers.unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    own, through = statistics.median(results["own"]), statistics.median(results["writer"])
    print(f"image {args.image}, {args.runs} cold start(s) each, alternating:")
    print(f"  a job user converting for itself:        {own:6.2f} s  {results['own']}")
    print(f"  the service account converting (sudo):   {through:6.2f} s  {results['writer']}")
    print(f"  ratio writer/own: {through / own:.2f}")
    print(f"  another user's warm get of the shared entry: "
          f"{statistics.median(results['warm']):.3f} s (median of {len(results['warm'])})")


if __name__ == "__main__":
    main()
