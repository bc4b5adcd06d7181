"""The demo's jobs as it shows them: what each is, and the closing summary (digests, each
job's state, time and runtime, the losses, the NCCL verdict, Pyxis's own lines)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imgpipe.commands.demo.demopyxis import say

JOB_NAMES = {"dataset.sub": "bert-dataset", "run.sub": "bert-pretrain",
             "nccl.sub": "nccl-check"}


@dataclass
class Job:
    script: str
    label: str
    id: str = ""
    state: str = "PENDING"
    nodes: str = ""
    elapsed: str = ""
    step: int | None = None
    loss: float | None = None
    skipped: bool = False
    runtime: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def pyxis_lines(jobs: list[Job], jobs_dir: Path) -> None:
    """Each Pyxis job's own lines from its output (what Pyxis said when it started it)."""
    for job in jobs:
        if job.runtime != "pyxis" or job.skipped:
            continue
        log = jobs_dir / f"{JOB_NAMES[job.script]}-{job.id}.out"
        lines = [line for line in (log.read_text(errors="replace").splitlines()
                                   if log.exists() else []) if line.startswith("pyxis: ")]
        print(f"  {job.label:<16} {len(lines)} Pyxis line(s), e.g. "
              f"{lines[0] if lines else '(none)'}")


def print_summary(pins: dict[str, str], jobs: list[Job], made: dict[str, Any], recipes: Path,
                  seconds: float) -> None:
    """Digests, each job's state and time, the losses, the NCCL verdict, where things are."""
    summary = made["summary"]
    say("summary")
    for key, value in pins.items():
        print(f"  {key:<16} {value}")
    for job in jobs:
        again = " (done in an earlier run)" if job.skipped else ""
        print(f"  {job.label:<16} job {job.id} {job.state} on {job.nodes} in {job.elapsed}"
              f" ({job.runtime or '?'})"
              f"{again}")
    for phase in (1, 2):
        numbers = summary.get(f"phase{phase}")
        if numbers:
            print(f"  phase {phase} loss     {numbers['first_loss']:.3f} -> "
                  f"{numbers['final_loss']:.3f} in {numbers['steps']} steps")
    trained = [summary[key] for key in ("phase1", "phase2") if summary.get(key)]
    if trained:
        first, final = trained[0]["first_loss"], trained[-1]["final_loss"]
        print(f"  training loss    {first:.3f} -> {final:.3f}: "
              f"{final / first:.2f} of the first")
    if "nccl" in summary:
        print(f"  nccl             {summary['nccl']['line']}")
    for export in summary.get("exports", []):
        print(f"  exported         {export}")
    print(f"  report           {made['report']}")
    print(f"  recipes          {recipes}")
    print(f"  time             {seconds:.0f} s")
