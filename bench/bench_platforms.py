"""Build and conversion time per platform: emulated linux/arm64 against native linux/amd64,
on this x86 machine, measured in one run.

The image is a Debian 12 + Python base of each platform (``imgpipe base-image``, the arm64
one by ``debootstrap --arch arm64`` under emulation; minutes, made once) with RUN steps that
run the target's Python: a venv (ensurepip installs pip into it), the bert trainer's own
package placed in it (without torch: no CPU aarch64 wheel is reachable here,
and PyPI's aarch64 torch is the CUDA build), and the venv compiled again.  Through the real CLI:

  build    imgpipe build pyapp --platform P --no-cache       per platform, alternating
  convert  imgpipe convert pyapp --platform P (cold cache)   per platform, alternating

and prints each platform's median and the ratio arm64 / amd64 (goal for conversion: within
10 %: nothing of the target runs in a conversion).

    .venv/bin/python bench/bench_platforms.py [--repeat 3]
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

PLATFORMS = ("linux/amd64", "linux/arm64")
DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY trainer /src/trainer
RUN python3 -m venv /opt/venv \\
 && cp -r /src/trainer/bert_trainer /opt/venv/lib/python3.11/site-packages/ \\
 && /opt/venv/bin/python -m compileall -q -f /opt/venv \\
 && /opt/venv/bin/python -c "import platform; print(platform.machine())" > /etc/built-on
"""


def _project(folder: Path, port: int, bases: dict[str, str]) -> None:
    image = folder / "images" / "pyapp"
    image.mkdir(parents=True)
    shutil.copytree(ROOT / "images" / "bert" / "trainer", image / "trainer",
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    (image / "Dockerfile").write_text(DOCKERFILE)
    (image / "image.yaml").write_text(json.dumps({
        "name": "pyapp", "repository": "bench/pyapp", "version": "1.0.0",
        "platforms": list(PLATFORMS),
        "flavors": {"cpu": {"base": bases["linux/amd64"],
                            "platform_bases": {"linux/arm64": bases["linux/arm64"]}}}}))
    (folder / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": port}, "default_flavor": "cpu",
        "outputs": {"squashfs_dir": str(folder / "squashfs")}}))


def run(repeat: int) -> None:
    from imgpipe.base.platforms import Platform
    from imgpipe.pipeline.baseimage import DEFAULT_TAG, ensure_base_image

    builds: dict[str, list[float]] = {p: [] for p in PLATFORMS}
    converts: dict[str, list[float]] = {p: [] for p in PLATFORMS}
    sizes: dict[str, int] = {}
    with services.docker_engine(), tempfile.TemporaryDirectory(prefix="imgpipe-bench-") as work:
        bases = {"linux/amd64": services.ensure_base_image(),
                 "linux/arm64": ensure_base_image(f"{DEFAULT_TAG}-arm64",
                                                  platform=Platform.parse("linux/arm64"),
                                                  mirror=services.DEBIAN_MIRROR)[0]}
        folder = Path(work)
        registry = services.start_registry(folder / "registry")
        try:
            _project(folder, registry.port, bases)
            quiet = ["--json"]
            for _ in range(repeat):
                for platform in PLATFORMS:
                    builds[platform].append(timed(folder, "build", "pyapp", "--platform",
                                                  platform, "--no-cache", "--force", *quiet))
            timed(folder, "build", "pyapp", *quiet)  # both platforms, one index
            timed(folder, "push", "pyapp", *quiet)
            for _ in range(repeat):
                for platform in PLATFORMS:
                    shutil.rmtree(folder / "squashfs", ignore_errors=True)
                    converts[platform].append(timed(folder, "convert", "pyapp", "--platform",
                                                    platform, *quiet))
                    sizes[platform] = sum(p.stat().st_size
                                          for p in (folder / "squashfs").glob("*.sqsh"))
        finally:
            registry.stop()
    report(builds, converts, sizes, repeat)


def report(builds: dict[str, list[float]], converts: dict[str, list[float]],
           sizes: dict[str, int], repeat: int) -> None:
    print(f"\n{'platform':<13} {'build (median of ' + str(repeat) + ')':>22} "
          f"{'convert (cold)':>16} {'squashfs':>10}", file=sys.stderr)
    for platform in PLATFORMS:
        print(f"{platform:<13} {statistics.median(builds[platform]):20.1f} s "
              f"{statistics.median(converts[platform]):14.2f} s "
              f"{sizes[platform] / 1e6:7.1f} MB", file=sys.stderr)
    arm, amd = "linux/arm64", "linux/amd64"
    print(f"build   arm64 (emulated) / amd64 (native): "
          f"{statistics.median(builds[arm]) / statistics.median(builds[amd]):5.2f}x",
          file=sys.stderr)
    print(f"convert arm64 / amd64:                     "
          f"{statistics.median(converts[arm]) / statistics.median(converts[amd]):5.2f}x "
          "(goal: within 1.10)", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    run(parser.parse_args().repeat)
