"""Whose files a job may use from the shared cache.

A cluster's cache is written by many users.  The rule underneath everything here: a job
never runs or reads as trusted a file that another unprivileged user owns or can still
change.  Trusted writers are root, the cache's service account (``enroot.cache_owner``)
and the calling user; anything else found at a cache path is ignored (with one line
saying what and whose) or, for blobs and the image config, used only through a digest
check on the very bytes read.

A shared cache (a root folder others may write) keeps its layout (``.imgpipe/`` and every
folder under it) owned by root or the service account: ``imgpipe node-config --make-cache``
makes it.  A job user never creates it, so no job user owns a folder every job writes in.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.adminpath import user_name
from imgpipe.enroot.errors import ConvertError

__all__ = ["ROOT_UID", "CacheTrust", "check_entry", "check_layout_folder", "user_name",
           "why_untrusted"]

ROOT_UID = 0


@dataclass(frozen=True)
class CacheTrust:
    """The uids whose cache files a process of ``me`` uses as they are."""

    me: int
    admins: frozenset[int]  # root and the service account: they own the layout
    service: str | None = None

    @classmethod
    def of(cls, service_account: str | None = None, me: int | None = None) -> CacheTrust:
        admins = {ROOT_UID}
        if service_account:
            try:
                admins.add(pwd.getpwnam(service_account).pw_uid)
            except KeyError as exc:
                raise ConvertError(f"enroot.cache_owner names {service_account!r}, which is "
                                   "no user on this host",
                                   hint="create that account, or fix enroot.cache_owner in "
                                   "imgpipe.yaml") from exc
        return cls(os.getuid() if me is None else me, frozenset(admins), service_account)

    @property
    def is_admin(self) -> bool:
        return self.me in self.admins

    def trusts(self, uid: int) -> bool:
        return uid == self.me or uid in self.admins

    def admin_names(self) -> str:
        return "root" + (f" or {self.service}" if self.service else "")


def why_untrusted(info: os.stat_result, trust: CacheTrust) -> str | None:
    """None when a file with ``info`` (from lstat) may be used as it is; else why not."""
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if not trust.trusts(info.st_uid):
        return (f"it belongs to {user_name(info.st_uid)}, not to you or "
                f"{trust.admin_names()}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users may write it (mode {stat.S_IMODE(info.st_mode):04o})"
    if info.st_nlink != 1:  # another entry's file linked here (fs.protected_hardlinks=0)
        return f"it has {info.st_nlink} hard links (an entry is written once, never linked)"
    return None


def check_entry(path: Path, trust: CacheTrust) -> str | None:
    """None when ``path`` is a usable cache entry; '' when nothing is there; else why not."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return ""
    return why_untrusted(info, trust)


def check_layout_folder(folder: Path, trust: CacheTrust, shared: bool) -> None:
    """A cache folder must be a real directory; in a shared cache owned by root or the
    service account; if others may write it, sticky.  Raises ConvertError naming the fix."""
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConvertError(f"{folder} is not a directory (a link or a file stands there)",
                           hint="remove it; imgpipe makes its cache folders itself")
    if shared and info.st_uid not in trust.admins:
        raise ConvertError(
            f"cache folder {folder} belongs to {user_name(info.st_uid)}, a job user: in a "
            f"shared cache only {trust.admin_names()} may own it",
            hint=f"as root: mv {folder} {folder}.suspect && imgpipe node-config "
            f"--make-cache {folder_root(folder)}")
    if not shared and not trust.trusts(info.st_uid):
        raise ConvertError(f"cache folder {folder} belongs to {user_name(info.st_uid)}",
                           hint="use a squashfs folder of your own, or a shared one set up "
                           "by imgpipe node-config --make-cache")
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not info.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(info.st_mode)
        raise ConvertError(f"cache folder {folder} is writable by other users without the "
                           f"sticky bit (mode {mode:04o}): they could swap its files",
                           hint=f"chmod {mode | stat.S_ISVTX:04o} {folder}")


def folder_root(folder: Path) -> Path:
    """The cache root a layout folder belongs to (the folder above ``.imgpipe``)."""
    for parent in (folder, *folder.parents):
        if parent.name == ".imgpipe":
            return parent.parent
    return folder
