"""Who uses which cache entry, and pruning the cache by size or age, least recently used first.

The Pyxis importer records each use: ``get`` makes a marker
``.imgpipe/uses/<squashfs name>~<host>~<uid>~<job>~<step>`` (created exclusively, never
through a link, in the one folder root or the service account made) and ``release``
removes this step's own markers.  The newest marker's time is the entry's last use (a
conversion counts as one).  ``prune``
never removes a squashfs that has markers (a running job may have it mounted) or whose
digest lock is held (a conversion or a verification is running); blobs go first, since
they can be fetched again, then squashfs files, oldest last use first.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.base.files import open_regular
from imgpipe.base.units import human_bytes
from imgpipe.enroot.cache.storage import Storage, digest_hex, make_shared_dir
from imgpipe.enroot.cache.trust import ROOT_UID, check_layout_folder, user_name
from imgpipe.enroot.errors import ConvertError

SQSH_DIGEST = re.compile(r"\+sha256-(?P<hex>[0-9a-f]{64})\+")
PRIVATE = re.compile(r"u[0-9]+")  # tmp/u<uid>: a user's private folder
HEX = re.compile(r"[0-9a-f]{64}")  # a blob's name
@dataclass
class Entry:
    kind: str  # squashfs | blob
    path: Path
    size: int
    last_use: float
    users: list[str] = field(default_factory=list)
    owner: int = -1


@dataclass(frozen=True)
class Pruned:
    removed: list[Entry]
    kept_in_use: list[Entry]
    freed: int
    total_after: int
    not_yours: list[Entry] = field(default_factory=list)  # other users' files: left alone
    unreadable: list[Path] = field(default_factory=list)  # private folders not seen

    def skipped_line(self) -> str | None:
        """One line for what this user could not remove or see, or None."""
        said = []
        if self.not_yours:
            owners = sorted({user_name(entry.owner) for entry in self.not_yours})
            size = human_bytes(sum(entry.size for entry in self.not_yours))
            said.append(f"left {len(self.not_yours)} entries ({size}) that other users own "
                        f"({', '.join(owners)}): prune them as their owner or as root")
        if self.unreadable:
            said.append(unreadable_line(self.unreadable))
        return "; ".join(said) or None


def unreadable_line(folders: list[Path]) -> str:
    """What a listing or a prune could not see: other users' private entries."""
    owners = sorted({user_name(int(folder.name[1:])) for folder in folders})
    return (f"{len(folders)} users' private entries (.imgpipe/tmp/u<uid>: images from a registry "
            f"that asked for a login) are not readable by this account ({', '.join(owners)}): "
            "prune as root, or as each user (their own jobs prune theirs under "
            "enroot.cache_max_size)")


def _markers(storage: Storage, squashfs: Path) -> list[Path]:
    """The use markers of ``squashfs`` (regular files only: anything else is no use)."""
    found = []
    for marker in storage.uses.glob(f"{glob.escape(squashfs.name)}~*"):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISREG(marker.lstat().st_mode):
                found.append(marker)
    return sorted(found)


def marker_name(squashfs: Path, job: str, step: str, uid: int | None = None) -> str:
    uid = os.getuid() if uid is None else uid
    return f"{squashfs.name}~{socket.gethostname()}~{uid}~{job}~{step}"


def record_use(storage: Storage, squashfs: Path, job: str, step: str) -> Path:
    """Mark ``squashfs`` as in use by this step; returns the marker.  The uses folder is
    the layout's (made by root or the service account in a shared cache; by you in your
    own), never one a job user made."""
    folder = storage.uses
    if not folder.is_dir() and not storage.shared:  # your own cache: you make its layout
        for made, mode in storage.layout():
            if made in (storage.meta, folder):
                make_shared_dir(made, mode)
    check_layout_folder(folder, storage.trust, storage.shared)
    marker = storage.use_marker(marker_name(squashfs, job, step))
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except FileExistsError:
        with contextlib.suppress(PermissionError):
            os.utime(marker, follow_symlinks=False)  # used again: the use is now
    return marker


def release_use(marker: Path) -> None:
    """End one recorded use (idempotent: Pyxis calls release more than once)."""
    marker.unlink(missing_ok=True)


def entries(storage: Storage) -> list[Entry]:
    """Every squashfs file and blob of the cache, with size, last use and users: the shared
    ones, and each user's private ones (``tmp/u<uid>``, an image whose registry asked for a
    login) in the folders this account may read (its own; every one as root)."""
    storage.check_admin_path()
    found = [*_squashfs_entries(storage, sorted(storage.root.glob("*.sqsh"))),
             *_blob_entries(storage.blobs)]
    for folder in private_folders(storage):
        with contextlib.suppress(PermissionError, FileNotFoundError):
            found += _squashfs_entries(storage, sorted(folder.glob("*.sqsh")))
            found += _blob_entries(folder, hex_names=True)
    return found


