"""bert's cpu flavor for Grace (linux/arm64) on this x86 machine: its Python packages installed
both ways, the arm64 image against the amd64 one, and which nvidia-* wheels a CPU-only image
could leave out.

1. The install, both ways, per platform, alternating, medians: the step the two builds differ
   in (the rest of each build, BuildKit's context, layers and export, is the same work):

     host pip      what ``imgpipe build`` does (image.yaml's python:): pip on this host
                   resolves the platform's wheels (``--platform``), unpacks them and compiles
                   them (``imgpipe.pipeline.hostsite.stage_site`` into an empty folder);
     emulated pip  the way before: ``python3 -m venv`` and ``pip install`` in a container of
                   the platform's base, for arm64 under qemu as a RUN step of an arm64 build
                   runs (qemu's default CPU, as BuildKit starts it), into a host folder.

   Both take the same wheels from disk (the wheel cache ``imgpipe build`` filled: run
   ``imgpipe build bert --platform linux/amd64,linux/arm64`` first), so neither downloads.

2. The images ``imgpipe.lock`` pins for bert/cpu (this checkout's last push): each platform's
   bytes and layers (the engine), pushed bytes (the registry's manifest), squashfs bytes (the
   lock's file).

3. torch's libraries' NEEDED entries (readelf) name the nvidia-* wheels ``import torch``
   loads; a container of the arm64 image with every other CUDA wheel hidden (an empty folder
   mounted over each) imports torch and trains a step under emulation, or does not.  The ngc
   flavor keeps every one (NVIDIA's image, made for GPUs).

    .venv/bin/python bench/bench_bert_arm64.py [--repeat 1] [--skip-emulated]
"""

from __future__ import annotations

import argparse
import json
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

from tests import services  # noqa: E402

PLATFORMS = ("linux/amd64", "linux/arm64")
BASES = {"linux/amd64": "imgpipe/debian-python:bookworm",
         "linux/arm64": "imgpipe/debian-python:bookworm-arm64"}
STEP = ("import torch; m = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True); "
        "loss = m(torch.randn(8, 16, 64)).pow(2).mean(); loss.backward(); "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'step ok', "
        "round(loss.item(), 4))")


def lock_entry() -> dict:
    lock = json.loads((ROOT / "imgpipe.lock").read_text())
    entry: dict = lock["images"]["bert"]["cpu"]
    if set(entry.get("platforms", {})) != set(PLATFORMS):
        raise SystemExit("imgpipe.lock has no bert/cpu index of linux/amd64 and linux/arm64: "
                         "imgpipe build bert --flavor cpu --platform linux/amd64,linux/arm64 "
                         "&& imgpipe push bert")
    return entry


def _bert() -> tuple[object, object, list[str]]:
    """bert's python: spec, pip as a build runs it here, and its requirements (the trainer
    as the wheel a build made of it)."""
    from imgpipe.pipeline.catalog import load_image
    from imgpipe.pipeline.hostpip import HostPip
    from imgpipe.pipeline.hostresolve import requirements

    image = load_image(ROOT / "images" / "bert")
    spec = image.flavor("cpu").python
    offered = Path("/opt/wheels") if list(Path("/opt/wheels").glob("torch-*.whl")) else None
    pip = HostPip({}, offered, ROOT / "build" / "state" / "wheels", 3600, lambda _line: None)
    lines = requirements(spec, image.flavor("cpu").build_args)  # type: ignore[arg-type]
    trainers = sorted((ROOT / "build" / "state" / "wheels" / "local").glob("*/*.whl"),
                      key=lambda p: p.stat().st_mtime)
    if not trainers:
        raise SystemExit("no trainer wheel here: imgpipe build bert first")
    return spec, pip, [str(trainers[-1]) if line == "./trainer" else line for line in lines]


