"""One digest's lock in the cache: exclusive, over NFS too, and safe beside hostile users.

A conversion (or a verification) of a digest holds its lock, so processes on one host or
many serialize and all end with the same file.  ``fcntl.lockf`` works over NFS.  The lock
file is opened without following links and only as a regular file; a shared one is made
exclusively, 0666 (every user must be able to open it), a job user's own one 0600.  The
holder writes who it is into the file: a waiter hears it once, escaped (any user could
write it), and gives up after the timeout with one line naming the holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from imgpipe.base.regular import open_regular
from imgpipe.base.terminal import shown
from imgpipe.enroot.cache.trust import CacheTrust, user_name
from imgpipe.enroot.errors import ConvertError


@contextlib.contextmanager
def digest_lock(path: Path, digest: str, trust: CacheTrust, private: bool,
                not_shared: Callable[[OSError], ConvertError],
                on_wait: Callable[[str], None] | None, timeout_s: float) -> Iterator[None]:
    """Hold the lock at ``path`` (``private``: a job user's own); ``not_shared`` turns a
    refused open into the cache's error."""
    try:
        fd = _open_lock_file(path, trust, private)
    except PermissionError as exc:
        raise not_shared(exc) from exc
    with os.fdopen(fd, "r+") as handle:
        if not _try_lock(handle, path):
            holder = _holder(handle)
            if on_wait:
                on_wait(f"waiting for {holder}, which is converting {digest[:19]}")
            _wait_lock(handle, path, timeout_s, lambda: (
                f"gave up after {timeout_s:.0f} s waiting for the lock of {digest[:19]} "
                f"({path}), held by {_holder(handle)}"))
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


def _try_lock(handle: IO[str], path: Path) -> bool:
    """Taken (True) or held by another process (False); a file system that gives no locks at
    all is said at once, not waited on for lock_timeout_s."""
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise ConvertError(f"the file system of {path} gives no file locks "
                           f"({os.strerror(exc.errno or 0)})",
                           hint="Lustre: mount it with -o flock on every node (localflock is "
                           "node-local only); NFS: lockd must run") from exc
    return True


def _wait_lock(handle: IO[str], path: Path, timeout_s: float,
               gave_up: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while not _try_lock(handle, path):
        if time.monotonic() >= deadline:
            raise ConvertError(gave_up(), hint="if that process is gone or hung, end it (or "
                               "raise enroot.lock_timeout_s for very large images)")
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _holder(handle: IO[str]) -> str:
    """Who holds the lock, as its holder wrote it (any user could write it: shown escaped)."""
    handle.seek(0)
    return shown(handle.read(200).strip()) or "another process"


def _open_lock_file(path: Path, trust: CacheTrust, private: bool) -> int:
    """An fd of the lock file, read-write, never through a link and never anything but a
    regular file.  A shared lock is created exclusively and 0666 when missing (fcntl locks
    need a file every user can open); a job user's own lock is 0600 and must be its own.
    An existing one is opened without O_CREAT, which protected_regular refuses for another
    user's file in a sticky folder."""
    for _ in range(5):
        try:
            fd = open_regular(path, os.O_RDWR)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ConvertError(f"lock file {path}: {exc.strerror}",
                               hint=f"something was planted there: as root, remove it ({path})"
                               ) from exc
        else:
            owner = os.fstat(fd).st_uid
            if private and owner != trust.me:
                os.close(fd)
                raise ConvertError(f"lock file {path} belongs to {user_name(owner)}, not you: "
                                   "refused", hint=f"it was planted: as root, remove {path}")
            return fd
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_CREAT | os.O_EXCL,
                         0o600 if private else 0o666)
        except FileExistsError:
            continue  # created by another process in between: open it
        os.fchmod(fd, 0o600 if private else 0o666)
        return fd
    raise ConvertError(f"cannot open lock file {path}: it keeps disappearing")
