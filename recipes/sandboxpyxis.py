"""The sandbox as a Pyxis cluster: each compute host's slurmd loads the Pyxis plugin built by
``./setup.sh`` (Pyxis 0.24, Enroot 4.1.2) through a plugstack line that imgpipe's own
``node-config`` renders for a site, with the options an admin takes by ``--accept``:
imgpipe's importer (when the sandbox names one), job scope (Enroot is on the PATH Pyxis's
cleanup uses) and squashfuse.  The line comes in the spec (``pyxis_line``:
``commands.builds.sandbox.with_pyxis`` renders it); this module writes the files.

Enroot's configuration is the machine's ``/etc/enroot/enroot.conf`` with each host's own
folders: every compute host sees the sandbox's ``enroot.conf`` in its place (a bind mount
in the host's own mount namespace), whose paths lie on the host's private ``/var/tmp``.
Pyxis's runtime folder (``/run/pyxis``) is a tmpfs of each host's, and ``/dev/fuse`` is
usable by every job user inside the compute hosts only (a 0666 node bound over it), as on
a cluster's nodes; the machine's own ``/dev/fuse`` stays as it is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from imgpipe.recipes.errors import SandboxError

__all__ = ["ENROOT_CONF", "PYXIS_RUNTIME", "boot_lines", "bind_lines", "write_host_files",
           "write_pyxis"]

ENROOT_CONF = "/etc/enroot/enroot.conf"
PYXIS_RUNTIME = "/run/pyxis"
# Each host's own folders (its /var/tmp is private); a plain-http registry on the head.
SANDBOX_ENROOT_CONF = """\
# The sandbox's Enroot settings, bound over /etc/enroot/enroot.conf on each compute host.
ENROOT_RUNTIME_PATH /var/tmp/enroot/runtime/user-$(id -u)
ENROOT_CACHE_PATH   /var/tmp/enroot/cache/user-$(id -u)
ENROOT_DATA_PATH    /var/tmp/enroot/data/user-$(id -u)
ENROOT_TEMP_PATH    /var/tmp
ENROOT_ALLOW_HTTP   yes
ENROOT_MAX_PROCESSORS 2
"""


def write_pyxis(root: Path, line: str) -> Path:
    """The plugstack.conf holding Pyxis's ``line`` (as ``node-config`` renders it for a site:
    ``commands.builds.sandbox.with_pyxis``) in ``root``, and the hosts' files; its path."""
    if not line.startswith("required "):
        raise SandboxError("the sandbox has no Pyxis line to load",
                           hint="make its spec with commands.builds.sandbox.with_pyxis")
    plugstack = root / "plugstack.conf"
    plugstack.write_text(f"# Pyxis, the line imgpipe node-config renders\n{line}\n")
    os.chmod(plugstack, 0o644)
    write_host_files(root)
    return plugstack


def write_host_files(root: Path) -> None:
    """What each compute host binds in its own place: the sandbox's enroot.conf and a
    /dev/fuse every user may open."""
    (root / "enroot.conf").write_text(SANDBOX_ENROOT_CONF)
    os.chmod(root / "enroot.conf", 0o644)
    fuse = root / "dev" / "fuse"
    if not fuse.exists():
        os.mknod(fuse, 0o666 | stat.S_IFCHR, os.makedev(10, 229))
    os.chmod(fuse, 0o666)


def boot_lines(root: Path) -> list[str]:
    """What a compute host's boot script does for Pyxis: its own Enroot settings, Pyxis
    runtime folder and a /dev/fuse every user may open."""
    return [f'if [ -f "{root}/enroot.conf" ] && [ -f {ENROOT_CONF} ]; then',
            f'  mount --bind "{root}/enroot.conf" {ENROOT_CONF}',
            "fi",
            # Enroot's folders per user under each host's own /var/tmp (a tmpfs mounted
            # just before): their parents made here, for every user, as a node's boot does
            "mkdir -p -m 1777 /var/tmp/enroot/runtime /var/tmp/enroot/cache "
            "/var/tmp/enroot/data",
            "chmod 0755 /var/tmp/enroot",
            f"if [ -d {PYXIS_RUNTIME} ] || mkdir -p {PYXIS_RUNTIME}; then",
            f"  mount -t tmpfs -o mode=755 tmpfs {PYXIS_RUNTIME}",
            "fi",
            f'if [ -c "{root}/dev/fuse" ]; then',
            f'  mount --bind "{root}/dev/fuse" /dev/fuse',
            "fi"]


def bind_lines(binds: str) -> list[str]:
    """``FOLDER:TARGET,...``: each FOLDER bound over the host's TARGET, so a compute host
    sees a node image's folders (an importer link, a venv) where a site's node has them."""
    lines = []
    for pair in filter(None, binds.split(",")):
        folder, _, target = pair.partition(":")
        lines.append(f'mount --bind "{folder}" "{target}"')
    return lines
