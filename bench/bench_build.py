"""No-op build against a cold build of the bert image (cpu flavor), measured in one run.

Sets up its own project folder and registry (Debian's docker-registry on a free
127.0.0.1 port), then times, through the real CLI:

  cold     imgpipe build bert --no-cache        (every BuildKit step runs)
  push     imgpipe push bert
  no-op    imgpipe build bert                   (inputs unchanged: no build at all)

and prints the no-op time as a ratio of the cold build.  Needs a Docker engine,
the debootstrap base image (imgpipe base-image) and a CPU torch wheel.

    .venv/bin/python bench/bench_build.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402
from tests import services  # noqa: E402


def run(repeat: int) -> None:
    with services.docker_engine(), tempfile.TemporaryDirectory(prefix="imgpipe-bench-") as work:
        services.ensure_base_image()
        folder = Path(work)
        registry = services.start_registry(folder / "registry")
        try:
            shutil.copytree(ROOT / "images" / "bert", folder / "images" / "bert")
            (folder / "imgpipe.yaml").write_text(json.dumps({
                "registry": {"port": registry.port}, "default_flavor": "cpu",
                "build": {"wheels_dir": str(services.torch_wheels_dir())}}))
            quiet = ["--json"]  # keep progress out of the timing output
            cold = timed(folder, "build", "bert", "--no-cache", *quiet)
            push = timed(folder, "push", "bert", *quiet)
            noops = [timed(folder, "build", "bert", *quiet) for _ in range(repeat)]
        finally:
            registry.stop()
    noop = statistics.median(noops)
    print(f"\ncold build (--no-cache):   {cold:8.2f} s", file=sys.stderr)
    print(f"push:                      {push:8.2f} s", file=sys.stderr)
    print(f"no-op build (median of {repeat}): {noop:8.3f} s", file=sys.stderr)
    print(f"ratio no-op / cold build:  {noop / cold:8.4f}  ({cold / noop:.0f}x faster)",
          file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    run(parser.parse_args().repeat)
