"""Setting a shared squashfs cache up the safe way, and auditing one.

``make_layout`` is what ``imgpipe node-config --make-cache`` runs as root (or the service
account): the root folder 1777 (3775 with a group), the layout owned by the service account
or root, never adopted from a job user.  ``audit`` is what ``imgpipe doctor`` and ``imgpipe
cache ls`` report: wrong owners or modes, links and non-files, planted look-alike names.
Who is trusted with what is ``enroot.cache.trust``'s; the names are ``enroot.cache.storage``'s.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from imgpipe.base.files import atomic_write
from imgpipe.base.terminal import shown
from imgpipe.enroot.cache.rootpath import walk_admin_path
from imgpipe.enroot.cache.storage import (
    CACHEDIR_TAG,
    LAYOUT_VERSION,
    Storage,
    make_shared_dir,
)
from imgpipe.enroot.cache.trust import check_entry, check_layout_folder, user_name
from imgpipe.enroot.errors import ConvertError


def make_layout(storage: Storage, group: str | None = None) -> list[str]:
    """Set the shared cache up the safe way (root or the service account only): the root
    folder 1777 (3775 with ``group``: every job user in it), the layout under it owned
    by the service account (or root), VERSION written.  Idempotent; a layout folder a job
    user made is refused, never adopted.  Returns what it did, a line each."""
    if not storage.trust.is_admin:
        raise ConvertError(f"only {storage.trust.admin_names()} may set up the shared cache "
                           f"{storage.root}", hint="run it as root: sudo imgpipe node-config "
                           f"--make-cache {storage.root}")
    owner = storage.trust.me
    if storage.trust.me == 0 and storage.trust.service:
        owner = pwd.getpwnam(storage.trust.service).pw_uid
    gid = grp.getgrnam(group).gr_gid if group else pwd.getpwuid(owner).pw_gid
    mode = 0o3775 if group else 0o1777
    done: list[str] = []
    if walk_admin_path(storage.root, storage.trust, create_mode=mode):
        done.append(f"made {storage.root}")
    _adopt(storage, storage.root, owner, gid, mode, done)
    for folder, folder_mode in storage.layout():
        if make_shared_dir(folder, folder_mode):
            done.append(f"made {folder}")
        _adopt(storage, folder, owner, gid, folder_mode, done)
    version = storage.version_file
    why = check_entry(version, storage.trust)
    if why:  # "" is nothing there yet: written below
        raise ConvertError(f"{version}: {why}",
                           hint=f"remove it; it was not written by {storage.trust.admin_names()}")
    for path, text in ((version, LAYOUT_VERSION + "\n"), (storage.cachedir_tag, CACHEDIR_TAG)):
        if not path.exists():
            atomic_write(path, text, mode=0o644)
            os.chown(path, owner, gid, follow_symlinks=False)
            done.append(f"wrote {path}")
    check_layout_folder(storage.root, storage.trust, storage.shared)
    return done


def _adopt(storage: Storage, folder: Path, owner: int, gid: int, mode: int,
           done: list[str]) -> None:
    try:  # the folder itself, never a link: changed through its descriptor
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConvertError(f"{folder} is not a directory (a link or a file stands there)",
                           hint=f"remove it, then run imgpipe node-config --make-cache "
                           f"{storage.root} again") from exc
    try:
        _adopt_fd(storage, fd, folder, owner, gid, mode, done)
    finally:
        os.close(fd)


def _adopt_fd(storage: Storage, fd: int, folder: Path, owner: int, gid: int, mode: int,
              done: list[str]) -> None:
    info = os.fstat(fd)
    if not storage.trust.trusts(info.st_uid):
        raise ConvertError(f"{folder} was made by {user_name(info.st_uid)}, a job user: "
                           "what it holds cannot be trusted",
                           hint=f"move it aside (mv {folder} {folder}.suspect), then run "
                           "this again")
    if (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) != (owner, gid, mode):
        os.fchown(fd, owner, gid)
        os.fchmod(fd, mode)
        done.append(f"{folder}: owner {user_name(owner)}, mode {mode:04o}")


def audit(storage: Storage) -> list[str]:
    """What is unsafe in this cache, a line each (`imgpipe doctor`, `cache ls`): layout
    folders of the wrong owner or mode, links or other non-files at entry, blob and lock
    paths, shared names a job user wrote, own names of another owner."""
    try:
        storage.check_admin_path()
    except ConvertError as exc:
        return [str(exc)]
    if not storage.root.exists():
        return []
    problems = []
    shared = storage.shared
    for folder in [storage.root, *(f for f, _ in storage.layout())]:
        if not folder.exists() and not folder.is_symlink():
            if shared:
                problems.append(f"{_named(folder)} is missing: imgpipe node-config "
                                f"--make-cache {_named(storage.root)}")
            continue
        try:
            check_layout_folder(folder, storage.trust, shared)
        except ConvertError as exc:
            problems.append(shown(str(exc), 600))
    for path in sorted(storage.root.glob("*.sqsh")):
        why = _entry_problem(storage, path, shared)
        if why:
            problems.append(f"{_named(path)}: {why}")
    for folder in (storage.blobs, storage.locks, storage.uses):
        if folder.is_dir() and not folder.is_symlink():
            for path in sorted(folder.iterdir()):
                info = path.lstat()
                if not stat.S_ISREG(info.st_mode):
                    problems.append(f"{_named(path)}: not a regular file (never read)")
                elif folder == storage.blobs and shared and not info.st_mode & stat.S_IROTH:
                    problems.append(f"{_named(path)}: other users cannot read it (mode "
                                    f"{stat.S_IMODE(info.st_mode):04o}, {user_name(info.st_uid)}"
                                    "): every other user's conversion copies the blob")
    return problems


def _named(path: Path) -> str:
    """A path as a line may show it: another user chose the name (shown escapes it)."""
    return shown(str(path), 400)


def _entry_problem(storage: Storage, path: Path, shared: bool) -> str | None:
    info = path.lstat()
    uid = _own_name_uid(path.name)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        return "not a regular file (ignored by every job)"
    if uid is not None and info.st_uid != uid:
        return f"named for uid {uid} but owned by {user_name(info.st_uid)} (planted)"
    if uid is None and shared and info.st_uid not in storage.trust.admins:
        return f"a shared name written by {user_name(info.st_uid)}, a job user (ignored by " \
            "every job)"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by other users (ignored by every job)"
    if info.st_nlink > 1:
        return f"{info.st_nlink} hard links to one file (ignored by every job)"
    if shared and not info.st_mode & stat.S_IROTH:
        return (f"other users cannot read it (mode {stat.S_IMODE(info.st_mode):04o}): "
                "their jobs fail on it with \"Invalid image format\"")
    return None


def _own_name_uid(name: str) -> int | None:
    """The uid a job user's own entry name carries (``….u<uid>.sqsh``), else None."""
    stem = name.removesuffix(".sqsh")
    head, dot, uid = stem.rpartition(".u")
    return int(uid) if dot and head and uid.isdigit() else None
