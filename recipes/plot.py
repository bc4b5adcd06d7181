"""Bus bandwidth against message size, out of place and in place, with the expected level,
the warn (90 %) and fail (70 %) thresholds the check uses, and its verdict."""

from __future__ import annotations

from pathlib import Path

from imgpipe.base.files import atomic_path
from imgpipe.recipes.nccl import Run, Verdict

VERDICT_COLOURS = {"pass": "tab:green", "warn": "tab:orange", "fail": "tab:red"}


def plot_busbw(run: Run, verdict: Verdict, output: Path, title: str,
               warn_fraction: float = 0.9, fail_fraction: float = 0.7) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    expected = verdict.expected_busbw
    sizes = [row.size for row in run.rows]
    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=100)
    axes.plot(sizes, [row.out_of_place.busbw for row in run.rows], marker="o",
              label="out of place")
    axes.plot(sizes, [row.in_place.busbw for row in run.rows], marker="x", linestyle="--",
              label="in place")
    axes.axhline(expected, color="tab:blue", linestyle=":", label=f"expected {expected:g} GB/s")
    axes.axhline(warn_fraction * expected, color="tab:orange", linestyle="-.", linewidth=1,
                 label=f"warn below {warn_fraction:.0%}")
    axes.axhline(fail_fraction * expected, color="tab:red", linestyle="-.", linewidth=1,
                 label=f"fail below {fail_fraction:.0%}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    ranks = f"{run.ranks} rank(s)" if run.ranks else "ranks not listed in the log"
    axes.set_title(f"{title}\n{run.collective} on {ranks}")
    axes.text(0.02, 0.95, f"{verdict.status.upper()}: peak {verdict.peak_busbw:.2f} GB/s",
              transform=axes.transAxes, va="top", fontsize=11, fontweight="bold",
              color=VERDICT_COLOURS.get(verdict.status, "black"))
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    with atomic_path(output) as tmp:
        figure.savefig(tmp, format="png")
    plt.close(figure)
    return output
