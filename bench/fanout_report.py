"""bench_fanout.py's report: the table printed, fanout.json and fanout.png."""

from __future__ import annotations

import json
from pathlib import Path

MODES = ("fetch", "sbcast", "broadcast", "tier", "sbcast+tier")


def stages_text(stages: dict) -> str:
    names = (("mpi_ready", "every task's MPI ready"), ("batch_first_chunk", "first chunk checked"),
             ("first_byte_last_node", "first byte at the last node"),
             ("batch_fetch_done", "batch host's fetch done"), ("last_unit", "last unit in"),
             ("final_check", "final check"), ("gathered", "gathered"))
    said = [f"{text} {stages[key]}" for key, text in names if stages.get(key) is not None]
    return ", ".join(said) + (f"; per hop {1000 * stages['per_hop_s']:.1f} ms (first byte), "
                              f"{1000 * (stages.get('per_hop_last_s') or 0):.1f} ms (last)"
                              if stages.get("per_hop_s") is not None else "")


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bert = results["bert"]
    counts = sorted(int(n) for n in bert)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        xs = [n for n in counts if "seconds" in bert[str(n)].get(mode, {})]
        left.plot(xs, [bert[str(n)][mode]["seconds"] for n in xs], marker="o", label=mode)
        right.plot(xs, [bert[str(n)][mode]["registry_bytes"] / 1e9 for n in xs], marker="o",
                   label=mode)
    left.set(xlabel="nodes", ylabel="seconds until every node's first task",
             title="bert squashfs, node-local caches")
    right.set(xlabel="nodes", ylabel="GB the registry served", title="registry egress")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _rows(image: str, row: dict, one: float | None) -> list[str]:
    """One line per mode of one N: seconds, the ratio to every node fetching (and to one
    node, given its time), what the registry served."""
    base = row.get("fetch", {}).get("seconds")
    lines = []
    for mode, got in row.items():
        if "error" in got:
            lines.append(f"{image} {mode:14} failed: {got['error']}")
            continue
        ratio = f"{got['seconds'] / base:.2f}" if base else "-"
        versus_one = f"{got['seconds'] / one:10.2f}" if one else ""
        lines.append(f"{image} {mode:14} {got['seconds']:8.1f} {ratio:>9} {versus_one} "
                     f"{got['registry_bytes'] / 1e9:12.2f} {got['copies_served']:7} "
                     f"{got.get('task_cpu_s', 0):8.1f} {got.get('machine_cpu_s', 0):8.1f} "
                     f"{100 * got.get('machine_busy', 0):5.0f}%")
        if "stages" in got:
            lines.append(f"{'':31}stages: {stages_text(got['stages'])}")
    return lines


def report(results: dict, counts: list[int], out: Path) -> None:
    bert = results["bert"]
    one = bert["1"]["sbcast"]["seconds"]
    print(f"\none node: {one:.1f} s (registry link {results['registry_rate']}, nodes' links "
          f"{results.get('node_rate') or 'unshaped'}, {results.get('cores')} cores)")
    print(f"{'image':14} {'mode':14} {'seconds':>8} {'vs fetch':>9} {'vs 1 node':>10} "
          f"{'registry GB':>12} {'copies':>7} {'task CPU':>8} {'all CPU':>8} {'busy':>6}")
    for nodes in counts[1:]:
        print("\n".join(_rows(f"bert N={nodes:<6}", bert[str(nodes)], one)))
    for nodes, row in results["generated"].items():
        print("\n".join(_rows(f"generated N={nodes:<1}", row, None)))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fanout.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "fanout.png")
    print(f"wrote {out / 'fanout.json'} and {out / 'fanout.png'}")
