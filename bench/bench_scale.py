"""How conversion cost grows with the image: 0.26 to 15 GB, beside Enroot's way, one run.

Images come from ``bench/ngc_image.py`` (NGC-shaped, from a seed, the same bytes on every
machine), pushed to a registry this bench starts.  At each size, each in a process of its
own, measured from outside (wall and CPU seconds, peak RSS of the whole process tree,
peak bytes in ``/dev/shm`` and in the temporary folder, squashfs size):

- imgpipe cold: ``imgpipe convert`` into an empty cache (blobs fetched);
- imgpipe warm: the blobs cached, the squashfs removed;
- Enroot's way, fed from the same registry (no engine holds these images): fetch every
  blob (10 connections, as ``ENROOT_MAX_CONNECTIONS``), ``pigz -dc | tar -x`` each layer in
  order into one tree with its whiteouts applied, then ``mksquashfs -all-root
  -processors N -comp lzo -noD``, Enroot's defaults.

Before each measured run the disk's dirty pages are written back (``sync``) and every layer
blob is read once through the registry's API and dropped: the registry stands for a head node
that serves many nodes from its page cache, and on one machine whatever ran just before
would otherwise decide how much of the registry's data each run reads from disk.

Prints a table (seconds per GB, ratios) and writes ``scale.json`` and ``scale.png``.

    .venv/bin/python bench/bench_scale.py --sizes 0.26G,1.2G,5G,15G [--out build/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ngc_image  # noqa: E402

from imgpipe.base.units import parse_size  # noqa: E402
from tests import services  # noqa: E402

SHM = Path("/dev/shm")
OPAQUE = ".wh..wh..opq"  # left as a marker: a timing approximation (lower files stay)
# Sizes as bench/ngc_image.py reads them (G = GiB), so `--size 15G` there is 15G here.
LAYERS = {0.26 * 2**30: 8, 1.2 * 2**30: 12, 5 * 2**30: 40, 15 * 2**30: 44}


def layers_for(size: int) -> int:
    return next((n for limit, n in sorted(LAYERS.items()) if size <= limit * 1.05), 44)


class Watch:
    """Samples a process tree: the sum of its RSS, the bytes under ``tmp``, /dev/shm's use."""

    def __init__(self, pid: int, tmp: Path) -> None:
        self.pid, self.tmp = pid, tmp
        self.rss = self.tmp_bytes = self.shm_bytes = 0
        self.shm_start = _shm_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_du = 0.0
        while not self._stop.is_set():
            self.rss = max(self.rss, _tree_rss(self.pid))
            self.shm_bytes = max(self.shm_bytes, _shm_used() - self.shm_start)
            if time.monotonic() - last_du > 2.0:  # du of a big tree costs: every 2 s
                self.tmp_bytes = max(self.tmp_bytes, _du(self.tmp))
                last_du = time.monotonic()
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _shm_used() -> int:
    usage = shutil.disk_usage(SHM)
    return usage.used


def _du(path: Path) -> int:
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
    try:
        return int(done.stdout.split()[0])
    except (IndexError, ValueError):
        return 0


