"""Cold and warm squashfs conversion against Enroot's way, measured side by side.

Baseline (what Enroot effectively does): ``docker export | tar -x`` of the
image, then ``mksquashfs -all-root -processors N -comp lzo -noD``.
imgpipe: ``convert`` from the registry with an empty blob cache (cold), per
compression, and again once converted (warm, in-process and as the CLI).

Images: a single-layer image (the debootstrap base, ~260 MB) and the bert cpu
image (6 layers, 1.2 GB, built if missing).  Goals: cold/baseline <= 0.4 with
the default zstd and <= 0.9 with lzo-enroot; warm < 0.5 s.

    .venv/bin/python bench/bench_convert.py [--images base,bert] [--compressions zstd,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.cli.main import main  # noqa: E402
from imgpipe.enroot.cache.storage import Storage  # noqa: E402
from imgpipe.enroot.convert import convert  # noqa: E402
from imgpipe.enroot.squash.tools import SquashOptions  # noqa: E402
from imgpipe.registry.client import RegistryClient  # noqa: E402
from imgpipe.registry.reference import Reference  # noqa: E402
from tests import services  # noqa: E402

DOCKER = services.DOCKER


def sh(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, **kwargs)


def baseline(image: str, work: Path) -> tuple[float, int]:
    tree, out = work / "export", work / "baseline.sqsh"
    tree.mkdir()
    started = time.perf_counter()
    container = sh(DOCKER, "create", image, text=True).stdout.strip()
    try:
        export = subprocess.Popen([DOCKER, "export", container], stdout=subprocess.PIPE)
        sh("tar", "-x", "-C", str(tree), stdin=export.stdout)
        export.wait()
    finally:
        sh(DOCKER, "rm", container)
    sh("mksquashfs", str(tree), str(out), "-all-root", "-processors", str(os.cpu_count()),
       "-comp", "lzo", "-noD", "-noappend", "-quiet", "-no-progress")
    seconds = time.perf_counter() - started
    size = out.stat().st_size
    shutil.rmtree(tree)
    out.unlink()
    return seconds, size


def ours(client: RegistryClient, ref: Reference, compression: str, work: Path
         ) -> tuple[float, int, float]:
    storage = Storage(work / f"sqsh-{compression}")
    started = time.perf_counter()
    done = convert(client, storage, ref, SquashOptions(compression))  # type: ignore[arg-type]
    cold = time.perf_counter() - started
    started = time.perf_counter()
    again = convert(client, storage, ref.with_digest(done.digest),
                    SquashOptions(compression))  # type: ignore[arg-type]
    warm = time.perf_counter() - started
    assert not again.converted
    size = done.size
    shutil.rmtree(storage.root)
    return cold, size, warm


def cli_warm(registry_port: int, ref: str, work: Path) -> float:
    folder = work / "cli"
    folder.mkdir(exist_ok=True)
    (folder / "imgpipe.yaml").write_text(json.dumps({"registry": {"port": registry_port}}))
    argv = [sys.executable, "-c", "from imgpipe.cli.main import run; run()", "convert", ref,
            "--json"]
    sh(*argv, cwd=folder)
    started = time.perf_counter()
    sh(*argv, cwd=folder)
    return time.perf_counter() - started


def ensure_bert(work: Path, registry_port: int) -> str:
    (work / "proj").mkdir()
    shutil.copytree(ROOT / "images" / "bert", work / "proj" / "images" / "bert")
    (work / "proj" / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": registry_port}, "default_flavor": "cpu",
        "build": {"wheels_dir": str(services.torch_wheels_dir())}}))
    old = Path.cwd()
    os.chdir(work / "proj")
    try:
        assert main(["build", "bert", "--json"]) == 0
        assert main(["push", "bert", "--json"]) == 0
    finally:
        os.chdir(old)
    lock = json.loads((work / "proj" / "imgpipe.lock").read_text())
    return lock["images"]["bert"]["cpu"]["pinned"] if "pinned" in lock else (
        f"{lock['images']['bert']['cpu']['repository']}:"
        f"{lock['images']['bert']['cpu']['tags'][0]}")


def run(images: list[str], compressions: list[str]) -> None:
    with services.docker_engine(), tempfile.TemporaryDirectory(prefix="imgpipe-bench-") as tmp:
        work = Path(tmp)
        base = services.ensure_base_image()
        registry = services.start_registry(work / "registry")
        try:
            client = RegistryClient(registry.url)
            targets = {}
            if "base" in images:
                tag = f"{registry.address}/bench/base:1"
                sh(DOCKER, "tag", base, tag)
                sh(DOCKER, "push", tag)
                targets["single layer (debootstrap base)"] = tag
            if "bert" in images:
                targets["multi layer (bert cpu)"] = ensure_bert(work, registry.port)
            for title, tag in targets.items():
                layers = len(client.manifest(*tag.split("/", 1)[1].rsplit(":", 1)).layers)
                base_s, base_size = baseline(tag, work)
                print(f"\n{title}: {tag} ({layers} layers)", file=sys.stderr)
                print(f"  baseline  docker export | tar -x + mksquashfs lzo -noD: "
                      f"{base_s:7.2f} s  {base_size / 1e6:8.1f} MB", file=sys.stderr)
                ref = Reference.parse(tag)
                for compression in compressions:
                    cold, size, warm = ours(client, ref, compression, work)
                    print(f"  imgpipe   {compression:<10} cold {cold:7.2f} s  "
                          f"{size / 1e6:8.1f} MB   ratio {cold / base_s:5.2f}   "
                          f"warm {warm * 1000:6.1f} ms", file=sys.stderr)
                print(f"  imgpipe convert (CLI process, warm): "
                      f"{cli_warm(registry.port, tag, work):.2f} s", file=sys.stderr)
        finally:
            registry.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="base,bert")
    parser.add_argument("--compressions", default="zstd,lzo-enroot,lz4,none")
    args = parser.parse_args()
    run(args.images.split(","), args.compressions.split(","))