def wheel_files(platform: str, into: Path, work: Path) -> list[str]:
    """The wheels a host-pip build of ``platform`` installs (resolved as it does, taken from
    disk: the wheel cache or the folder pip found them in), linked into ``into``; their pip
    requirements."""
    from imgpipe.base.platforms import Platform
    from imgpipe.pipeline.hostresolve import chosen, needed_on, resolve
    from imgpipe.pipeline.hostsite import fetch

    spec, pip, wanted = _bert()
    target = Platform.parse(platform)
    picked = chosen(resolve(pip, spec, target, wanted, work))  # type: ignore[arg-type]
    needed, _ = needed_on(target, spec.version, picked)  # type: ignore[attr-defined]
    wheels = [wheel for wheel, _ in picked if wheel.name in needed]
    files = fetch(pip, spec, target, wheels, work)  # type: ignore[arg-type]
    for wheel in wheels:
        try:
            os.link(files[wheel.name], into / wheel.file)
        except OSError:
            shutil.copy2(files[wheel.name], into / wheel.file)
    return [f"{wheel.name}=={wheel.version}" for wheel in wheels]


def host_pip(platform: str, work: Path) -> float:
    """Seconds for pip on this host to install bert's packages for ``platform`` into an
    empty folder, as ``imgpipe build`` does (resolution, unpacking, bytecode)."""
    from imgpipe.base.platforms import Platform
    from imgpipe.pipeline.hostsite import stage_site

    spec, pip, wanted = _bert()
    context = work / "host"
    (context / ".python").mkdir(parents=True)
    started = time.perf_counter()
    stage_site(pip, spec, Platform.parse(platform), wanted, context,  # type: ignore[arg-type]
               work)
    return time.perf_counter() - started


def emulated_pip(platform: str, work: Path) -> float:
    """Seconds for ``python3 -m venv`` and ``pip install`` of the same wheels in a container
    of ``platform``'s base (emulated for arm64), into a host folder."""
    offered = work / "offered"
    offered.mkdir()
    wanted = wheel_files(platform, offered, work)
    out = work / "out"
    out.mkdir()
    script = ("python3 -m venv /out/venv && /out/venv/bin/pip install --no-cache-dir "
              "--disable-pip-version-check --no-index --find-links /wheels " +
              " ".join(f"'{w}'" for w in wanted))
    started = time.perf_counter()
    done = subprocess.run([services.DOCKER, "run", "--rm", "--network=none", "--platform",
                           platform, "--volume", f"{offered}:/wheels:ro", "--volume",
                           f"{out}:/out", BASES[platform], "sh", "-c", script],
                          capture_output=True, text=True, timeout=7200)
    took = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"pip in the {platform} container failed: {done.stderr[-2000:]}")
    return took


def install_both_ways(repeat: int, emulated: bool) -> dict[str, dict[str, list[float]]]:
    lock_entry()
    times: dict[str, dict[str, list[float]]] = {w: {p: [] for p in PLATFORMS}
                                                for w in ("host pip", "emulated pip")}
    for _ in range(repeat):
        for platform in PLATFORMS:
            for way in ("host pip", "emulated pip") if emulated else ("host pip",):
                with tempfile.TemporaryDirectory(prefix="imgpipe-bench-",
                                                 dir=ROOT / "build") as work:
                    seconds = (host_pip(platform, Path(work)) if way == "host pip"
                               else emulated_pip(platform, Path(work)))
                    print(f"  {way:<13} {platform:<12} {seconds:7.1f} s", file=sys.stderr)
                    times[way][platform].append(seconds)
                    subprocess.run(["chmod", "-R", "u+rwX", work], check=False)
    return times


