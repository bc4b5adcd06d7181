"""The Pyxis importer's answer time as Pyxis sees it: a new process per call.

With Pyxis's squashfuse mode a job starts in about 0.4 s, so the importer's `get` for a
digest already converted is most of a job's start-up.  Measured from a regular (not
editable) install made from Debian's Python, as compute nodes have it: `get` by digest (no
network), by tag (one HEAD), by an index's digest (one GET of the index, for a multi-platform
image), and `release`; cold (page cache dropped first, root only)
and warm (median of 10).  Goals: get <= 0.1 s, release <= 0.05 s.

    ./setup.sh demo   # the registry on 127.0.0.1:5000 holds imgpipe/bert
    .venv/bin/python bench/bench_importer.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import system_imgpipe  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return took


def _tag_digest(host: str, port: int, repository: str, tag: str) -> str | None:
    import http.client

    from imgpipe.registry.mediatypes import MANIFEST_ACCEPT

    connection = http.client.HTTPConnection(host, port, timeout=10)
    connection.request("HEAD", f"/v2/{repository}/manifests/{tag}",
                       headers={"Accept": MANIFEST_ACCEPT})
    return connection.getresponse().getheader("Docker-Content-Digest")


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default="127.0.0.1:5000")
    parser.add_argument("--image", default="imgpipe/bert:latest-cpu")
    parser.add_argument("--as-user", default=None, metavar="USER",
                        help="run the importer as USER (a job user) on a shared cache that "
                        "root set up (node-config --make-cache), as on a cluster")
    args = parser.parse_args()
    importer = str(system_imgpipe(ROOT) / "imgpipe-pyxis-importer")
    host, port = args.registry.rsplit(":", 1)
    with tempfile.TemporaryDirectory(prefix="bench-importer-") as folder:
        config = Path(folder) / "imgpipe.yaml"
        config.write_text(f"registry: {{host: '{host}', port: {port}}}\n"
                          f"outputs: {{squashfs_dir: {folder}/sqsh}}\n")
        env = {**os.environ, "IMGPIPE_CONFIG": str(config), "XDG_RUNTIME_DIR": folder,
               "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}
        if args.as_user:
            from imgpipe.enroot.cache.layout import make_layout
            from imgpipe.enroot.cache.storage import Storage

            os.chmod(folder, 0o755)
            make_layout(Storage(Path(folder) / "sqsh"))
            env.pop("XDG_RUNTIME_DIR")  # the user's own ~/.cache/imgpipe holds the record
            importer_argv = ["runuser", "-u", args.as_user, "--", importer]
        else:
            importer_argv = [importer]
        repository, tag = args.image.rsplit(":", 1)
        by_tag = f"docker://{host}:{port}#{repository}:{tag}"
        first = subprocess.run([*importer_argv, "get", by_tag], env=env, capture_output=True,
                               text=True, timeout=1800, check=True).stdout.strip()
        digest = "sha256:" + first.split("+sha256-")[1].split("+")[0]
        by_digest = f"docker://{host}:{port}#{repository}@{digest}"
        cases = {"get by digest": [*importer_argv, "get", by_digest],
                 "get by tag": [*importer_argv, "get", by_tag],
                 "release": [*importer_argv, "release"]}
        named = _tag_digest(host, int(port), repository, tag)
        if named and named != digest:  # the tag names an index: what multi-platform pins
            cases["get by index digest"] = [*importer_argv, "get",
                                            f"docker://{host}:{port}#{repository}@{named}"]
        if args.as_user:
            cases["runuser alone"] = ["runuser", "-u", args.as_user, "--", "/bin/true"]
        print(f"image {args.image}: {first} (converted once before timing)")
        for name, argv in cases.items():
            cold = timed(argv, env) if drop_caches() else None
            warm = statistics.median(timed(argv, env) for _ in range(10))
            goal = 0.05 if name == "release" else 0.1
            shown = f"cold {cold:.3f} s, " if cold is not None else "cold n/a (not root), "
            print(f"{name:>14}: {shown}warm {warm:.3f} s (median of 10; goal <= {goal} s)")


if __name__ == "__main__":
    main()
