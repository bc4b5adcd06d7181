"""`imgpipe push` of an NGC-sized image: progress inside multi-GB layers, and a killed push
that resumes without sending the finished blobs again.

What a team does with NVIDIA's PyTorch image as the base: an image ``FROM`` it (here the
image bench/ngc_image.py makes, in a registry standing in for nvcr.io), built with
``imgpipe build``, pushed with ``imgpipe push`` to the head node's registry.  The bench runs
three pushes, stderr going to a log (so progress prints every 5 s, as in CI):

1. a whole push into an empty registry (the baseline);
2. a push into a second empty registry, killed (SIGKILL) once it holds about half the
   image's compressed bytes;
3. that push again: what it sends, and what the engine says it skips ("Layer already
   exists").

Printed: seconds, bytes the registry received, progress lines and how often they came.

    .venv/bin/python bench/bench_push.py --size 15G      # ~40 min on 2 cores, ~45 GB disk
    .venv/bin/python bench/bench_push.py --size 1G       # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ngc_image  # noqa: E402

from imgpipe.base.units import human_bytes, parse_size  # noqa: E402
from tests import services  # noqa: E402

IMGPIPE = str(ROOT / ".venv" / "bin" / "imgpipe")
DOCKERFILE = """ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# What a team adds on NVIDIA's image: a little of its own (the image has no shell to RUN).
COPY README /workspace/README
"""


def blobs(registry: services.RegistryProcess) -> tuple[int, int]:
    """(count, bytes) of the finished blobs the registry stores."""
    folder = registry.root / "data" / "docker" / "registry" / "v2" / "blobs"
    files = [p for p in folder.rglob("data") if p.is_file()] if folder.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def project(folder: Path, base: str, registry: services.RegistryProcess) -> Path:
    image = folder / "images" / "ngc"
    image.mkdir(parents=True, exist_ok=True)
    (image / "Dockerfile").write_text(DOCKERFILE)
    (image / "README").write_text("imgpipe push bench\n")
    (image / "image.yaml").write_text(yaml.safe_dump({
        "name": "ngc", "repository": "bench/ngc", "version": "1.0.0",
        "description": "an NGC-sized image for the push bench",
        "flavors": {"cpu": {"base": base}}, "selftest": ["/usr/bin/true"]}))
    (folder / "imgpipe.yaml").write_text(yaml.safe_dump({
        "registry": {"port": registry.port}, "default_flavor": "cpu"}))
    return folder


def push(folder: Path, log: Path, kill_at: int | None,
         registry: services.RegistryProcess) -> dict[str, object]:
    """``imgpipe push ngc``; with ``kill_at``, SIGKILL once the registry holds that many
    blob bytes more than at the start."""
    _, before = blobs(registry)
    started = time.monotonic()
    with log.open("w") as out:
        child = subprocess.Popen([IMGPIPE, "push", "ngc"], cwd=folder, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        killed = False
        while child.poll() is None:
            if kill_at is not None and blobs(registry)[1] - before >= kill_at:
                os.killpg(child.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.5)
        code = child.wait()
    seconds = time.monotonic() - started
    text = log.read_text()
    lines = [line for line in text.splitlines() if re.search(r"\bpush \S+: .* at ", line)]
    count, stored = blobs(registry)
    return {"seconds": round(seconds, 1), "exit": code, "killed": killed,
            "received": stored - before, "blobs": count,
            "progress_lines": len(lines),
            "progress_every_s": round(seconds / max(len(lines), 1), 1),
            # the first tag's push: the others only point at what it sent
            "skipped": text.split("digest: sha256:")[0].count("Layer already exists"),
            "last_progress": lines[-1] if lines else ""}


def build_and_push(folder: Path, log: Path, kill_at: int | None,
                   registry: services.RegistryProcess) -> dict[str, object]:
    """``imgpipe build ngc`` for this registry (BuildKit's cache: seconds), then the push."""
    started = time.monotonic()
    subprocess.run([IMGPIPE, "build", "ngc"], cwd=folder, check=True, capture_output=True)
    print(f"imgpipe build ngc for {registry.address}: {time.monotonic() - started:.0f} s",
          flush=True)
    return push(folder, log, kill_at, registry)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="15G")
    parser.add_argument("--layers", type=int, default=44)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "push.json")
    args = parser.parse_args(argv)
    if not services.engine_answers():
        raise SystemExit("error: no Docker engine answers: start one "
                         "(dockerd --bridge=none --iptables=false) or run ./setup.sh test once")
    work = Path(tempfile.mkdtemp(prefix="bench-push-"))
    source = services.start_registry(work / "source")  # stands in for nvcr.io
    target = services.start_registry(work / "target")  # the head node's registry
    whole = services.start_registry(work / "whole")
    base = ""
    try:
        print(f"generating {args.size} into the source registry", flush=True)
        made = ngc_image.generate(source.address, "scale/ngc", args.size.lower(),
                                  parse_size(args.size), args.layers, 2026,
                                  ROOT / "build" / "bench" / "ngc-image.json",
                                  say=lambda text: print(f"  {text}", flush=True))
        base = f"{source.address}/scale/ngc:{args.size.lower()}"
        started = time.monotonic()  # the engine holds NVIDIA's image before any build
        subprocess.run([services.DOCKER, "pull", "-q", base], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"docker pull {base}: {time.monotonic() - started:.0f} s", flush=True)
        folder = project(work / "project", base, whole)
        rows = {"whole": build_and_push(folder, work / "push-whole.log", None, whole)}
        project(folder, base, target)
        half = int(made["compressed"]) // 2  # type: ignore[call-overload]
        rows["killed"] = build_and_push(folder, work / "push-killed.log", half, target)
        rows["resumed"] = push(folder, work / "push-resumed.log", None, target)
        for name, row in rows.items():
            print(f"{name:8} {row['seconds']:7.1f} s  exit {row['exit']}  received "
                  f"{human_bytes(int(row['received']))}  skipped {row['skipped']} layers  "  # type: ignore[call-overload]
                  f"{row['progress_lines']} progress lines (one per {row['progress_every_s']} s)",
                  flush=True)
        print(f"last progress line of the resumed push: {rows['resumed']['last_progress']}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"image": made, **rows}, indent=1))
        print(f"written {args.out}; logs in {work}")
    finally:
        for registry in (source, target, whole):
            registry.stop()
            shutil.rmtree(registry.root, ignore_errors=True)  # logs stay in the work folder
        if base:  # the engine's copies are as large as the image: leave no 15 GB behind
            subprocess.run([services.DOCKER, "rmi", "-f", base,
                            *[f"{r.address}/bench/ngc:{tag}" for r in (target, whole)
                              for tag in ("1.0.0", "latest")]],
                           capture_output=True)
            subprocess.run([services.DOCKER, "image", "prune", "-f"], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
