"""One image onto N nodes with node-local caches: what the registry serves and how long until
every node's first task runs, for each way the recipes can get it there, in one run.

On the sandbox cluster (hosts as network namespaces, each compute host with its own
/var/tmp), the head's registry behind a link limited with tc (``--registry-rate``, 1 Gbit/s
by default, so that what it serves shows in time), one job of N nodes per mode, each
started cold (every node's cache emptied, the blob cache emptied):

  fetch         enroot.distribution: fetch: every node's importer fetches for itself
  sbcast        the batch host fetches once, Slurm's sbcast copies it, every node checks it
  broadcast     one srun --mpi=pmix step: the batch host's ranged fetch streamed to every
                node as it checks each chunk (a chain of 256 KiB MPI messages along the
                nodes, a window in flight on each link), every node writing and hashing as
                it receives
  tier          every node fetches through the blob cache (nginx) on a rack host of its own
  sbcast+tier   the batch host fetches through the blob cache, then sbcast

The job is what the recipes render (the runtime's functions and stage_image, Charliecloud),
then one step of one task per node that prints the time it starts.  Measured per job: the
seconds from the batch script's start until the last node's first task starts, and the bytes
the registry's access log says it served (every blob GET: 200 or 206).  Each mode's time is
also given as a ratio to ``fetch`` at the same N and to one node.  Beside it, the CPU time
spent: the importer's tasks' own (user + system, every host; bash's ``times`` around each)
and the whole machine's (/proc/stat over the job: every host is on it, so with the cores'
count it says whether cores or links set the pace).  The broadcast's rows also give its
stages (the batch host's line of stage times, IMGPIPE_BROADCAST_STAGES): every task's MPI
start, the batch host's first checked chunk and whole fetch, the first byte at the last
node, the last unit's arrival, the final checks, and the seconds each hop adds.

``--node-rate RATE`` shapes every compute host's link (eth0's egress, in its namespace) with
the same token bucket the sandbox gives the head (``--registry-rate``), so that links, not
the machine's cores, set the pace.

Images: bert's squashfs (``--squashfs``, default: the newest bert conversion in
build/squashfs, from ``./setup.sh demo`` or ``imgpipe convert bert``) and a generated one of
``--generated`` bytes (random, so incompressible), both published in the bench's registry
as squashfs artifacts beside a small image, pinned by digest.  The generated one runs at 8
nodes only, fetch and sbcast, on disk-backed node folders (it does not fit in memory 8 times).

Needs root (network namespaces), slurm-wlm, munge, charliecloud, squashfs-tools, nginx-light,
and for broadcast openmpi-bin, python3-mpi4py, libpmix-dev.
Writes fanout.json and fanout.png under --out.

    .venv/bin/python bench/bench_fanout.py --nodes 8,16,32 [--generated 6G] [--out bench/results]
    .venv/bin/python bench/bench_fanout.py --nodes 8,16,32 --modes fetch,sbcast,broadcast \
        --generated 0 --no-variants
    .venv/bin/python bench/bench_fanout.py --nodes 8,16 --modes fetch,sbcast,broadcast \
        --generated 0 --no-variants --registry-rate 200mbit --node-rate 200mbit
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fanout_accounting import (  # noqa: E402  (bench/, on the path above)
    machine_cpu,
    machine_cpu_since,
    sbcast_timer,
    stage_times,
    task_cpu_s,
    timed_importer,
)
from fanout_report import MODES, report, stages_text  # noqa: E402

from imgpipe.base.units import parse_size  # noqa: E402
from imgpipe.enroot.published.artifact import publish  # noqa: E402
from imgpipe.enroot.published.pins import PINS_ENV  # noqa: E402
from imgpipe.recipes.runtimes import prelude  # noqa: E402
from imgpipe.recipes.sandbox import Sandbox, SandboxSpec, running  # noqa: E402
from imgpipe.recipes.staging import stage_function  # noqa: E402
from imgpipe.registry.client import RegistryClient  # noqa: E402
from tests import services  # noqa: E402
from tests.cluster import system_imgpipe  # noqa: E402
from tests.published_image import sha256_file  # noqa: E402

NODE_CACHE = "/var/tmp/imgpipe-bench"
TIER_PORT = 5080
# at the largest N: sbcast's block size and tree width
VARIANTS = ("sbcast-64M", "sbcast-fanout2", "sbcast-fanout4")


def squashfs_of_bert() -> Path:
    found = sorted((ROOT / "build" / "squashfs").glob("imgpipe+bert+sha256-*.sqsh"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit("bench_fanout: no bert squashfs in build/squashfs: run ./setup.sh demo (or "
                 "imgpipe convert bert), or pass --squashfs")
    return found[-1]


def generated_squashfs(size: int, folder: Path) -> Path:
    """A squashfs of ``size`` random bytes (one file: nothing to compress)."""
    source = folder / "generated-src"
    source.mkdir()
    with open(source / "random.bin", "wb") as out:
        left = size
        while left:
            block = os.urandom(min(left, 64 << 20))
            out.write(block)
            left -= len(block)
    target = folder / "generated.sqsh"
    subprocess.run(["mksquashfs", str(source), str(target), "-noappend", "-all-root",
                    "-noI", "-noD", "-noF", "-noX", "-quiet"], check=True)
    shutil.rmtree(source)
    return target


def publish_image(client: RegistryClient, url: str, repository: str, squashfs: Path) -> dict:
    """A small image with ``squashfs`` published beside it: its digest and the pin."""
    layer = services.tar_layer({"etc/os-release": b"ID=bench\n", "srv/which":
                                repository.encode()})
    digest = services.push_image(services.plain_session(), url, repository, "1", [layer])
    blob = sha256_file(squashfs)
    publish(client, repository, client.manifest(repository, digest), squashfs, blob, "zstd", 1)
    return {"repository": repository, "digest": digest, "pin": blob,
            "bytes": squashfs.stat().st_size}


def limit_nodes(cluster: Sandbox, rate: str) -> None:
    """Every compute host's link: the token bucket the sandbox gives the head
    (recipes.sandbox ``_limit_head``), on eth0's egress inside the host's namespace."""
    burst = "4mb" if rate.endswith("gbit") else "512kb"
    for host in cluster.spec.nodes:
        done = subprocess.run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace",
                               "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
                               "latency", "200ms"], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_fanout: tc could not limit {host.name}'s link to {rate}: "
                     f"{done.stderr.strip()}")


def job_script(folder: Path, importer: str, mode: str, uri: str) -> Path:
    distribution = ("fetch" if mode in ("fetch", "tier") else
                    "broadcast" if mode == "broadcast" else "sbcast")
    block = "64M" if mode == "sbcast-64M" else "8M"
    fanout = int(mode.rsplit("fanout", 1)[1]) if "fanout" in mode else 8
    text = "\n".join([
        "#!/bin/bash", "set -euo pipefail", f"CONT={uri}",
        f"export IMGPIPE_SBCAST={sbcast_timer(folder)}",
        'echo "start $(date +%s.%N)"',
        prelude("charliecloud"), stage_function("charliecloud", distribution, importer,
                                                fanout, block),
        'echo "staged $(date +%s.%N)"',
        'srun --ntasks-per-node=1 /bin/sh -c \'echo "first $(hostname) $(date +%s.%N)"\'', ""])
    path = folder / f"job-{mode}.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path


def node_config(folder: Path, tier: str | None, importer: str) -> Path:
    config = folder / ("nodes-tier.yaml" if tier else "nodes.yaml")
    registry: dict[str, object] = {"host": "head", "port": 5000}
    if tier:
        registry["blob_cache"] = tier
    config.write_text(json.dumps({"registry": registry,
                                  "outputs": {"squashfs_dir": NODE_CACHE},
                                  "enroot": {"importer_path": importer}}))
    config.chmod(0o644)
    return config


class Tier:
    """`imgpipe registry cache up` on the rack host (the last compute host)."""

    def __init__(self, cluster: Sandbox, folder: Path) -> None:
        self.cluster, self.host = cluster, cluster.spec.nodes[-1]
        self.state = folder / "tier"
        self.config = folder / "tier.yaml"
        self.config.write_text(json.dumps({"registry": {
            "host": "head", "port": 5000, "cache_server": {
                "bind": self.host.address, "port": TIER_PORT, "state_dir": str(self.state),
                "max_size": "40G"}}}))
        self.url = f"http://{self.host.name}:{TIER_PORT}"

    def _cli(self, *args: str) -> None:
        argv = ["ip", "netns", "exec", self.host.namespace, str(ROOT / ".venv/bin/imgpipe"),
                "--config", str(self.config), "registry", "cache", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            sys.exit(f"bench_fanout: registry cache {args[0]}: {done.stderr.strip()}")

    def limit(self, rate: str) -> None:
        """The rack host's own NIC: the same rate as the head's (a tier serves N copies)."""
        subprocess.run(["ip", "netns", "exec", self.host.namespace, "tc", "qdisc", "replace",
                        "dev", "eth0", "root", "tbf", "rate", rate, "burst", "4mb", "latency",
                        "200ms"], check=True, capture_output=True)

    def fresh(self) -> None:
        self._cli("down")
        shutil.rmtree(self.state, ignore_errors=True)
        self.state.mkdir(parents=True)
        self.state.chmod(0o755)
        self._cli("up")

    def down(self) -> None:
        self._cli("down")


def empty_caches(cluster: Sandbox, nodes: int) -> None:
    done = cluster.run(["srun", f"-N{nodes}", "-w", f"node[1-{nodes}]", "--ntasks-per-node=1",
                        "/bin/sh", "-c", f"rm -rf {NODE_CACHE}/* {NODE_CACHE}/.imgpipe/tmp/*"],
                       timeout=300)
    if done.returncode != 0:
        sys.exit(f"bench_fanout: emptying the node caches: {done.stderr.strip()}")


def make_caches(cluster: Sandbox, nodes: int, imgpipe: str) -> None:
    done = cluster.run(["srun", f"-N{nodes}", "-w", f"node[1-{nodes}]", "--ntasks-per-node=1",
                        imgpipe, "node-config", "--make-cache", NODE_CACHE], timeout=300)
    if done.returncode != 0:
        sys.exit(f"bench_fanout: node-config --make-cache: {done.stderr.strip()}")


def run_job(cluster: Sandbox, folder: Path, script: Path, nodes: int, config: Path,
            image: dict) -> dict:
    since = cluster.registry_log_size()
    out = folder / f"out-{time.monotonic_ns()}.txt"
    cpu = machine_cpu()
    done = cluster.run(["sbatch", "--wait", "-o", str(out), f"-N{nodes}", "-w",
                        f"node[1-{nodes}]", str(script)], timeout=3600,
                       env={"IMGPIPE_CONFIG": str(config),
                            PINS_ENV: f"{image['digest']}={image['pin']}",
                            "IMGPIPE_BROADCAST_STAGES": "1",
                            "PATH": os.environ["PATH"]})
    spent = machine_cpu_since(cpu)
    text = out.read_text() if out.exists() else ""
    if done.returncode != 0:  # said and kept in the results; the other runs go on
        print(f"bench_fanout: the job failed:\n{text}{done.stderr}", flush=True)
        return {"error": (text + done.stderr).strip().splitlines()[-1:]}
    start = float(re.search(r"^start ([0-9.]+)$", text, re.M).group(1))  # type: ignore[union-attr]
    firsts = [float(t) for t in re.findall(r"^first node\d+ ([0-9.]+)$", text, re.M)]
    if len(firsts) != nodes:
        print(f"bench_fanout: {len(firsts)} of {nodes} nodes ran:\n{text}", flush=True)
        return {"error": [f"{len(firsts)} of {nodes} nodes ran"]}
    time.sleep(1)  # the registry logs a request once its client has the bytes
    log = cluster.registry_log.read_bytes()[since:].decode(errors="replace")
    served = sum(int(n) for n in re.findall(
        r'"GET /v2/[^ ]+/blobs/sha256:[0-9a-f]{64} HTTP/[0-9.]+" 20[06] ([0-9]+)', log))
    fetched_here = len(re.findall(r"fetching it from the registry|distribution: fetch|"
                                  r"refused the broadcast copy", text))
    row = {"seconds": round(max(firsts) - start, 2), "registry_bytes": served,
           "copies_served": round(served / image["bytes"], 2), "node_fetches": fetched_here,
           "checks_s": [float(x) for x in re.findall(r"checked in ([0-9.]+) s", text)],
           "task_cpu_s": task_cpu_s(text), **spent}
    stages = stage_times(text, start)
    if stages is not None:
        row["stages"] = stages
    marks = {m[0]: float(m[1]) for m in re.findall(r"^(sbcast-start|sbcast-end) ([0-9.]+)$",
                                                    text, re.M)}
    staged = re.search(r"^staged ([0-9.]+)$", text, re.M)
    if staged:  # stage_image, then the nodes' first tasks
        row["stage_s"] = round(float(staged.group(1)) - start, 2)
        row["after_stage_s"] = round(max(firsts) - float(staged.group(1)), 2)
    sent = re.search(r": broadcast sha256:\S+ \(([^)]*)\)[^:]* in ([0-9.]+) s: (\d+) node", text)
    if sent:  # the batch host's task in the broadcast step: its fetch, sending, the gather
        row["broadcast_root_s"], row["broadcast_took"] = float(sent.group(2)), int(sent.group(3))
        row["fell_back"] = "staging with sbcast" in text
    if "broadcast" in text and (not sent or "staging with sbcast" in text):
        # the broadcast step ended without sending: what its tasks said is the reason
        row["broadcast_said"] = [line for line in text.splitlines() if re.search(
            r"broadcast|MPI|mpi|Fatal|Segmentation|error|sbcast", line)][-12:]
    if len(marks) == 2:  # the batch host's fetch, then sbcast, then the nodes' checks
        row["batch_fetch_s"] = round(marks["sbcast-start"] - start, 2)
        row["sbcast_s"] = round(marks["sbcast-end"] - marks["sbcast-start"], 2)
        row["after_sbcast_s"] = round(max(firsts) - marks["sbcast-end"], 2)
    return row


def measure(cluster: Sandbox, folder: Path, image: dict, nodes: int, modes: tuple[str, ...],
            importer: str, tier: Tier, results: dict[str, dict], save: Callable[[], None]
            ) -> None:
    uri = f"head:5000#{image['repository']}@{image['digest']}"
    plain, via_tier = node_config(folder, None, importer), node_config(folder, tier.url, importer)
    for mode in modes:
        # every job host's cache, not only this job's: the disk holds N copies of one image
        empty_caches(cluster, cluster.spec.compute_nodes - 1)
        if "tier" in mode:
            tier.fresh()
        script = job_script(folder, importer, mode, uri)
        row = run_job(cluster, folder, script, nodes, via_tier if "tier" in mode else plain,
                      image)
        results[mode] = row
        save()
        if "error" in row:
            continue
        print(f"  {image['repository']:16} N={nodes:<3} {mode:12} {row['seconds']:7.1f} s  "
              f"registry served {row['registry_bytes'] / 1e9:6.2f} GB "
              f"({row['copies_served']} copies)"
              + (f"; batch fetch {row['batch_fetch_s']} s, sbcast {row['sbcast_s']} s, "
                 f"checks and start {row['after_sbcast_s']} s" if "sbcast_s" in row else "")
              + (f"; broadcast step {row['stage_s']} s (batch host's task "
                 f"{row['broadcast_root_s']} s), start {row['after_stage_s']} s"
                 if "broadcast_root_s" in row else "")
              + f"; CPU: tasks {row['task_cpu_s']} s, machine {row['machine_cpu_s']} s "
              f"({100 * row['machine_busy']:.0f}% of {row['cores']} cores, iowait "
              f"{row['machine_iowait_s']} s)"
              + (f"\n    stages (s since the job's start): {stages_text(row['stages'])}"
                 if "stages" in row else ""),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="8,16,32")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--squashfs", type=Path, default=None)
    parser.add_argument("--generated", default="6G", help="0: skip the generated image")
    parser.add_argument("--registry-rate", default="1gbit")
    parser.add_argument("--node-rate", default=None, metavar="RATE",
                        help="shape every compute host's link like the registry's (tc's "
                        "rate: 200mbit, 1gbit); default: unshaped")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--no-variants", action="store_true",
                        help="no sbcast block and tree-width variants at the largest N")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.nodes.split(",")} | {1})
    modes = tuple(m for m in args.modes.split(",") if m)
    if os.geteuid() != 0:
        sys.exit("bench_fanout: run it as root (the sandbox makes network namespaces)")
    bert = args.squashfs or squashfs_of_bert()
    # /tmp: every host sees it (each host's /var/tmp is its own node folder under it)
    work = Path(tempfile.mkdtemp(prefix="imgpipe-fanout-bench-", dir="/tmp"))
    work.chmod(0o755)
    # the nodes' importer as node-config installs it: a venv of the system Python (the one
    # Debian's mpi4py is built for), its modules compiled
    importer = str(system_imgpipe(ROOT) / "imgpipe-pyxis-importer")
    imgpipe = str(ROOT / ".venv" / "bin" / "imgpipe")
    results: dict = {"registry_rate": args.registry_rate, "node_rate": args.node_rate,
                     "cores": os.cpu_count(), "bert": {}, "generated": {}}
    try:
        registry = services.start_registry(work / "registry")
        client = RegistryClient(registry.url, allow_http=True)
        images = {"bert": publish_image(client, registry.url, "bench/bert", bert)}
        size = parse_size(args.generated)
        if size:
            images["generated"] = publish_image(client, registry.url, "bench/generated",
                                                generated_squashfs(size, work))
            (work / "generated.sqsh").unlink()
        registry.stop()
        results["images"] = images
        spec = SandboxSpec(work / "sandbox", name="imgfo", subnet="10.213.17",
                           compute_nodes=max(counts) + 1, cpus=2, gpus=0,
                           registry_rate=args.registry_rate, node_scratch=str(work / "nodes"))
        with running(spec, registry_storage=registry.root / "data") as cluster:
            make_caches(cluster, max(counts), imgpipe)
            if args.node_rate:
                limit_nodes(cluster, args.node_rate)
            tier = Tier(cluster, work)
            tier.limit(args.registry_rate)
            timed = str(timed_importer(work, importer))
            def save() -> None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "fanout.json").write_text(json.dumps(results, indent=2) + "\n")

            try:
                for nodes in counts:
                    chosen = ("sbcast",) if nodes == 1 else modes + (
                        VARIANTS if nodes == max(counts) and not args.no_variants else ())
                    measure(cluster, work, images["bert"], nodes, chosen, timed, tier,
                            results["bert"].setdefault(str(nodes), {}), save)
                if size:
                    measure(cluster, work, images["generated"], 8,
                            tuple(m for m in modes if "tier" not in m), timed, tier,
                            results["generated"].setdefault("8", {}), save)
            finally:
                tier.down()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, counts, args.out)


if __name__ == "__main__":
    main()
