"""Which file system holds a path, as the kernel's mount table says: a cluster file system
every node shares (Lustre, NFS, GPFS...) or a disk of this host alone."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SHARED_TYPES", "filesystem_type", "is_shared_type"]

# File systems that several hosts mount at once (fuse.* covers the FUSE clients of the rest).
SHARED_TYPES = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs",
                "panfs", "wekafs", "orangefs", "pvfs2", "cifs", "smb3", "9p", "afs")
MOUNTINFO = Path("/proc/self/mountinfo")


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_type(path: Path, mountinfo: Path = MOUNTINFO) -> str | None:
    """The type of the file system that holds ``path`` (or would: its nearest existing
    folder), from the longest mount point above it; None when the table cannot be read."""
    target, rest = Path(os.path.abspath(path)), list[str]()
    while not target.exists() and target != target.parent:  # links resolved where they are
        rest.insert(0, target.name)
        target = target.parent
    target = target.resolve().joinpath(*rest)
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    best, found = -1, None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = _unescape(fields[4])
        if (str(target) == point or str(target).startswith(point.rstrip("/") + "/")) \
                and len(point) > best:
            best, found = len(point), right.split()[0]
    return found


def is_shared_type(kind: str | None) -> bool:
    return kind is not None and (kind in SHARED_TYPES or kind.startswith("fuse."))
