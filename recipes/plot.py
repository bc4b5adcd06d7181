"""Bus bandwidth against message size, out of place and in place, with the expected level."""

from __future__ import annotations

from pathlib import Path

from imgpipe.base.files import atomic_path
from imgpipe.recipes.nccl import Run


def plot_busbw(run: Run, expected_busbw: float, output: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [row.size for row in run.rows]
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    axes.plot(sizes, [row.out_of_place.busbw for row in run.rows], marker="o",
              label="out of place")
    axes.plot(sizes, [row.in_place.busbw for row in run.rows], marker="x", linestyle="--",
              label="in place")
    axes.axhline(expected_busbw, color="tab:red", linestyle=":",
                 label=f"expected {expected_busbw:g} GB/s")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    with atomic_path(output) as tmp:
        figure.savefig(tmp, format="png")
    plt.close(figure)
    return output
