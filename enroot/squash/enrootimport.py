"""`enroot import` as the converter, under imgpipe's cache, lock and naming (--with-enroot).

Enroot fetches and squashes by itself (its own blob cache, its own options);
imgpipe only decides the output name, holds the digest's lock and renames the
result into place, so the shared directory looks the same either way.
"""

from __future__ import annotations

import os
from pathlib import Path

from imgpipe.base.process import require, run
from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.squash.tools import ENROOT_OPTIONS, SquashOptions
from imgpipe.registry.reference import Reference

ENROOT_SQUASH = {
    "zstd": ["-comp", "zstd", "-Xcompression-level", "3"],
    "lz4": ["-comp", "lz4"],
    "lzo-enroot": ENROOT_OPTIONS,
    "none": ["-noI", "-noD", "-noF", "-noX"],
}


def enroot_import(ref: Reference, digest: str, output: Path, options: SquashOptions,
                  scheme: str) -> None:
    """Run ``enroot import`` of ``ref`` pinned to ``digest`` into ``output``."""
    binary = require("enroot")
    uri = f"docker://{ref.registry}#{ref.repository}@{digest}"
    env = {"ENROOT_SQUASH_OPTIONS": " ".join(ENROOT_SQUASH[options.compression]),
           "ENROOT_MAX_PROCESSORS": str(options.jobs)}
    if scheme == "http":
        env["ENROOT_ALLOW_HTTP"] = "yes"
    if output.exists():  # enroot refuses to overwrite
        os.unlink(output)
    done = run([binary, "import", "--output", str(output), uri], env=env, timeout=3 * 3600,
               check=False, what="enroot import")
    if done.returncode != 0 or not output.is_file():
        raise ConvertError(f"enroot import of {uri} failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
