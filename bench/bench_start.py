"""Eight nodes starting from one digest nobody has converted, through the Pyxis importer.

On the sandbox (a head host running slurmctld and a registry, N compute hosts, each a
network namespace), as a non-root user, with one squashfs folder every node shares: every
task runs ``imgpipe-pyxis-importer get docker://head:5000#REPO@DIGEST`` (what Pyxis runs),
then starts a program inside the squashfs with ``ch-run`` (Charliecloud stands in for
Enroot here), and writes the second it started.  Three starts per image, each on an empty
cache:

- ``1 node``: one job of one task (the cold start every other figure is compared with);
- ``NxN1 job``: one job of N nodes x 1 task (``sbatch -N8 --ntasks-per-node=1``);
- ``N jobs``: N one-node jobs submitted together.

For each: seconds from submission until the last task ran, that against the one-node
start (goal: <= 1.3x), how many tasks converted (goal: exactly one; the importer's stderr
says "squash with"), and that every task ran.  Images: ``bert`` (pushed from the engine)
and sizes made by bench/ngc_image.py (the same seed as bench_scale.py).

With ``--published``, each image's squashfs is first converted once here and published
beside it (``imgpipe push --squashfs`` does the same), and a fourth start comes first: one
node converting (no pin, the published file not trusted), against which one node fetching
the pinned published file is compared (goal at 15 GB: <= 0.2x); the eight-node starts then
fetch it (goal: one fetch, within 1.3x of one node fetching).

With ``--pyxis``, the jobs run ``srun --container-image=...`` through Pyxis (its plugstack
naming imgpipe's importer, squashfuse mode) and Enroot, both built by hand outside this
repository.  Enroot runs ``/etc/rc`` with ``/bin/sh``, so the generated image then gets one
more layer: this host's /bin/sh and the two libraries it loads.

    .venv/bin/python bench/bench_start.py                      # bert and 5G on 8 nodes
    .venv/bin/python bench/bench_start.py --images bert --nodes 4
    .venv/bin/python bench/bench_start.py --images bert,5G,15G --published
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ngc_image  # noqa: E402

from imgpipe.base.units import parse_size  # noqa: E402
from imgpipe.recipes.sandbox import Sandbox, SandboxSpec, running  # noqa: E402
from tests import services  # noqa: E402
from tests.cluster import (  # noqa: E402
    USERS,
    ensure_users,
    prepare_node_devices,
    shared_folder,
    system_imgpipe,
)

MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
USER = USERS[0]

TASK = """#!/bin/sh
# One task: the image's squashfs from the importer (as Pyxis gets it), then a program in it.
set -eu
out="$RESULTS/$SLURM_JOB_ID.$SLURM_PROCID.$(hostname)"
path=$("$IMPORTER" get "$URI" 2>"$out.err")
ch-run "$path" -- "$PROGRAM" 2>"$out.run"
date +%s.%N >"$out.ran"
"$IMPORTER" release
"""

# With --pyxis: the batch script runs the step in a container as users do; srun returns
# once every task's container ran the program, and each of the job's hosts is recorded.
PYXIS_JOB = """#!/bin/sh
set -eu
srun --container-image="${URI#docker://}" --no-container-remap-root "$PROGRAM" \\
    2>"$RESULTS/$SLURM_JOB_ID.run"
now=$(date +%s.%N)
for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    echo "$now" >"$RESULTS/$SLURM_JOB_ID.0.$host.ran"
done
"""

# What Pyxis runs as its importer (plugstack importer=): imgpipe's, stderr kept.
PYXIS_IMPORTER = """#!/bin/sh
if [ "$1" = get ]; then
    exec "$IMPORTER" "$@" 2>>"$RESULTS/$SLURM_JOB_ID.$SLURM_STEP_ID.$(hostname).$$.err"
fi
exec "$IMPORTER" "$@"
"""


def bert_source() -> str:
    """The newest bert cpu image the engine holds (the demo and the tests build one)."""
    listed = subprocess.run(
        [services.DOCKER, "images", "--format", "{{.Repository}}:{{.Tag}}\t{{.CreatedAt}}"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    found = sorted((line.split("\t")[1], line.split("\t")[0]) for line in listed
                   if "imgpipe/bert:" in line and line.split("\t")[0].endswith("-cpu"))
    if not found:
        raise SystemExit("error: the engine holds no imgpipe/bert cpu image: run "
                         "`./setup.sh demo` (or imgpipe build bert --flavor cpu) first")
    return found[-1][1]


def put_image(registry: services.RegistryProcess, name: str, state: Path,
              shell: bool) -> tuple[str, str]:
    """(repository, manifest digest) of ``name`` in the bench's registry."""
    if name == "bert":
        target = f"{registry.address}/bench/bert:start"
        for argv in (["tag", bert_source(), target], ["push", target]):
            subprocess.run([services.DOCKER, *argv], check=True, capture_output=True,
                           timeout=1800)
        reply = requests.head(f"http://{registry.address}/v2/bench/bert/manifests/start",
                              headers={"Accept": MANIFEST_ACCEPT}, timeout=30)
        return "bench/bert", reply.headers["Docker-Content-Digest"]
    made = ngc_image.generate(registry.address, "scale/ngc", name.lower(), parse_size(name),
                              40 if parse_size(name) > 2 << 30 else 12, 2026, state,
                              say=lambda text: print(f"  {text}", flush=True),
                              extra=[ngc_image.host_shell()] if shell else None)
    return "scale/ngc", str(made["digest"])


