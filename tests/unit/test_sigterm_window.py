"""SIGTERM inside a blocking MPI call (issue #61): the broadcast task's handler turns SIGTERM
into an exception, which Python raises only once the C call returns; a task blocked in MPI's
start or a collective on a peer that died never returns, so the step waited Slurm's KillWait
(30 s) before its second try.  Inside ``sigterm_ends_at_once`` the signal ends the process at
once; outside it, the handler is back."""

from __future__ import annotations

import signal
import subprocess
import sys

PROGRAM = """
import ctypes, os, signal, sys, threading
from imgpipe.base.signals import Terminated, raise_on_sigterm, sigterm_ends_at_once
raise_on_sigterm()
if sys.argv[1] == "inside":
    with sigterm_ends_at_once():
        # a C call that does not come back to Python: libc's pause() under a handler that
        # never runs (SIGTERM ends the process first), the way MPI's progress loop spins
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        ctypes.CDLL(None).pause()
    print("came back", flush=True)
else:
    with sigterm_ends_at_once():
        pass
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    except Terminated:
        print("unwound", flush=True)
"""


def _run(where: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM, where], capture_output=True,
                          text=True, timeout=30)


def test_sigterm_inside_the_window_ends_the_process_at_once() -> None:
    done = _run("inside")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert "came back" not in done.stdout


def test_after_the_window_sigterm_unwinds_as_before() -> None:
    done = _run("after")
    assert done.returncode == 0 and done.stdout.strip() == "unwound", (done.stdout, done.stderr)