def private_folders(storage: Storage) -> list[Path]:
    """Every user's private folder (``tmp/u<uid>``, a folder that user owns), readable or
    not by this account."""
    found = []
    with contextlib.suppress(FileNotFoundError, PermissionError):
        for folder in sorted(storage.tmp.iterdir()):
            if not PRIVATE.fullmatch(folder.name):
                continue
            info = folder.lstat()
            if stat.S_ISDIR(info.st_mode) and info.st_uid == int(folder.name[1:]):
                found.append(folder)
    return found


def unreadable_private(storage: Storage) -> list[Path]:
    """The private folders this account cannot read (another user's, unless root)."""
    return [folder for folder in private_folders(storage) if not os.access(folder, os.R_OK
                                                                           | os.X_OK)]


def _squashfs_entries(storage: Storage, paths: list[Path]) -> list[Entry]:
    found = []
    for path in paths:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            continue
        last = info.st_mtime
        users: list[str] = []
        for marker in _markers(storage, path):
            with contextlib.suppress(FileNotFoundError):
                last = max(last, marker.lstat().st_mtime)
                users.append(marker.name[len(path.name) + 1:])  # host~uid~job~step
        found.append(Entry("squashfs", path, info.st_size, last, users, info.st_uid))
    return found


def _blob_entries(folder: Path, hex_names: bool = False) -> list[Entry]:
    """The blobs in ``folder`` (a private folder: only the files named by a digest's hex;
    partial downloads, configs and work areas are not entries)."""
    found: list[Entry] = []
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or hex_names and not HEX.fullmatch(path.name):
            continue
        info = path.lstat()
        if stat.S_ISREG(info.st_mode):
            found.append(Entry("blob", path, info.st_size, info.st_mtime, owner=info.st_uid))
    return found


@contextlib.contextmanager
def _locked_now(storage: Storage, squashfs: Path) -> Iterator[bool]:
    """The digest's lock if it is free at once, else None (never waits)."""
    match = SQSH_DIGEST.search(squashfs.name)
    if match is None:
        yield True
        return
    held: list[int] = []
    try:
        # The shared lock and every user's own lock of that digest.
        for path in sorted(storage.locks.glob(f"{digest_hex('sha256:' + match['hex'])}*.lock")):
            try:
                fd = open_regular(path, os.O_RDWR if os.access(path, os.W_OK) else os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                yield False
                return
            held.append(fd)
        yield True
    finally:
        for fd in held:
            fcntl.lockf(fd, fcntl.LOCK_UN)
            os.close(fd)


def prune(storage: Storage, max_size: int | None = None, unused_for_s: float | None = None,
          dry_run: bool = False, keep: frozenset[Path] = frozenset()) -> Pruned:
    """Remove entries until the cache holds at most ``max_size`` bytes, or every entry
    unused for ``unused_for_s``; blobs before squashfs files, least recently used first.
    What this user may not remove (another user's file in a sticky folder) is left, listed
    in ``not_yours``, never an error: a job's ``get`` prunes, and must not fail for it.
    ``keep``: entries never removed (the one a conversion just made, not yet marked used)."""
    if max_size is None and unused_for_s is None:
        raise ConvertError("say how much to prune", hint="--max-size SIZE or --unused-for DAYS")
    listed = entries(storage)
    total = sum(e.size for e in listed)
    now = time.time()
    order = sorted(listed, key=lambda e: (e.kind != "blob", e.last_use))
    removed: list[Entry] = []
    kept: list[Entry] = []
    not_yours: list[Entry] = []
    for entry in order:
        too_big = max_size is not None and total > max_size
        too_old = unused_for_s is not None and now - entry.last_use > unused_for_s
        if not (too_big or too_old):
            continue
        if entry.users or entry.path in keep:
            kept.append(entry)
            continue
        if not _may_remove(storage, entry):
            not_yours.append(entry)
            continue
        if entry.kind == "squashfs":
            with _locked_now(storage, entry.path) as free:
                if not free or _markers(storage, entry.path):
                    kept.append(entry)
                    continue
                gone = _remove(entry, dry_run)
        else:
            gone = _remove(entry, dry_run)
        if gone is None:
            not_yours.append(entry)
        elif gone:
            removed.append(entry)
            total -= entry.size
    return Pruned(removed, kept, sum(e.size for e in removed), total, not_yours,
                  unreadable_private(storage))


def _may_remove(storage: Storage, entry: Entry) -> bool:
    """Whether this user may remove ``entry``: its own file, or any as root or the owner of a
    sticky folder (the service account owns the layout it made)."""
    if storage.trust.me in (ROOT_UID, entry.owner):
        return True
    try:
        folder = entry.path.parent.lstat()
    except OSError:
        return False
    return folder.st_uid == storage.trust.me or not folder.st_mode & stat.S_ISVTX


def _remove(entry: Entry, dry_run: bool) -> bool | None:
    """True: removed (or would be); False: gone already; None: not this user's to remove."""
    if dry_run:
        return True
    try:
        entry.path.unlink()
    except FileNotFoundError:
        return False
    except PermissionError:
        return None
    return True
