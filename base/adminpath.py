"""Paths root acts on: walked from ``/`` without following a link, adopted only if ours.

Root runs imgpipe on paths a config names (the squashfs cache, the registry's data folder,
the blob cache's state folder, node-config's files).  Python resolves links itself
(``fs.protected_symlinks`` does not apply to it), so a user who can write a folder above
such a path before it exists could plant ``DIR -> /etc``, a pid file naming their own
victim, or ``access.log -> /etc/shadow``.  So before root acts on one, the path is walked
from ``/`` one folder at a time with ``openat(O_NOFOLLOW)``:

- no component may be a symbolic link (the path is taken as written, never resolved);
- every folder on the way belongs to an admin (root, or a service account the caller names),
  and nobody else may write it unless it is sticky (as ``/tmp`` is: a name made there is
  then its maker's to keep);
- the folder itself, where it exists, belongs to an admin and holds only what the caller's
  ``adopt`` accepts (an empty folder always): nothing else is adopted.

Below a folder walked this way nobody but an admin can add, swap or remove a name, so
what root then opens there by path is what it checked.  Files root writes there are made
with ``create_private`` (exclusively, or an existing regular file of an admin's, one link).
Refusals are one line naming the folder and the owner to fix.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.terminal import shown

__all__ = ["Admins", "create_private", "open_admin_folder", "user_name",
           "walk_admin_folder"]

Refusal = Callable[[str, str], ImgpipeError]


def user_name(uid: int) -> str:
    """``uid 1001 (alice)``: how messages name a file's owner."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _default_refusal(what: str, hint: str) -> ImgpipeError:
    return ImgpipeError(what, hint=hint)


@dataclass(frozen=True)
class Admins:
    """Whose folders root may act below and adopt: root and, where one runs the thing, a
    service account."""

    uids: frozenset[int]
    names: str  # "root or imgpipe-cache", for messages

    @classmethod
    def of(cls, *accounts: str | None) -> Admins:
        """Root and each named account (an unknown name is skipped: the caller checks)."""
        uids, names = {0}, ["root"]
        for account in accounts:
            if not account:
                continue
            try:
                uids.add(pwd.getpwnam(account).pw_uid)
            except KeyError:
                continue
            names.append(account)
        return cls(frozenset(uids), " or ".join(names))


Adopt = Callable[[list[str]], str | None]  # names in the folder -> why not adopted, or None


def only_names(allowed: Collection[str], what: str) -> Adopt:
    """An ``adopt`` rule: the folder may hold these names and nothing else."""

    def rule(names: list[str]) -> str | None:
        other = sorted(set(names) - set(allowed))
        if not other:
            return None
        listed = shown(", ".join(other[:3])) + (", ..." if len(other) > 3 else "")
        return f"already holds other files ({listed}): it is not {what}"

    return rule


def _open_below(parent: int, name: str, where: str, refuse: Refusal) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if stat.S_ISLNK(
                os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode) else "not a folder"
            raise refuse(f"{where} is {kind}: root acts on configured paths only as "
                         "written, never through a link",
                         "name the real folder (no links on the way)") from None
        raise