def _tree_rss(root: int) -> int:
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            pid = int(entry.name)
            children.setdefault(int(stat[1]), []).append(pid)
            rss[pid] = int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def measured(argv: list[str], tmp: Path, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``argv``; wall and CPU seconds, peak tree RSS, peak tmp and /dev/shm bytes."""
    before = os.times()
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watch = Watch(proc.pid, tmp)
    out, err = proc.communicate()
    watch.stop()
    wall = time.monotonic() - started
    after = os.times()
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(argv)} exited {proc.returncode}: "
                         f"{err.decode(errors='replace')[-2000:]}")
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system)
    return {"wall": wall, "cpu": cpu, "rss": watch.rss, "tmp": watch.tmp_bytes,
            "shm": watch.shm_bytes, "stdout": out.decode(errors="replace")}  # type: ignore[dict-item]


def warm_registry(ref: str) -> None:
    """``sync``, then read every blob of ``ref`` through the registry API once (dropped)."""
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.reference import Reference

    subprocess.run(["sync"], check=True)
    parsed = Reference.parse(ref)
    client = RegistryClient(f"http://{parsed.registry}")
    manifest = client.manifest(parsed.repository, parsed.reference)
    session = requests.Session()
    session.trust_env = False
    for layer in manifest.layers:
        url = f"http://{parsed.registry}/v2/{parsed.repository}/blobs/{layer['digest']}"
        with session.get(url, stream=True, timeout=60) as reply:
            reply.raise_for_status()
            for _ in reply.iter_content(4 << 20):
                pass


def imgpipe_convert(ref: str, project: Path, tmp: Path) -> dict[str, float]:
    imgpipe = str(Path(sys.executable).parent / "imgpipe")
    result = measured([imgpipe, "convert", ref, "--json"], tmp, cwd=project,
                      env={"TMPDIR": str(tmp)})
    data = json.loads(str(result.pop("stdout")))["data"]
    result["size"] = data["size"]
    result["path"] = data["squashfs"]  # type: ignore[assignment]
    return result


def enroot_way(ref: str, work: Path, tmp: Path) -> dict[str, float]:
    result = measured([sys.executable, __file__, "--enroot-way", ref, "--work", str(work)],
                      tmp)
    result["size"] = json.loads(str(result.pop("stdout")))["size"]
    return result


def run_enroot_way(ref: str, work: Path) -> int:
    """Fetch, unpack layer by layer with whiteouts, mksquashfs lzo -noD: the squashfs size."""
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.fetch.blobs import fetch_image
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.reference import Reference

    parsed = Reference.parse(ref)
    client = RegistryClient(f"http://{parsed.registry}")
    digest = client.manifest(parsed.repository, parsed.reference).digest
    fetched = fetch_image(client, Storage(work / "blobs"), parsed.repository, digest,
                          connections=10)
    tree = work / "rootfs"
    tree.mkdir()
    unzip = shutil.which("pigz") or "gzip"
    for blob in fetched.layers:
        layer = subprocess.Popen([unzip, "-dc", str(blob.path)], stdout=subprocess.PIPE)
        listing = subprocess.run(["tar", "-x", "-v", "-C", str(tree), "--no-same-owner"],
                                 stdin=layer.stdout, capture_output=True, text=True, check=True)
        layer.wait()
        for name in listing.stdout.splitlines():  # whiteouts, as Enroot's aufs2ovlfs does
            base = os.path.basename(name.rstrip("/"))
            if base == OPAQUE or not base.startswith(".wh."):
                continue
            marker = tree / name
            target = marker.with_name(base[len(".wh."):])
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else (
                target.unlink(missing_ok=True))
            marker.unlink(missing_ok=True)
    output = work / "enroot.sqsh"
    subprocess.run(["mksquashfs", str(tree), str(output), "-all-root", "-processors",
                    str(os.cpu_count()), "-comp", "lzo", "-noD", "-noappend", "-quiet",
                    "-no-progress"], check=True, capture_output=True)
    return output.stat().st_size


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["gb"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("cold", "imgpipe cold"), ("warm", "imgpipe warm (blobs cached)"),
                       ("enroot", "Enroot's way (lzo -noD)")):
        left.plot(sizes, [r[key]["wall"] / r["gb"] for r in rows], marker="o", label=label)
        right.plot(sizes, [r[key]["rss"] / 2**20 for r in rows], marker="o", label=label)
    left.set(xscale="log", xlabel="unpacked size (GB)", ylabel="seconds per GB",
             title="conversion time per GB")
    right.set(xscale="log", xlabel="unpacked size (GB)", ylabel="MiB",
              title="peak RSS (whole process tree)")
    right.axhline(1024, color="grey", linestyle=":", label="1 GiB goal")
    for axis in (left, right):
        axis.set_xticks(sizes, [f"{size:.2g}" for size in sizes])
        axis.minorticks_off()
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(sizes: list[int], out: Path, seed: int, port: int | None = None) -> None:
    """Each size in turn; with ``port``, layers already pushed there (``bench/ngc_image.py``'s
    state file under ``out``) are not generated again."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="imgpipe-scale-", dir=out) as scratch:
        work = Path(scratch)
        registry = (services.RegistryProcess(work, port, None)  # type: ignore[arg-type]
                    if port else services.start_registry(work / "registry"))
        try:
            for size in sizes:
                state = out / "ngc-image.json" if port else work / "ngc-state.json"
                rows.append(one_size(size, registry, work, seed, state))
                (out / "scale.json").write_text(json.dumps(rows, indent=1))
        finally:
            if not port:
                registry.stop()
    plot(rows, out / "scale.png")
    print(f"\n{'size':>8} {'files':>8} {'layers':>6} | {'cold s/GB':>9} {'warm s/GB':>9} "
          f"{'enroot s/GB':>11} | {'cold/enroot':>11} | {'RSS cold':>9} {'tmp':>9} "
          f"{'shm':>9} | {'sqsh MB':>8} {'lzo MB':>8}")
    for r in rows:
        print(f"{r['gb']:7.2f}G {r['files']:8d} {r['layers']:6d} | "
              f"{r['cold']['wall'] / r['gb']:9.1f} {r['warm']['wall'] / r['gb']:9.1f} "
              f"{r['enroot']['wall'] / r['gb']:11.1f} | "
              f"{r['cold']['wall'] / r['enroot']['wall']:11.2f} | "
              f"{r['cold']['rss'] / 2**20:8.0f}M {r['cold']['tmp'] / 2**20:8.0f}M "
              f"{r['cold']['shm'] / 2**20:8.0f}M | {r['cold']['size'] / 1e6:8.0f} "
              f"{r['enroot']['size'] / 1e6:8.0f}")
    from_1gb = [r for r in rows if r["gb"] >= 1.0]
    for key in ("cold", "warm"):
        flat = [r[key]["wall"] / r["gb"] for r in from_1gb]
        if len(flat) > 1:
            print(f"{key} seconds per GB from {from_1gb[0]['gb']:.2f} GB up: max/min "
                  f"{max(flat) / min(flat):.2f} (goal <= 1.20)")
    print(f"table and plot: {out / 'scale.json'}, {out / 'scale.png'}")


def one_size(size: int, registry: services.RegistryProcess, work: Path, seed: int,
             state: Path) -> dict:
    tag = f"{size / 2**30:.2f}gib"
    say = lambda text: print(f"  {text}", file=sys.stderr, flush=True)  # noqa: E731
    print(f"{size / 1e9:.2f} GB: generating", file=sys.stderr, flush=True)
    made = ngc_image.generate(registry.address, "scale/ngc", tag, size, layers_for(size), seed,
                              state, say=say)
    ref = str(made["reference"])
    project, tmp = work / "project", work / "tmp"
    for folder in (project, tmp):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    (project / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": registry.port}, "outputs": {"squashfs_dir": str(work / "sqsh")}}))
    shutil.rmtree(work / "sqsh", ignore_errors=True)
    warm_registry(ref)
    cold = imgpipe_convert(ref, project, tmp)
    say(f"imgpipe cold {cold['wall']:.1f} s")
    Path(str(cold.pop("path"))).unlink()
    warm_registry(ref)
    warm = imgpipe_convert(ref, project, tmp)
    say(f"imgpipe warm {warm['wall']:.1f} s")
    Path(str(warm.pop("path"))).unlink()
    shutil.rmtree(work / "sqsh", ignore_errors=True)
    enroot_work = work / "enroot"
    shutil.rmtree(enroot_work, ignore_errors=True)
    enroot_work.mkdir()
    warm_registry(ref)
    enroot = enroot_way(ref, enroot_work, enroot_work)
    shutil.rmtree(enroot_work, ignore_errors=True)
    say(f"Enroot's way {enroot['wall']:.1f} s")
    return {"gb": int(made["unpacked"]) / 1e9, "files": made["files"], "layers": made["layers"],
            "digest": made["digest"], "cold": cold, "warm": warm, "enroot": enroot}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.26G,1.2G,5G,15G")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    parser.add_argument("--port", type=int, default=None,
                        help="use the plain-HTTP registry on 127.0.0.1:PORT (e.g. `imgpipe "
                        "registry up`'s) instead of starting one: its images stay after")
    parser.add_argument("--warm-registry", metavar="REF",
                        help="only `sync` and read every blob of REF through the registry, as "
                        "before each measured run (for runs by hand, e.g. `enroot import`)")
    parser.add_argument("--enroot-way", metavar="REF", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm_registry:
        warm_registry(args.warm_registry)
        return 0
    if args.enroot_way:
        print(json.dumps({"size": run_enroot_way(args.enroot_way, args.work)}))
        return 0
    run([parse_size(text) for text in args.sizes.split(",")], args.out,
        args.seed, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