def sizes() -> dict[str, dict[str, float]]:
    """Each platform's image as the lock pins it: bytes and layers in the engine, pushed
    (compressed) bytes, squashfs bytes."""
    from imgpipe.base.configlayers import load_settings
    from imgpipe.commands.shared.wiring import registry_client

    entry = lock_entry()
    client = registry_client(load_settings(cwd=ROOT))
    found: dict[str, dict[str, float]] = {}
    for platform, pin in entry["platforms"].items():
        inspected = json.loads(subprocess.run(
            [services.DOCKER, "image", "inspect", pin["config_digest"]], check=True,
            capture_output=True, text=True).stdout)[0]
        manifest = client.manifest_exactly("imgpipe/bert", pin["digest"])
        squashfs = Path(pin["squashfs"]).stat().st_size if pin.get("squashfs") else 0
        found[platform] = {"bytes": inspected["Size"],
                           "layers": len(inspected["RootFS"]["Layers"]),
                           "pushed": manifest.size, "squashfs": squashfs}
    return found


def leave_out() -> None:
    """Which CUDA wheels torch's libraries load (NEEDED, followed through the wheels' own
    libraries), and whether the arm64 image imports torch and trains a step under emulation
    with every other one hidden."""
    from imgpipe.base.platforms import Platform, emulated_cpuinfo, emulation_env

    entry = lock_entry()
    tree = ROOT / "build" / "state" / "contexts" / "bert-cpu-arm64" / ".python" / \
        "packages" / "lib" / "python3.11" / "site-packages"
    if not tree.is_dir():
        raise SystemExit(f"{tree} is not there: imgpipe build bert --platform linux/arm64")
    owner: dict[str, str] = {}  # library file name -> its distribution
    tops: dict[str, set[str]] = {}  # distribution -> its folders (nvidia/cudnn, triton)
    sizes: dict[str, int] = {}
    for record in tree.glob("*.dist-info/RECORD"):
        dist = record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        total = 0
        for line in record.read_text().splitlines():
            path = line.rsplit(",", 2)[0]
            if path.startswith("..") or ".dist-info/" in path or "__pycache__" in path:
                continue
            parts = path.split("/")
            nested = parts[0] in ("nvidia", "cuda") and len(parts) > 2
            tops.setdefault(dist, set()).add("/".join(parts[:2]) if nested else parts[0])
            if ".so" in parts[-1]:
                owner[parts[-1]] = dist
            if (tree / path).is_file():
                total += (tree / path).stat().st_size
        sizes[dist] = total
    # What `import torch` loads: torch._C and libtorch_global_deps (torch/__init__.py opens
    # it with ctypes), and what their NEEDED entries name, on through each library loaded;
    # libraries torch opens only on use (libtorch_cuda_linalg, cuDNN's engines) are not
    needed = {"torch"}
    queue = [*(tree / "torch").glob("_C.*.so"),
             *(tree / "torch" / "lib").glob("libtorch_global_deps.so")]
    seen: set[Path] = set()
    while queue:
        lib = queue.pop()
        if lib in seen:
            continue
        seen.add(lib)
        dynamic = subprocess.run(["readelf", "-d", str(lib)], capture_output=True,
                                 text=True).stdout
        for line in dynamic.splitlines():
            if "(NEEDED)" in line:
                name = line.split("[", 1)[1].rstrip("]")
                dist = owner.get(name)
                if dist:
                    needed.add(dist)
                    queue += [p for p in tree.rglob(name) if p.is_file() and p not in seen]
    cuda = sorted(d for d in sizes if d.startswith(("nvidia_", "cuda_", "triton")))
    spare = [d for d in cuda if d not in needed]
    print("\nCUDA wheels in the arm64 image: installed MB, and whether import torch loads them",
          file=sys.stderr)
    for dist in cuda:
        print(f"  {dist:<26} {sizes[dist] / 1e6:8.1f}  "
              f"{'NEEDED by torch' if dist in needed else 'not loaded'}", file=sys.stderr)
    # The image's site-packages without the spare wheels' files (RECORD's: nvidia-* wheels
    # share folders such as nvidia/cu13), hard links of the kept context's, mounted over it
    arm = Platform.parse("linux/arm64")
    with tempfile.TemporaryDirectory(dir=ROOT / "build") as empty:
        os.chmod(empty, 0o755)
        cpuinfo = Path(empty) / "cpuinfo"
        cpuinfo.write_text(emulated_cpuinfo(arm) or "")
        left = Path(empty) / "site-packages"
        dropped = {line.rsplit(",", 2)[0] for dist in spare
                   for record in tree.glob(f"{dist}-*.dist-info/RECORD")
                   for line in record.read_text().splitlines()}
        for path in sorted(tree.rglob("*")):
            rel = path.relative_to(tree).as_posix()
            if rel in dropped or any(rel.startswith(f"{d}-") and ".dist-info" in rel
                                     for d in spare):
                continue
            if path.is_dir() and not path.is_symlink():
                (left / rel).mkdir(parents=True, exist_ok=True)
            elif path.is_file() or path.is_symlink():
                (left / rel).parent.mkdir(parents=True, exist_ok=True)
                if path.is_symlink():
                    os.symlink(os.readlink(path), left / rel)
                else:
                    os.link(path, left / rel)
        env = [arg for k, v in emulation_env(arm).items() for arg in ("--env", f"{k}={v}")]
        image = entry["platforms"]["linux/arm64"]["config_digest"]
        started = time.perf_counter()
        done = subprocess.run([services.DOCKER, "run", "--rm", "--network=none", "--platform",
                               "linux/arm64", "--volume", f"{cpuinfo}:/proc/cpuinfo:ro",
                               "--volume", f"{left}:/opt/venv/lib/python3.11/site-packages:ro",
                               *env, image, "bash", "-lc", f'python3 -c "{STEP}"'],
                              capture_output=True, text=True, timeout=1800)
        took = time.perf_counter() - started
    saved = sum(sizes[d] for d in spare)
    verdict = "imports torch and trains a step" if done.returncode == 0 else "FAILS"
    said = done.stdout.strip() or done.stderr.strip()[-400:]
    print(f"  without {', '.join(spare)}: {verdict} under emulation in {took:.0f} s "
          f"({said})", file=sys.stderr)
    print(f"  a CPU-only image could leave out {', '.join(spare)}: {saved / 1e9:.2f} of the "
          f"{sum(sizes[d] for d in cuda) / 1e9:.2f} GB of CUDA wheels", file=sys.stderr)