def empty_cache(cache: Path) -> None:
    from imgpipe.enroot.cache.layout import make_layout
    from imgpipe.enroot.cache.storage import Storage

    shutil.rmtree(cache, ignore_errors=True)
    make_layout(Storage(cache))  # node-config --make-cache: 1777, the layout root's


def start(sandbox: Sandbox, work: Path, shape: str, nodes: int, env: dict[str, str],
          timeout: float, pyxis: bool) -> dict[str, object]:
    """Submit, wait until every task ran (or failed), and say what happened."""
    results = work / "results"
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir()
    os.chmod(results, 0o1777)
    env = {**env, "RESULTS": str(results)}
    task = str(work / "task.sh")
    if pyxis:
        job = str(work / "pyxis-job.sh")
        count = 1 if shape == "1 node" else nodes
        size = nodes if shape == "job" else 1
        commands = [f"sbatch --parsable -N{size} --ntasks-per-node=1 --exclusive "
                    f"-o /dev/null {job}"] * (1 if shape == "job" else count)
        tasks = count
    elif shape == "1 node":
        commands, tasks = [f"sbatch --parsable -N1 -n1 --exclusive -o /dev/null {task}"], 1
    elif shape == "job":
        commands = [f"sbatch --parsable -N{nodes} --ntasks-per-node=1 --exclusive -o /dev/null "
                    f"--wrap {shlex.quote(f'srun {task}')}"]
        tasks = nodes
    else:
        commands = [f"sbatch --parsable -N1 -n1 --exclusive -o /dev/null {task}"] * nodes
        tasks = nodes
    script = " & ".join(commands) + " & wait"
    submitted = time.time()
    done = sandbox.run(["bash", "-c", script], user=USER, env=env, cwd=str(work), timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"error: sbatch: {done.stderr.strip()}")
    jobs = done.stdout.split()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ran = sorted(results.glob("*.ran"))
        queue = sandbox.run(["squeue", "-h", "-j", ",".join(jobs)], timeout=20).stdout.strip()
        if len(ran) == tasks or not queue:
            break
        time.sleep(0.2)
    ran = sorted(results.glob("*.ran"))
    last = max((float(p.read_text()) for p in ran), default=float("nan"))
    errors = {p.name: p.read_text() for p in sorted(results.glob("*.err"))}
    converted = sum("squash with" in text for text in errors.values())
    fetched = sum("fetched published squashfs" in text for text in errors.values())
    failed = [name for name, text in errors.items() if "error" in text.lower()]
    failed += [f"{p.name}: {p.read_text().strip()[-300:]}" for p in sorted(results.glob("*.run"))
               if p.read_text().strip() and len(ran) < tasks]
    if failed:
        print(f"  {failed[0]}", flush=True)
    return {"shape": shape, "tasks": tasks, "ran": len(ran), "seconds": last - submitted,
            "conversions": converted, "fetches": fetched, "failed": failed,
            "hosts": sorted({p.name.split(".")[2] for p in ran})}


def publish_squashfs(registry: services.RegistryProcess, repo: str, digest: str
                     ) -> tuple[str, float]:
    """Convert ``repo@digest`` once in a private cache and publish the file beside it, as
    `imgpipe push --squashfs` does; (the squashfs digest, seconds)."""
    from imgpipe.base.files import file_sha256
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.convert import convert
    from imgpipe.enroot.published.artifact import publish
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.reference import Reference

    started = time.monotonic()
    client = RegistryClient(f"http://{registry.address}")
    cache = Path(tempfile.mkdtemp(prefix="bench-publisher-"))
    try:
        made = convert(client, Storage(cache), Reference.parse(f"{registry.address}/{repo}@"
                                                                f"{digest}"))
        blob = "sha256:" + file_sha256(made.path)
        publish(client, repo, client.manifest(repo, digest), made.path, blob, "zstd", 0)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return blob, time.monotonic() - started


