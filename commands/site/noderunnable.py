"""Whether a job user can run a node's importer (``node-config --check``, ``--upgrade``):
every folder, link and file on its way, its script's interpreter, root's alone and open to
others (Pyxis runs it in every user's container step), and the Python its venv was made
from: imgpipe needs 3.11 or newer, and RHEL 9 and its rebuilds (Rocky, AlmaLinux) ship 3.9 as
``python3``, with 3.11 and 3.12 as packages of their own beside it.  The version is read from
the venv's ``pyvenv.cfg`` (what ``venv`` wrote), never by running anything of a node image."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

__all__ = ["NEEDED", "python_problem", "runnable_by_others", "venv_python_version"]

NEEDED = (3, 11)
_VERSION = re.compile(r"^\s*(?:version|version_info)\s*=\s*(\d+)\.(\d+)", re.M)
FIX = ("RHEL, Rocky or AlmaLinux 9: dnf install python3.11 (or python3.12, with wheels from "
       "PYTHON_VERSION=3.12 ./setup.sh node-wheels), then make the venv from it: python3.11 -m "
       "venv {venv}, with wheels from NODE_GLIBC=2.34 ./setup.sh node-wheels; Debian 12 and "
       "Ubuntu 24.04: their python3 will do")


def venv_python_version(venv: Path) -> tuple[int, int] | None:
    """The (major, minor) of the Python ``venv`` (a host path) was made from; None when it
    has no pyvenv.cfg that says."""
    try:
        text = (venv / "pyvenv.cfg").read_text(errors="replace")
    except OSError:
        return None
    found = _VERSION.search(text)
    return (int(found[1]), int(found[2])) if found else None


def python_problem(venv: Path, shown: str) -> str | None:
    """Why the venv at ``venv`` (shown as ``shown``, the node's own path) cannot run imgpipe,
    with what fixes it; None when its Python is new enough or cannot be told."""
    version = venv_python_version(venv)
    if version is None or version >= NEEDED:
        return None
    return (f"{shown} runs Python {version[0]}.{version[1]}, imgpipe needs "
            f"{NEEDED[0]}.{NEEDED[1]} or newer: " + FIX.format(venv=shown))


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _shown(root: Path, path: Path) -> str:
    return "/" + str(path.relative_to(root)).lstrip("/")


def _unsafe(root: Path, path: Path, info: os.stat_result) -> str | None:
    """Why a file or folder on the importer's way is not root's alone: every user's
    --container-image step runs what lies there."""
    if info.st_uid != 0:
        return f"{_shown(root, path)} belongs to uid {info.st_uid}, not root"
    sticky_dir = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
    if info.st_mode & 0o022 and not stat.S_ISLNK(info.st_mode) and not sticky_dir:
        return f"{_shown(root, path)} is writable by others (mode {info.st_mode & 0o777:o})"
    return None


def runnable_by_others(root: Path, path: Path) -> str | None:
    """Why a job user (not root, not the owner) could not, or should not, execute ``path``
    inside ``root``, following its links and its script's interpreter: every folder and file
    on the way must let others run it and be root's alone (Pyxis runs it in every user's
    container step); None when it is so."""
    seen = 0
    current = path
    while True:
        seen += 1
        if seen > 16:
            return f"{path}: too many links"
        host = _under(root, str(current))
        for folder in [*reversed(host.parents)]:
            if folder == root or root not in (folder, *folder.parents):
                continue
            try:
                info = folder.lstat()
            except FileNotFoundError:
                return f"{_shown(root, folder)} does not exist"
            if stat.S_ISDIR(info.st_mode) and not info.st_mode & 0o001:
                return f"{_shown(root, folder)} is closed to other users " \
                       f"(mode {info.st_mode & 0o777:o})"
            if os.geteuid() == 0 and (why := _unsafe(root, folder, info)):
                return why
        try:
            info = host.lstat()
        except FileNotFoundError:
            return f"{current} does not exist"
        if stat.S_ISLNK(info.st_mode):
            current = (current.parent / os.readlink(host))
            current = Path(os.path.normpath(current))
            continue
        if not info.st_mode & 0o001:
            return f"{current} is not executable by other users (mode {info.st_mode & 0o777:o})"
        if os.geteuid() == 0 and (why := _unsafe(root, host, info)):
            return why
        with open(host, "rb") as handle:
            head = handle.read(256)
        if head.startswith(b"#!"):
            interpreter = head[2:].split(b"\n", 1)[0].split()
            if interpreter and interpreter[0] != str(current).encode():
                current = Path(interpreter[0].decode(errors="replace"))
                continue
        return None