def report(times: dict[str, dict[str, list[float]]], found: dict[str, dict[str, float]],
           repeat: int) -> None:
    print(f"\ninstall of bert's packages (median of {repeat})", file=sys.stderr)
    for platform in PLATFORMS:
        host, emu = times["host pip"][platform], times["emulated pip"][platform]
        line = f"  {platform:<12} host pip {statistics.median(host):7.1f} s"
        if emu:
            line += (f"   pip in the image's build {statistics.median(emu):7.1f} s   "
                     f"{statistics.median(emu) / statistics.median(host):5.2f}x")
        print(line, file=sys.stderr)
    print("\nimages imgpipe.lock pins for bert/cpu", file=sys.stderr)
    for platform, got in found.items():
        print(f"  {platform:<12} {got['bytes'] / 1e9:5.2f} GB in {got['layers']:.0f} layers, "
              f"pushed {got['pushed'] / 1e9:5.2f} GB, squashfs {got['squashfs'] / 1e9:5.2f} GB",
              file=sys.stderr)
    arm, amd = found["linux/arm64"], found["linux/amd64"]
    print(f"  arm64 / amd64: bytes {arm['bytes'] / amd['bytes']:.2f}x, pushed "
          f"{arm['pushed'] / amd['pushed']:.2f}x, squashfs "
          f"{arm['squashfs'] / max(amd['squashfs'], 1):.2f}x", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--skip-emulated", action="store_true",
                        help="only the host-pip installs (the emulated one takes long)")
    parser.add_argument("--leave-out-only", action="store_true",
                        help="only part 3: the CUDA wheels a CPU-only image could leave out")
    args = parser.parse_args()
    with services.docker_engine():
        if not args.leave_out_only:
            measured = install_both_ways(args.repeat, not args.skip_emulated)
            report(measured, sizes(), args.repeat)
        leave_out()