SHAPES = {"convert": "1 node, converting", "1 node": "1 node", "job": "{n}x1 job",
          "jobs": "{n} jobs"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", default="bert,5G",
                        help="comma-separated: bert, or a size for bench/ngc_image.py")
    parser.add_argument("--nodes", type=int, default=8, choices=range(2, 9))
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "start.json")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per start")
    parser.add_argument("--pyxis", type=Path, default=None, metavar="SPANK_PYXIS_SO",
                        help="run the tasks with Pyxis (this plugin, imgpipe's importer) and "
                             "Enroot instead of the importer and ch-run: both built by hand")
    parser.add_argument("--published", action="store_true",
                        help="publish each squashfs first; compare one node converting with "
                             "nodes fetching the pinned published file")
    parser.add_argument("--enroot-bin", type=Path, default=Path("/opt/enroot/bin"),
                        help="where the enroot command is, with --pyxis")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("error: the sandbox needs root (network namespaces, Slurm daemons)")
    ensure_users()
    prepare_node_devices()
    importer = system_imgpipe(ROOT) / "imgpipe-pyxis-importer"
    work = shared_folder("imgpipe-start-")
    (work / "task.sh").write_text(TASK)
    os.chmod(work / "task.sh", 0o755)
    cache = work / "squashfs"
    config = work / "imgpipe.yaml"
    config.write_text(json.dumps({"registry": {"host": "head", "port": 5000},
                                  "outputs": {"squashfs_dir": str(cache)}}))
    os.chmod(config, 0o644)
    plugstack = None
    job_env: dict[str, str] = {}
    if args.pyxis:
        (work / "pyxis-job.sh").write_text(PYXIS_JOB)
        (work / "importer.sh").write_text(PYXIS_IMPORTER)
        for name in ("pyxis-job.sh", "importer.sh"):
            os.chmod(work / name, 0o755)
        plugstack = work / "plugstack.conf"
        plugstack.write_text(f"required {args.pyxis} importer={work / 'importer.sh'} "
                             "use_squashfuse=1 runtime_path=/var/tmp/pyxis\n")
        path = f"{args.enroot_bin}:{os.environ['PATH']}"
        os.environ["PATH"] = path  # slurmd and its steps find enroot
        # Enroot's folders on each host's own /var/tmp; kernel overlayfs in a user namespace
        job_env = {"PATH": path, "ENROOT_RUNTIME_PATH": "/var/tmp/enroot/run",
                   "ENROOT_DATA_PATH": "/var/tmp/enroot/data",
                   "ENROOT_CACHE_PATH": "/var/tmp/enroot/cache", "ENROOT_TEMP_PATH": "/var/tmp",
                   "ENROOT_NATIVE_OVERLAYFS": "y"}
    registry = services.start_registry(Path(tempfile.mkdtemp(prefix="bench-start-reg-")))
    rows: list[dict[str, object]] = []
    try:
        images = {}
        for name in args.images.split(","):
            print(f"{name}: into the registry", flush=True)
            images[name] = put_image(registry, name, ROOT / "build" / "bench" / "ngc-image.json",
                                     shell=args.pyxis is not None)
        spec = SandboxSpec(shared_folder("imgpipe-start-cluster-"), name="imgpb",
                           subnet="10.213.12", compute_nodes=args.nodes, cpus=4, gpus=4,
                           plugstack=plugstack)
        with running(spec, registry_storage=registry.root / "data") as sandbox:
            for name, (repo, digest) in images.items():
                env = {**job_env, "IMGPIPE_CONFIG": str(config), "IMPORTER": str(importer),
                       "URI": f"docker://head:5000#{repo}@{digest}",
                       "PROGRAM": "/usr/bin/true" if name != "bert" else "/bin/true"}
                shapes = ["1 node", "job", "jobs"]
                pins: dict[str, str] = {}
                extra: dict[str, object] = {}
                if args.published:
                    blob, seconds = publish_squashfs(registry, repo, digest)
                    print(f"{name}: published {blob[:19]} (converted and pushed in "
                          f"{seconds:.1f} s)", flush=True)
                    pins = {"IMGPIPE_SQUASHFS_PINS": f"{digest}={blob}"}
                    extra = {"squashfs": blob, "publish_seconds": seconds}
                    shapes.insert(0, "convert")
                first = converting = None
                for shape in shapes:
                    empty_cache(cache)
                    shape_env = {**env, **(pins if shape != "convert" else {})}
                    row = {"image": name, "digest": digest, **extra,
                           **start(sandbox, work, "1 node" if shape == "convert" else shape,
                                   args.nodes, shape_env, args.timeout,
                                   args.pyxis is not None)}
                    row["shape"] = shape
                    seconds = float(row["seconds"])  # type: ignore[arg-type]
                    if shape == "convert":
                        converting = seconds
                    else:
                        first = first or seconds
                    row["ratio"] = seconds / (first or seconds)
                    if converting:
                        row["vs_converting"] = seconds / converting
                    print(f"{name:6} {SHAPES[shape].format(n=args.nodes):20} {seconds:7.1f} s  "
                          f"{row['ratio']:.2f}x"
                          + (f" ({row['vs_converting']:.2f}x of converting)" if converting
                             else "")
                          + f"  ran {row['ran']}/{row['tasks']} on "
                          f"{len(row['hosts'])} hosts  conversions {row['conversions']}  "  # type: ignore[arg-type]
                          f"fetches {row['fetches']}  failed {len(row['failed'])}",  # type: ignore[arg-type]
                          flush=True)
                    rows.append(row)
    finally:
        registry.stop()
        shutil.rmtree(registry.root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
