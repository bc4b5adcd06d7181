"""A fresh runner's rebuild of an unchanged bert image (cpu flavor): with the head-node
registry's cache against without it, measured in one run.

A "fresh runner" is an engine without the image and without BuildKit's local cache (both
removed here: this prunes the engine's build cache for the whole machine).  Both rebuilds
are forced (`imgpipe build bert --force`) from the same inputs:

  seed        imgpipe build bert && imgpipe push   (the push carries the inline cache)
  cached      fresh engine, build.registry_cache on: layers come from the registry
  uncached    fresh engine, build.registry_cache off: every step runs (torch installed again)

Needs a Docker engine, the debootstrap base image and a CPU torch wheel.

    .venv/bin/python bench/bench_registry_cache.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402
from tests import services  # noqa: E402


def fresh_engine(folder: Path, repository: str) -> None:
    """Forget every local trace of the image: every bert image in the engine (tags of any
    registry share its layers: leaving one would keep the layers), BuildKit's cache, the
    build record."""
    # BuildKit's cache first: records that outlive the images they point into break the
    # 20.10 engine's next export ("layer does not exist").
    subprocess.run([services.DOCKER, "builder", "prune", "-af"], check=True,
                   capture_output=True)
    listed = subprocess.run([services.DOCKER, "image", "ls", "--format",
                             "{{.Repository}}:{{.Tag}} {{.ID}}"], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    bert = sorted({line.split()[1] for line in listed
                   if line.split()[0].rsplit(":", 1)[0].endswith("/bert")})
    if bert:
        subprocess.run([services.DOCKER, "image", "rm", "-f", *bert], check=True,
                       capture_output=True)
    subprocess.run([services.DOCKER, "image", "prune", "-f"], check=True, capture_output=True)
    shutil.rmtree(folder / "build" / "state", ignore_errors=True)


def configure(folder: Path, port: int, registry_cache: bool) -> None:
    (folder / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": port}, "default_flavor": "cpu",
        "build": {"wheels_dir": str(services.torch_wheels_dir()),
                  "registry_cache": registry_cache}}))


def run() -> None:
    with services.docker_engine(), tempfile.TemporaryDirectory(prefix="imgpipe-bench-") as work:
        services.ensure_base_image()
        folder = Path(work)
        registry = services.start_registry(folder / "registry")
        repository = f"127.0.0.1:{registry.port}/imgpipe/bert"
        try:
            shutil.copytree(ROOT / "images" / "bert", folder / "images" / "bert")
            configure(folder, registry.port, True)
            seed = (timed(folder, "build", "bert", "--json")
                    + timed(folder, "push", "bert", "--json"))
            fresh_engine(folder, repository)
            cached = timed(folder, "build", "bert", "--force", "--json")
            fresh_engine(folder, repository)
            configure(folder, registry.port, False)
            uncached = timed(folder, "build", "bert", "--force", "--json")
        finally:
            registry.stop()
    print(f"\nseed build + push:                       {seed:8.1f} s", file=sys.stderr)
    print(f"fresh runner, registry cache:            {cached:8.1f} s", file=sys.stderr)
    print(f"fresh runner, no registry cache:         {uncached:8.1f} s", file=sys.stderr)
    print(f"ratio cached / uncached:                 {cached / uncached:8.3f}  "
          f"({uncached / cached:.1f}x faster)", file=sys.stderr)


if __name__ == "__main__":
    run()
