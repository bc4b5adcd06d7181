"""``./setup.sh demo`` (``python -m imgpipe.commands.demo.democli``): the default demo
(``commands/demo/demo.py``), or with ``--platforms`` the x86-and-Grace one
(``commands/demo/demoplatforms.py``), which builds on the default's steps.
"""

from __future__ import annotations

import argparse
import sys

from imgpipe.commands.demo.demo import __doc__ as DEMO_DOC
from imgpipe.commands.demo.demo import run as run_demo
from imgpipe.commands.demo.demoplatforms import run as run_platforms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./setup.sh demo",
                                     description=(DEMO_DOC or "").splitlines()[0])
    parser.add_argument("--down", action="store_true",
                        help="stop the sandbox and the registry the demo started")
    parser.add_argument("--platforms", metavar="OS/ARCH,OS/ARCH", default=None,
                        help="this host's platform and another (linux/amd64,linux/arm64): "
                        "bert built for both, self-tested, pushed as one index, converted "
                        "here, and phase 1 trained a few steps on an x86 and an arm64 "
                        "(emulated) node of the sandbox; outputs in build/demo-platforms")
    parser.add_argument("--runtime", choices=("pyxis", "charliecloud"), default="pyxis",
                        help="what starts the jobs' containers: Pyxis with Enroot (srun "
                        "--container-image pinned to the pushed digest, as the user "
                        "imgpipe-demo) or Charliecloud's ch-run on the squashfs file (as "
                        "root) [default: pyxis]")
    args = parser.parse_args(argv)
    if args.platforms and not args.down:
        return run_platforms(args)
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
