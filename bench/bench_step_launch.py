"""How long a job step takes to start its tasks on the sandbox, by node count and launch
kind: what the broadcast's chain waits for before its first byte (bench/README.md, issue 61).

Each row is one `srun -N N --ntasks-per-node=1` on an idle sandbox of 16 compute hosts
(namespaces on this machine, 2 cores), its tasks printing the time they began: `sh` with
`--mpi=none` (slurmstepd alone), `sh` with `--mpi=pmix` (PMIx's server in every slurmstepd),
`python3` importing mpi4py and initializing MPI under `--mpi=pmix`, and the nodes' imgpipe (a
venv of the system Python) importing what the broadcast's importer imports before the batch
host forks its fetch (no MPI yet): the tasks' own start, competing for the cores.  Printed:
the median over --repeat runs of the first and the last task's start since srun began, and
the last beside the same kind's one-node step.

    .venv/bin/python bench/bench_step_launch.py --nodes 1,8,16 --repeat 3 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from imgpipe.recipes.sandbox import SandboxSpec, running  # noqa: E402

SH = ["/bin/sh", "-c", "date +%s.%N"]
MPI = ["/usr/bin/python3", "-c", "import time; from mpi4py import MPI; MPI.COMM_WORLD; "
       "print(f'{time.time():.6f}')"]
KINDS = {"sh --mpi=none": ("none", SH), "sh --mpi=pmix": ("pmix", SH),
         "mpi4py --mpi=pmix": ("pmix", MPI)}
IMPORTS = ("import time; import imgpipe.commands.node.broadcast, imgpipe.commands.node.importer;"
           " print(f'{time.time():.6f}')")


def one_step(cluster, nodes: int, mpi: str, argv: list[str]) -> tuple[float, float]:
    """The first and the last task's start of one step, seconds since srun began."""
    began = time.time()
    done = cluster.run(["srun", f"-N{nodes}", "--ntasks-per-node=1", f"--mpi={mpi}", *argv],
                       timeout=300, cwd="/tmp")
    if done.returncode != 0:
        raise SystemExit(f"srun failed: {done.stderr.strip()[-400:]}")
    starts = sorted(float(line) for line in done.stdout.split() if line.strip())
    if len(starts) != nodes:
        raise SystemExit(f"{nodes} tasks, {len(starts)} times: {done.stdout[-400:]}")
    return starts[0] - began, starts[-1] - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,8,16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.nodes.split(",")} | {1})
    from tests.cluster import system_imgpipe

    python = str(system_imgpipe(ROOT) / "python")
    kinds = {**KINDS, "importer's imports --mpi=pmix": ("pmix", [python, "-c", IMPORTS])}
    work = Path(tempfile.mkdtemp(prefix="imgpipe-launch-"))
    spec = SandboxSpec(work / "sandbox", name="imglt", subnet="10.213.19",
                       compute_nodes=max(counts), cpus=2)
    rows = []
    with running(spec) as cluster:
        for kind, (mpi, argv) in kinds.items():
            one_node = None
            for nodes in counts:
                runs = [one_step(cluster, nodes, mpi, argv) for _ in range(args.repeat)]
                first = statistics.median(r[0] for r in runs)
                last = statistics.median(r[1] for r in runs)
                one_node = last if nodes == 1 else one_node
                rows.append({"kind": kind, "nodes": nodes, "first_s": round(first, 2),
                             "last_s": round(last, 2),
                             "vs_one_node": round(last / one_node, 2) if one_node else None})
                print(f"{kind:<30} N={nodes:<3} first task {first:5.2f} s, last {last:5.2f} s"
                      f" ({rows[-1]['vs_one_node']}x one node's)", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_launch.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
