"""Atomic file publication: write to a unique temporary name, then rename.

Every file imgpipe publishes (lock file, rendered recipes, cache entries,
registry configuration) goes through :func:`atomic_write` or
:func:`atomic_path`, so a reader never sees a half-written file and a crash
leaves only ``.tmp-`` files that are safe to delete.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.regular import open_regular

TMP_PREFIX = ".tmp-"


OWNER = re.compile(r"~(?P<host>[^~/]+)~(?P<pid>\d+)~(?P<start>\d+)(?:~[0-9a-f]+)?$")
STALE_AFTER_S = 24 * 3600  # a leftover of another host untouched this long has no owner


def _start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (pids are reused; this is not)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat_line.rsplit(")", 1)[1].split()[19])


def owner_tag() -> str:
    """``~host~pid~start``: who made a temporary, so any later run can tell it is orphaned."""
    return f"~{socket.gethostname()}~{os.getpid()}~{_start_time(os.getpid()) or 0}"


def orphaned(name: str, mtime: float, now: float) -> bool:
    """True when the temporary ``name`` was made by a process that is gone: on this host a
    dead pid (or a reused one), elsewhere nothing written for STALE_AFTER_S."""
    match = OWNER.search(name)
    if match is None:
        return False  # not ours to judge
    if match["host"] != socket.gethostname():
        return now - mtime > STALE_AFTER_S
    return _start_time(int(match["pid"])) != int(match["start"])


def temporary_name(final: Path) -> Path:
    """A name beside ``final``, unique per host and process and not guessable: in a folder
    other users write (the shared squashfs cache), a name they could predict is a name they
    could plant a link at.  It ends with its owner (``~host~pid~start~random``)."""
    return final.with_name(f"{TMP_PREFIX}{final.name}{owner_tag()}~{os.urandom(6).hex()}")


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str], mode: int | None = None,
                create: bool = True) -> Iterator[Path]:
    """Yield a temporary path; on success rename it onto ``final``, else remove it.

    The temporary file is created here, exclusively and never through a link
    (``O_EXCL | O_NOFOLLOW``, mode 0600), and created, renamed and removed relative to a
    descriptor of the folder opened without following a link, so a folder swapped for a
    link afterwards cannot redirect any of it.  ``create=False`` leaves the name free for a
    program that refuses existing outputs.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(final)
    folder = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if create:
            try:
                os.close(os.open(tmp.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600, dir_fd=folder))
            except OSError as exc:  # name the whole path, not the one relative to the fd
                raise OSError(exc.errno, exc.strerror, str(tmp)) from exc
        try:
            yield tmp
            # The temporary started private; without a mode, publish what open() would
            # have made (0666 less the umask): other users read shared cache files.
            final_mode = 0o666 & ~_umask() if mode is None else mode
            fd = os.open(tmp.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
            try:
                os.fchmod(fd, final_mode)
            finally:
                os.close(fd)
            os.replace(tmp.name, final.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp.name, dir_fd=folder)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and not exc.filename:
                # A failed write names no file: say which one could not be published.
                raise OSError(errno.ENOSPC, exc.strerror, str(final)) from exc
            raise
    finally:
        os.close(folder)


def _umask() -> int:
    """The process umask, read without changing it (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file at ``path`` (see :func:`open_regular`)."""
    with os.fdopen(open_regular(path), "rb") as handle:
        return handle.read()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's content, read in 1 MiB blocks (a regular file, no link)."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(final: str | os.PathLike[str], data: str | bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``final`` atomically (fsync before the rename)."""
    with atomic_path(final, mode) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
    return Path(final)


SQUASHFS_MAGIC = b"hsqs"  # little-endian squashfs superblock


@dataclass(frozen=True)
class SquashfsPath:
    """A squashfs file a job can start: an absolute path to a regular file (never a link)
    that begins with the squashfs magic.  Made where the file is checked (a conversion, the
    lock's record), carried as is to the recipes, which write it where Enroot or ch-run
    reads it."""

    path: Path

    @classmethod
    def checked(cls, path: str | os.PathLike[str]) -> SquashfsPath | None:
        """``path`` when it is such a file here, else None."""
        candidate = Path(path)
        if not candidate.is_absolute():
            return None
        try:
            info = candidate.lstat()
            if not stat.S_ISREG(info.st_mode):
                return None
            with open(candidate, "rb") as handle:
                if handle.read(4) != SQUASHFS_MAGIC:
                    return None
        except OSError:
            return None
        return cls(candidate)

    def __str__(self) -> str:
        return str(self.path)
