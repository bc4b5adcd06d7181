"""What bench_fanout.py reads of a job and of the machine: the sbcast and importer wrappers
that time themselves, the importer tasks' CPU, the whole machine's CPU from /proc/stat, and
the broadcast's stage times from the batch host's line."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from imgpipe.enroot.published.relay import parse_stages


def sbcast_timer(folder: Path) -> Path:
    """sbcast itself, with its start and end printed (IMGPIPE_SBCAST names it)."""
    path = folder / "timed-sbcast"
    path.write_text('#!/bin/sh\necho "sbcast-start $(date +%s.%N)"\nsbcast "$@"\nstatus=$?\n'
                    'echo "sbcast-end $(date +%s.%N)"\nexit $status\n')
    path.chmod(0o755)
    return path


def timed_importer(folder: Path, importer: str) -> Path:
    """The importer, with the CPU time it and its children used said after it in one line
    (bash's ``time``, which counts the children it waited for: the batch host's fetch)."""
    path = folder / "timed-importer"
    path.write_text('#!/bin/bash\nTIMEFORMAT="cpu-task $(hostname) $1 %3U %3S"\n'
                    f'time {shlex.quote(importer)} "$@"\n')
    path.chmod(0o755)
    return path


def task_cpu_s(text: str) -> float:
    """The CPU seconds (user + system) of every importer task a job's output tells."""
    return round(sum(float(user) + float(system) for user, system in re.findall(
        r"^cpu-task \S+ \S+ ([0-9.]+) ([0-9.]+)$", text, re.M)), 2)


def machine_cpu() -> list[int]:
    """/proc/stat's first line: jiffies of all cores (user nice system idle iowait irq
    softirq steal)."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def machine_cpu_since(before: list[int]) -> dict[str, float]:
    """The machine's CPU time since ``before``: busy and iowait seconds, and the busy share
    of all its cores."""
    spent = [b - a for a, b in zip(before, machine_cpu(), strict=True)]
    tick, total = os.sysconf("SC_CLK_TCK"), sum(spent) or 1
    busy = total - spent[3] - spent[4]
    return {"machine_cpu_s": round(busy / tick, 2), "machine_iowait_s": round(spent[4] / tick, 2),
            "machine_busy": round(busy / total, 3), "cores": os.cpu_count() or 1}


def stage_times(text: str, start: float) -> dict | None:
    """The broadcast's stage times in a job's output, in seconds since the job's start
    (the hops' cost in seconds per hop); None without the line."""
    stages = parse_stages(text)
    began = stages.get("start") if stages is not None else None
    if stages is None or not isinstance(began, (int, float)):
        return None
    shift = began - start  # the batch host's task began its fetch then

    def at(key: str) -> float | None:
        value = stages.get(key)
        return round(shift + value, 2) if isinstance(value, (int, float)) else None

    fetch = stages.get("fetch")
    return {"batch_fetch_start": round(shift, 2), "mpi_ready": at("ready_last"),
            "batch_first_chunk": at("first_chunk"), "batch_fetch_done": at("fetch"),
            "batch_fetch_s": round(fetch, 2) if isinstance(fetch, (int, float)) else None,
            "first_byte_last_node": at("first_byte_last_node"), "last_unit": at("last_unit"),
            "final_check": at("final_check"), "gathered": at("gathered"),
            "per_hop_s": stages.get("per_hop_s"), "per_hop_last_s": stages.get("per_hop_last_s"),
            "nodes": stages.get("nodes")}
