"""The shared squashfs directory: one class owns its layout and its locks.

Layout under ``root`` (the cluster filesystem, shared by every node)::

    <repo>+sha256-<hex>+<compression>-f<N>.sqsh
                                  published squashfs files, keyed by manifest digest,
                                  compression and FORMAT (what a conversion puts in one)
    .imgpipe/VERSION              layout version
    .imgpipe/CACHEDIR.TAG         tells backup tools this is a cache
    .imgpipe/blobs/sha256/<hex>   verified registry blobs, shared by all images
    .imgpipe/locks/<hex>.lock     one lock per digest (fcntl.lockf: works over NFS)
    .imgpipe/tmp/                 work areas of running conversions

Temporary names carry host and PID, so processes on many hosts never collide;
whoever holds a digest's lock may delete any temporary of that digest, since
nobody else can be writing it.

Shared by every user: Pyxis runs the importer as the job's user, so on a cluster the
root folder is world-writable with the sticky bit (``install -d -m 1777``) or
group-writable with setgid and sticky (3775).  A cache folder that others may write
without the sticky bit is refused: they could rename files away and plant their own.
The folders imgpipe creates under it take the root's mode; lock files are created
once, exclusively, readable and writable by all (fcntl locks need a file every user
can open), and opened without following links.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from imgpipe.base.files import TMP_PREFIX, atomic_write, orphaned, owner_tag
from imgpipe.enroot.errors import ConvertError

LAYOUT_VERSION = "1"
# The content a conversion makes, beyond the layers: bumped when it changes (2: empty
# /etc/hosts and /etc/resolv.conf mount points, layers verified against their diff_ids),
# so a file made by an older imgpipe is never returned for a newer one's key.
FORMAT = "2"
RAM_DIR = Path("/dev/shm")
RAM_RESERVE = 1 << 30  # leave this much of /dev/shm to everyone else
CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This directory holds imgpipe's squashfs and blob cache.\n")


def digest_hex(digest: str) -> str:
    algorithm, _, hexpart = digest.partition(":")
    if algorithm != "sha256" or len(hexpart) != 64:
        raise ConvertError(f"not a sha256 digest: {digest!r}")
    return hexpart


class Storage:
    """Paths and locks of one shared squashfs directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def meta(self) -> Path:
        return self.root / ".imgpipe"

    @property
    def blobs(self) -> Path:
        return self.meta / "blobs" / "sha256"

    @property
    def locks(self) -> Path:
        return self.meta / "locks"

    @property
    def tmp(self) -> Path:
        return self.meta / "tmp"

    def _shared_mode(self) -> int:
        """Mode for the folders imgpipe creates: the root's (sticky and setgid kept)."""
        return stat.S_IMODE(self.root.stat().st_mode) & 0o3777

    def prepare(self) -> None:
        """Create the layout (idempotent); refuse a layout of another version, and folders
        another user could swap entries in."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            _check_folder(self.root)
            mode = self._shared_mode()
            for folder in (self.meta, self.blobs.parent, self.blobs, self.locks, self.tmp):
                if not make_shared_dir(folder, mode):
                    _check_folder(folder)
            version_file = self.meta / "VERSION"
            if version_file.exists():
                found = version_file.read_text().strip()
                if found != LAYOUT_VERSION:
                    raise ConvertError(f"{self.root} holds a cache of layout {found}, "
                                       f"this imgpipe uses {LAYOUT_VERSION}",
                                       hint="use another outputs.squashfs_dir")
            else:
                _publish_once(version_file, LAYOUT_VERSION + "\n")
            tag = self.meta / "CACHEDIR.TAG"
            if not tag.exists():
                _publish_once(tag, CACHEDIR_TAG)
        except PermissionError as exc:
            raise self._not_shared(exc) from exc
        except OSError as exc:
            raise ConvertError(f"cannot use squashfs directory {self.root}: {exc.strerror}",
                               hint="set outputs.squashfs_dir to a writable folder") from exc

    def _not_shared(self, exc: OSError) -> ConvertError:
        where = exc.filename or self.root
        return ConvertError(
            f"squashfs directory {self.root}: permission denied on {where}",
            hint=f"every job user must be able to write it: chmod 1777 {self.root} (or 3775 "
            "with a group of all job users); see imgpipe node-config")

    def blob(self, digest: str) -> Path:
        return self.blobs / digest_hex(digest)

    def squashfs(self, repository: str, digest: str, compression: str) -> Path:
        """Where the squashfs of (digest, compression, FORMAT) is published."""
        return self.root / (f"{repository.replace('/', '+')}+sha256-{digest_hex(digest)}"
                            f"+{compression}-f{FORMAT}.sqsh")

    def find_squashfs(self, digest: str, compression: str) -> Path | None:
        """The published file for ``digest`` in ``compression``, whatever repository it came
        from; a regular file only (a link planted there is not an answer)."""
        pattern = f"*+sha256-{digest_hex(digest)}+{compression}-f{FORMAT}.sqsh"
        for match in sorted(self.root.glob(pattern)):
            if match.is_file() and not match.is_symlink():
                return match
        return None

    @contextlib.contextmanager
    def lock(self, digest: str, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold the digest's exclusive lock; ``on_wait`` hears who holds it, once."""
        path = self.locks / f"{digest_hex(digest)}.lock"
        try:
            fd = _open_lock_file(path)
        except PermissionError as exc:
            raise self._not_shared(exc) from exc
        with os.fdopen(fd, "r+") as handle:
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                if on_wait:
                    on_wait(f"waiting for {holder}, which is converting {digest[:19]}")
                fcntl.lockf(handle, fcntl.LOCK_EX)
            handle.seek(0)
            handle.truncate()
            handle.write(f"{socket.gethostname()}:{os.getpid()} since {time.strftime('%c')}\n")
            handle.flush()
            try:
                yield
            finally:
                handle.seek(0)
                handle.truncate()
                handle.flush()
                fcntl.lockf(handle, fcntl.LOCK_UN)

    def clean_stale(self, digest: str) -> int:
        """Delete leftovers of crashed conversions of ``digest`` (call with its lock held)."""
        hexpart = digest_hex(digest)
        removed = 0
        # /dev/shm is the whole host's, not this cache's: another cache (another user, another
        # site folder) may be converting the same digest there under its own lock, so only
        # work trees whose process is gone are leftovers.
        now = time.time()
        in_ram = [path for path in (RAM_DIR.glob(f"imgpipe-{hexpart}~{socket.gethostname()}~*")
                                    if RAM_DIR.is_dir() else [])
                  if orphaned(path.name, path.lstat().st_mtime, now)]
        for leftover in [*self.root.glob(f"{TMP_PREFIX}*sha256-{hexpart}*.sqsh.*"),
                         *self.tmp.glob(f"{hexpart}.*"),
                         *self.tmp.glob(f"{hexpart}~*"), *in_ram]:
            # In a sticky shared folder only the owner may delete: another user's
            # leftover stays until its owner (or an admin) converts again.
            with contextlib.suppress(PermissionError):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)
                else:
                    leftover.unlink(missing_ok=True)
                removed += 1
        return removed

    def sweep(self) -> int:
        """Remove what crashed runs left, whatever digest: partial blobs, partial squashfs
        files and work trees (also in /dev/shm) whose owner is gone (a dead pid on this
        host; on another host, nothing written for a day).  Returns how many."""
        now = time.time()
        candidates = [*self.root.glob(f"{TMP_PREFIX}*"), *self.blobs.glob(f"{TMP_PREFIX}*"),
                      *self.tmp.glob("*~*")]
        if RAM_DIR.is_dir():
            candidates += RAM_DIR.glob(f"imgpipe-*~{socket.gethostname()}~*")
        removed = 0
        for path in candidates:
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            if not orphaned(path.name, info.st_mtime, now):
                continue
            with contextlib.suppress(FileNotFoundError, PermissionError):
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed += 1
        return removed

    def work_dir(self, digest: str, needs_bytes: int = 0) -> Path:
        """A private work area for this process's conversion of ``digest``.

        In RAM (``/dev/shm``) when ``needs_bytes`` fits there with room to spare:
        an unpacked tree is thrown away after squashing, and on a busy disk its
        writeback dominated (bert's tree: 32 s on disk, 6 s in RAM).
        """
        name = f"{digest_hex(digest)}{owner_tag()}"
        parent = self.tmp
        if needs_bytes and RAM_DIR.is_dir():
            free = shutil.disk_usage(RAM_DIR).free
            if free > needs_bytes * 1.25 + RAM_RESERVE:
                parent = RAM_DIR
                name = f"imgpipe-{name}"
        path = parent / name
        path.mkdir(parents=True, exist_ok=False)
        return path


