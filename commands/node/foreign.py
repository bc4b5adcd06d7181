"""Images of other registries, when Pyxis sends every image to imgpipe's importer.

With ``importer=`` in plugstack.conf, Pyxis asks the importer for every ``--container-image``,
nvcr.io's and Docker Hub's too.  imgpipe serves only its own registry; anything else is
imported exactly as Pyxis does without an importer: ``enroot import --output FILE URI`` as the
job's user, with the job's Enroot settings and credentials (``$ENROOT_CONFIG_PATH``), into a
folder of that user's alone, and removed by ``release`` when the step ends.  So a cluster's
existing jobs run as before.  A reference that names no registry is Docker Hub's, as Enroot
reads it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from imgpipe.base import process
from imgpipe.commands.node.importer import IMPORTED, _record_dir, write_record

__all__ = ["enroot_get"]

IMPORT_TIMEOUT_S = 6 * 3600


def enroot_get(uri: str) -> Path:
    """``uri`` imported by Enroot as Pyxis would, into this user's own folder; recorded so
    that release removes it."""
    enroot = process.require("enroot")  # before anything is made for it
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    step = os.environ.get("SLURM_STEP_ID", "nostep")
    out = Path(_record_dir()) / f"import.{socket.gethostname()}.{job}.{step}.squashfs"
    try:  # a leftover of this step's earlier try: this user's own file only
        if out.lstat().st_uid == os.getuid():
            out.unlink()
    except FileNotFoundError:
        pass
    process.run([enroot, "import", "--output", str(out), uri], timeout=IMPORT_TIMEOUT_S,
                what=f"enroot import {uri}")
    write_record([IMPORTED, str(out)])
    return out
