"""The node-local squashfs folder, made at each boot: the unit ``node-config --apply`` writes
where images reach nodes one by one (``enroot.distribution`` fetch, sbcast or broadcast), and
``--make-cache`` itself.

A tmpfs or a local NVMe disk starts empty at every boot, and a job whose importer finds no
folder fails; so the folder is made before slurmd starts, by a systemd unit of imgpipe's own
(``imgpipe-cache.service``, enabled by its ``multi-user.target.wants`` link as ``systemctl
enable`` would make it).  The unit is not ``RequiredBy`` slurmd: a node whose folder cannot be
made still runs the site's other jobs (an admin who wants such a node kept out adds that line).
"""

from __future__ import annotations

import os
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.commands.shared.wiring import storage
from imgpipe.enroot.cache.layout import make_layout

__all__ = ["NODE_LOCAL", "UNIT", "WANTS", "make_cache", "unit_text"]

UNIT = "/etc/systemd/system/imgpipe-cache.service"
WANTS = "/etc/systemd/system/multi-user.target.wants/imgpipe-cache.service"
NODE_LOCAL = ("fetch", "sbcast", "broadcast")  # distributions whose folder is each node's own


def unit_text(imgpipe: Path, folder: str, distribution: str) -> str:
    """The unit that makes ``folder`` at boot with the node's own imgpipe (``imgpipe``)."""
    return "\n".join([
        f"# imgpipe node-config --apply wrote this (enroot.distribution: {distribution}):",
        "# the node-local squashfs folder, made at each boot before slurmd starts.",
        "# node-config --remove takes it back.",
        "[Unit]",
        "Description=imgpipe's node-local squashfs folder",
        "After=local-fs.target",
        "Before=slurmd.service",
        "",
        "[Service]",
        "Type=oneshot",
        f"ExecStart={imgpipe} node-config --make-cache {folder}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        ""])


def make_cache(settings: Settings, folder: str, group: str | None
               ) -> tuple[Path, list[str], str]:
    """Set the squashfs folder up (``folder``, default outputs.squashfs_dir): its root, what
    was done (a line each), and who owns its layout."""
    # As written, never resolved: a link on the way is refused, not followed (rootpath).
    cache = storage(settings, Path(os.path.abspath(folder)) if folder else None)
    done = make_layout(cache, group)
    return cache.root, done, cache.trust.admin_names()
