"""The sandbox's daemons as processes: waiting for a condition, whether a pid lives (a
zombie does not), stopping a process group, and every process that carries the sandbox's
mark (its SLURM_CONF), which slurmstepd daemonized out of reach of the groups."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from imgpipe.recipes.errors import SandboxError

__all__ = ["alive", "kill_marked", "stop_group", "wait_for"]


def wait_for(predicate: object, deadline_s: float, what: str, interval: float = 0.1) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise SandboxError(f"{what} not ready within {deadline_s:.0f} s")


def alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap our own exited children
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def stop_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def kill_marked(marker: bytes) -> None:
    """slurmstepd daemonizes out of slurmd's process group and job tasks are its children:
    find them by the SLURM_CONF each of them inherits, so nothing outlives the cluster."""
    deadline = time.monotonic() + 10
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        if not found or time.monotonic() > deadline:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
