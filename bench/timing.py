"""Timing imgpipe commands in-process, in a project folder, as the benches do."""

from __future__ import annotations

import os
import time
from pathlib import Path

from imgpipe.cli.main import main


def timed(folder: Path, *args: str) -> float:
    """Seconds ``imgpipe ARGS`` took in ``folder``; exits when the command fails."""
    old = Path.cwd()
    os.chdir(folder)
    try:
        started = time.perf_counter()
        code = main(list(args))
        elapsed = time.perf_counter() - started
    finally:
        os.chdir(old)
    if code != 0:
        raise SystemExit(f"imgpipe {' '.join(args)} exited {code}")
    return elapsed
