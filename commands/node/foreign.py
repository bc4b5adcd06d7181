"""Images of other registries, when Pyxis sends every image to imgpipe's importer.

With ``importer=`` in plugstack.conf, Pyxis asks the importer for every ``--container-image``,
nvcr.io's and Docker Hub's too.  imgpipe serves only its own registry; anything else is
imported as Pyxis does without an importer: ``enroot import --output FILE URI`` as the job's
user, with the job's Enroot settings and credentials (``$ENROOT_CONFIG_PATH``), into the folder
Pyxis imports into (``$PYXIS_RUNTIME_PATH/UID``, which Pyxis makes for the user on each node),
and removed by ``release`` when the step ends, as Pyxis removes its own.  Outside Pyxis (or
where that folder is not the user's alone) the file goes to the user's private folder of the
node's squashfs cache (``.imgpipe/tmp/uUID``); never the user's home, where a 10-20 GB file per
node would land on a shared file system.  A reference that names no registry is Docker Hub's,
as Enroot reads it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from imgpipe.base import process
from imgpipe.base.errors import ImgpipeError
from imgpipe.commands.node.importer import IMPORTED, _quick, import_folder, write_record

__all__ = ["enroot_get", "mirror_hint"]

IMPORT_TIMEOUT_S = 6 * 3600


def enroot_get(uri: str) -> Path:
    """``uri`` imported by Enroot as Pyxis would, into this user's import folder; recorded
    so that release removes it."""
    enroot = process.require("enroot")  # before anything is made for it
    folder = import_folder()
    if folder is None:
        squashfs = (_quick() or {}).get("squashfs_dir") or "outputs.squashfs_dir"
        raise ImgpipeError(f"no folder to import {uri} into: neither $PYXIS_RUNTIME_PATH/"
                           f"{os.getuid()} (Pyxis's) nor {squashfs}/.imgpipe/tmp/"
                           f"u{os.getuid()} is a folder of yours alone",
                           hint="run it under Pyxis, or ask the admin to set the node's "
                           "squashfs folder up (imgpipe node-config --make-cache)")
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    step = os.environ.get("SLURM_STEP_ID", "nostep")
    out = Path(folder) / f"import.{socket.gethostname()}.{job}.{step}.squashfs"
    try:  # a leftover of this step's earlier try: this user's own file only
        if out.lstat().st_uid == os.getuid():
            out.unlink()
    except FileNotFoundError:
        pass
    try:
        process.run([enroot, "import", "--output", str(out), uri], timeout=IMPORT_TIMEOUT_S,
                    what=f"enroot import {uri}")
    except ImgpipeError as exc:  # most often a node that reaches no public registry
        raise ImgpipeError(exc.message, hint=mirror_hint(uri)) from None
    write_record([IMPORTED, str(out)])
    _audit(uri, out)
    return out


def _audit(uri: str, out: Path) -> None:
    """The import as a line of the site's audit log (``docker://`` references: a local
    engine's image comes from no registry); its digest is Enroot's to know unless pinned."""
    from imgpipe.commands.node.audit import record
    from imgpipe.commands.node.importer import DOCKER_HUB
    from imgpipe.registry.errors import ReferenceFormatError
    from imgpipe.registry.reference import Reference

    if "://" in uri and not uri.startswith("docker://"):
        return
    try:
        ref = Reference.parse(uri, default_registry=DOCKER_HUB)
    except ReferenceFormatError:
        return
    record("get", str(ref), ref.digest, out, "imported")


def mirror_hint(uri: str) -> str:
    """What makes ``uri`` run on nodes that reach no registry but the site's."""
    from imgpipe.commands.node.importer import DOCKER_HUB
    from imgpipe.registry.errors import ReferenceFormatError
    from imgpipe.registry.reference import DOCKER_HUB_NAMES, Reference

    try:
        ref = Reference.parse(uri, default_registry=DOCKER_HUB)
    except ReferenceFormatError:
        return "check the image reference"
    registry = "docker.io" if ref.registry in DOCKER_HUB_NAMES else ref.registry
    return (f"where nodes reach no registry but the site's, an admin copies it there "
            f"(imgpipe mirror {registry}/{ref.repository}{':' + ref.tag if ref.tag else ''}"
            f"{'@' + ref.digest if ref.digest else ''}) and maps {registry} in the site "
            f"config (registry.mirrors: {{{registry}: \"\"}})")
