"""`imgpipe sandbox`: the local multi-host Slurm cluster (``imgpipe.recipes.sandbox``), as
the CLI drives it: whether this machine can make it a Pyxis cluster, and the local
registry's data the head host serves."""

from __future__ import annotations

import shutil
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.enroot.nodeconfig import detect_pyxis
from imgpipe.recipes.sandbox import MAX_COMPUTE_NODES, Sandbox, SandboxError, SandboxSpec
from imgpipe.registry.localfiles import ServerFiles

__all__ = ["MAX_COMPUTE_NODES", "Sandbox", "SandboxError", "SandboxSpec", "has_pyxis",
           "registry_data"]


def has_pyxis() -> bool:
    """Whether this machine has a Pyxis plugin and an enroot (``./setup.sh`` builds both)."""
    return detect_pyxis() is not None and shutil.which("enroot") is not None


def registry_data(settings: Settings) -> Path:
    """The data folder of the registry ``imgpipe registry up`` runs here, which the sandbox's
    head host serves read-only as head:5000; one line when there is none yet."""
    data = ServerFiles(settings).data_dir
    if not (data / "docker").is_dir():
        raise SandboxError(f"the local registry has no data yet ({data})",
                           hint="imgpipe registry up && imgpipe push first")
    return data