def _open_lock_file(path: Path) -> int:
    """An fd of the lock file, read-write, never through a link.  Created exclusively and
    0666 when missing (fcntl locks need every user to open it); an existing one is opened
    without O_CREAT, which protected_regular refuses for another user's file in a sticky
    folder."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(5):
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # created by another process in between: open it
        os.fchmod(fd, 0o666)
        return fd
    raise ConvertError(f"cannot open lock file {path}: it keeps disappearing")


def _publish_once(path: Path, text: str) -> None:
    """Write a file every user's run may try to write first: whoever loses the race (in a
    sticky folder the rename onto another user's file is refused) finds it there."""
    try:
        atomic_write(path, text)
    except PermissionError:
        if not path.is_file():
            raise


def make_shared_dir(folder: Path, mode: int) -> bool:
    """Create ``folder`` with exactly ``mode`` in one step (True), or find it there (False).
    Not mkdir-then-chmod: between the two, another user's job would meet the umask's mode
    and be refused."""
    old = os.umask(0)
    try:
        os.mkdir(folder, mode)
        return True
    except FileExistsError:
        return False
    finally:
        os.umask(old)


def _check_folder(folder: Path) -> None:
    """A cache folder must be a real directory (not a link to one), and if users other
    than its owner may write it, sticky: else any of them could rename a published file
    or another user's temporary away and put theirs in its place."""
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConvertError(f"{folder} is not a directory (a link or a file stands there)",
                           hint="remove it; imgpipe makes its cache folders itself")
    shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if shared and not info.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(info.st_mode)
        raise ConvertError(f"cache folder {folder} is writable by other users without the "
                           f"sticky bit (mode {mode:04o}): they could swap its files",
                           hint=f"chmod {mode | stat.S_ISVTX:04o} {folder}")
