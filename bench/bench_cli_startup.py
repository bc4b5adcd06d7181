"""`imgpipe --help` start-up: the CLI as shipped (command modules imported on first use)
against the same CLI with every command module imported up front, side by side.  Goal:
under 0.3 s.

    .venv/bin/python bench/bench_cli_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

EAGER = ("import importlib\n"
         "from imgpipe.cli.main import LAZY_COMMANDS, main\n"
         "for module, _, _ in LAZY_COMMANDS.values():\n"
         "    importlib.import_module(module)\n"
         "main(['--help'])\n")
LAZY = "from imgpipe.cli.main import main\nmain(['--help'])\n"


def median_seconds(code: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    eager = median_seconds(EAGER, runs)
    lazy = median_seconds(LAZY, runs)
    print(f"imgpipe --help, median of {runs} new processes: every command module imported "
          f"{eager:.3f} s, as shipped {lazy:.3f} s (ratio {lazy / eager:.2f}; goal < 0.3 s)")
