"""The bench corpus (imgpipe.commands.demo.democorpus) as a command.

    .venv/bin/python bench/corpus.py OUTPUT_DIR --megabytes 50
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.commands.demo.democorpus import assemble  # noqa: E402

__all__ = ["assemble"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--megabytes", type=float, default=5.0)
    args = parser.parse_args()
    print(assemble(args.output, args.megabytes), file=sys.stderr)