def _check_parent(fd: int, where: str, admins: Admins, refuse: Refusal) -> None:
    info = os.fstat(fd)
    if info.st_uid not in admins.uids:
        raise refuse(f"{where} belongs to {user_name(info.st_uid)}: root does not act below a "
                     "folder another user controls", f"use a folder whose parents belong "
                     f"to {admins.names}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise refuse(f"{where} is writable by other users without the sticky bit (mode "
                     f"{stat.S_IMODE(info.st_mode):04o}): they could swap what is below it",
                     f"chmod o-w,g-w {where}, or use another folder")


def open_admin_folder(path: str | os.PathLike[str], admins: Admins, *,
                      create_mode: int | None = None, adopt: Adopt | None = None,
                      refuse: Refusal = _default_refusal, what: str = "a folder of imgpipe's"
                      ) -> tuple[int | None, bool]:
    """Walk ``path`` (see the module's rules) and open it: ``(fd, made)``, the caller closes
    ``fd``.  With ``create_mode``, a missing folder is made (exactly that mode, exclusively)
    and so are missing folders above it (0755); without, a missing one gives ``(None,
    False)``.  ``adopt`` judges an existing folder's names (default: empty only)."""
    text = os.path.normpath(os.path.abspath(path))
    parts = [part for part in text.split("/") if part]
    if not parts:
        raise refuse("/ cannot be used here", "name a folder of its own")
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = ""
    try:
        for part in parts[:-1]:
            _check_parent(fd, where or "/", admins, refuse)
            where = f"{where}/{part}"
            if create_mode is not None:  # a folder above, made here: root's own, 0755
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            below = _open_below(fd, part, shown(where, 400), refuse)
            os.close(fd)
            fd = below
        _check_parent(fd, where or "/", admins, refuse)
        return _final(fd, parts[-1], shown(text, 400), admins, create_mode,
                      adopt or only_names((), what), refuse)
    except FileNotFoundError:
        raise refuse(f"{shown(where, 400)} does not exist",
                     "make the folders above it first (as root)") from None
    finally:
        os.close(fd)


def walk_admin_folder(path: str | os.PathLike[str], admins: Admins, *,
                      create_mode: int | None = None, adopt: Adopt | None = None,
                      refuse: Refusal = _default_refusal, what: str = "a folder of imgpipe's"
                      ) -> bool:
    """``open_admin_folder`` for a caller that needs no descriptor: whether it was made."""
    fd, made = open_admin_folder(path, admins, create_mode=create_mode, adopt=adopt,
                                 refuse=refuse, what=what)
    if fd is not None:
        os.close(fd)
    return made


def _final(parent: int, name: str, where: str, admins: Admins, create_mode: int | None,
           adopt: Adopt, refuse: Refusal) -> tuple[int | None, bool]:
    made = False
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        if create_mode is None:
            return None, False  # nothing there: nothing to act on
        old = os.umask(0)
        try:
            os.mkdir(name, create_mode, dir_fd=parent)
            made = True
        except FileExistsError:  # another process made it first: checked as one found
            pass
        finally:
            os.umask(old)
    fd = _open_below(parent, name, where, refuse)
    try:
        info = os.fstat(fd)
        if info.st_uid not in admins.uids:
            raise refuse(f"{where} was made by {user_name(info.st_uid)}, a job user: root "
                         "does not adopt it", f"move it aside (mv {where} {where}.suspect), "
                         "then run this again")
        if not made:
            why = adopt(os.listdir(fd))
            if why:
                raise refuse(f"{where} {why}", "name an empty folder, or one that is "
                             "already imgpipe's")
    except BaseException:
        os.close(fd)
        raise
    return fd, made


def create_private(folder_fd: int, name: str, admins: Admins, mode: int = 0o600,
                   refuse: Refusal = _default_refusal, where: str = "") -> int:
    """Open ``name`` in an admin folder for appending: made exclusively with ``mode``, or an
    existing regular file of an admin's with one link (set to ``mode``); never through a
    link.  Returns the descriptor (the caller closes it)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=folder_fd)
    except FileExistsError:
        pass
    shown_name = shown(f"{where}/{name}" if where else name, 400)
    try:
        fd = os.open(name, flags, dir_fd=folder_fd)
    except OSError as exc:
        raise refuse(f"{shown_name} is not a regular file ({exc.strerror}): refused",
                     "remove it (root's files are never opened through a link)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid not in admins.uids or info.st_nlink != 1:
        os.close(fd)
        raise refuse(f"{shown_name} is not a file of {admins.names} alone (owner "
                     f"{user_name(info.st_uid)}, {info.st_nlink} link(s)): refused",
                     "remove it, then run this again")
    if stat.S_IMODE(info.st_mode) != mode:
        os.fchmod(fd, mode)
    return fd


def as_path(path: str | os.PathLike[str]) -> Path:
    """A configured path as written, made absolute but never resolved through links."""
    return Path(os.path.normpath(os.path.abspath(path)))
