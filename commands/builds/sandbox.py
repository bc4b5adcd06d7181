"""`imgpipe sandbox`: the local multi-host Slurm cluster (``imgpipe.recipes.sandbox``), as
the CLI drives it: whether this machine can make it a Pyxis cluster, and the local
registry's data the head host serves."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.enroot.nodeconfig import PYXIS_SO_CANDIDATES, detect_enroot, detect_pyxis, render
from imgpipe.recipes.sandbox import MAX_COMPUTE_NODES, Sandbox, SandboxError, SandboxSpec
from imgpipe.registry.localfiles import ServerFiles

__all__ = ["MAX_COMPUTE_NODES", "Sandbox", "SandboxError", "SandboxSpec", "has_pyxis",
           "registry_data", "with_pyxis"]

SETUP_HINT = "./setup.sh peers builds Enroot 4.1.2 and Pyxis 0.24.0 (as root)"


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


def with_pyxis(spec: SandboxSpec, importer: str = "", squashfuse: bool = True) -> SandboxSpec:
    """``spec`` as a Pyxis cluster: its plugstack line rendered by ``node-config``'s own code
    for this machine's Pyxis and Enroot, every option an admin may accept taken (imgpipe's
    ``importer`` when given, job scope, squashfuse).  One line naming ``./setup.sh peers``
    when this machine has no Pyxis or no Enroot."""
    found = detect_pyxis()
    if found is None:
        raise SandboxError(f"no Pyxis plugin (looked in {', '.join(PYXIS_SO_CANDIDATES)})",
                           hint=SETUP_HINT)
    enroot = shutil.which("enroot")
    if enroot is None or detect_enroot(enroot) is None:
        raise SandboxError("no enroot on this PATH", hint=SETUP_HINT)
    plugin, version = found
    accept = {"container_scope", *(("squashfuse",) if squashfuse else ()),
              *(("importer",) if importer else ())}
    config = render(Settings(), importer or "/nonexistent", version, plugin, enroot,
                    squashfuse=squashfuse, accept=frozenset(accept))
    [line] = [c.line for c in config.changes if c.line.startswith("required ")]
    return dataclasses.replace(spec, pyxis=True, importer=importer, squashfuse=squashfuse,
                               pyxis_line=line)
