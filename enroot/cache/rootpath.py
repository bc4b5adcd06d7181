"""The cache paths root (or the service account) acts on: never one a job user could prepare.

``imgpipe node-config --make-cache DIR`` runs as root on every node, and so may ``doctor``,
``cache prune`` and the cache writer.  Python resolves links itself (``fs.protected_symlinks``
does not apply to it), so a job user who can write the folder above a cache path that does not
exist yet could plant ``DIR -> /etc`` and have root make /etc 1777.  So before root acts on a
cache path, it is walked from ``/`` one folder at a time with ``openat(O_NOFOLLOW)``:

- no component may be a symbolic link (the path is taken as written, never resolved);
- every folder on the way belongs to root or the service account, and nobody else may write
  it unless it is sticky (as ``/tmp`` is: a name made there is then the maker's to keep);
- the cache folder itself, where it exists, belongs to root or the service account and is
  empty or already an imgpipe cache (``.imgpipe/`` inside): nothing else is adopted.

Refusals are one line naming the folder and the owner to fix.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from imgpipe.base.terminal import shown
from imgpipe.enroot.cache.trust import CacheTrust, user_name
from imgpipe.enroot.errors import ConvertError

LAYOUT_FOLDER = ".imgpipe"


def _refuse(what: str, hint: str) -> ConvertError:
    return ConvertError(what, hint=hint)


def _open_below(parent: int, name: str, where: str) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if stat.S_ISLNK(
                os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode) else "not a folder"
            raise _refuse(f"{where} is {kind}: root acts on cache paths only as written, "
                          "never through a link",
                          "name the real folder (no links on the way)") from None
        raise


def _check_parent(fd: int, where: str, trust: CacheTrust) -> None:
    info = os.fstat(fd)
    if info.st_uid not in trust.admins:
        raise _refuse(f"{where} belongs to {user_name(info.st_uid)}: root does not act below a "
                      "folder another user controls", f"use a folder whose parents belong "
                      f"to {trust.admin_names()}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise _refuse(f"{where} is writable by other users without the sticky bit (mode "
                      f"{stat.S_IMODE(info.st_mode):04o}): they could swap what is below it",
                      f"chmod o-w,g-w {where}, or use another folder")


def walk_admin_path(path: Path, trust: CacheTrust, create_mode: int | None = None) -> bool:
    """Check the cache folder ``path`` for root's use (see the module's rules); with
    ``create_mode``, make it (exactly that mode, exclusively) and the folders above it
    (0755) where they do not exist yet.  Returns whether the cache folder was made.  Raises
    ConvertError, one line."""
    text = os.path.normpath(os.path.abspath(path))
    parts = [part for part in text.split("/") if part]
    if not parts:
        raise _refuse("/ cannot be a squashfs cache", "name a folder of its own")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = ""
    try:
        for part in parts[:-1]:
            _check_parent(fd, where or "/", trust)
            where = f"{where}/{part}"
            if create_mode is not None:  # a folder above, made here: root's own, 0755
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            below = _open_below(fd, part, shown(where, 400))
            os.close(fd)
            fd = below
        _check_parent(fd, where or "/", trust)
        return _final(fd, parts[-1], shown(text, 400), trust, create_mode)
    except FileNotFoundError:
        raise _refuse(f"{shown(where, 400)} does not exist",
                      "make the folders above the cache first (as root)") from None
    finally:
        os.close(fd)


def _final(parent: int, name: str, where: str, trust: CacheTrust, create_mode: int | None
           ) -> bool:
    made = False
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        if create_mode is None:
            return False  # nothing there: nothing to act on
        old = os.umask(0)
        try:
            os.mkdir(name, create_mode, dir_fd=parent)
        finally:
            os.umask(old)
        made = True
    fd = _open_below(parent, name, where)
    try:
        info = os.fstat(fd)
        if info.st_uid not in trust.admins:
            raise _refuse(f"{where} was made by {user_name(info.st_uid)}, a job user: root "
                          "does not adopt it", f"move it aside (mv {where} {where}.suspect), "
                          "then run this again")
        if made:
            return True
        names = os.listdir(fd)
        if names and LAYOUT_FOLDER not in names:
            listed = shown(", ".join(sorted(names)[:3])) + (", ..." if len(names) > 3 else "")
            raise _refuse(f"{where} already holds other files ({listed}): it is not an "
                          "imgpipe cache",
                          "name an empty folder, or one that is already an imgpipe cache")
        return False
    finally:
        os.close(fd)
