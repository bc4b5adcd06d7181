"""Daemons imgpipe starts and stops: their pid files, who they are, their logs.

A pid file or a log in a folder someone else could write is an attack surface for root: a
planted pid file makes ``down`` kill another user's process, a planted ``access.log`` link
makes a daemon append to /etc/shadow.  So pid files and logs are never opened through a link,
logs are made exclusively (or are the caller's own regular file with one link), and a pid is
signalled only after its command line shows it is the daemon imgpipe started (the config
file it was started with) and its owner is one the caller may signal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from imgpipe.base.errors import ImgpipeError

__all__ = ["Daemon", "daemon_in_file", "open_log", "pid_in_file"]


def pid_in_file(pid_file: str | os.PathLike[str]) -> int | None:
    """The pid a daemon's pid file names, when that process still lives (one of another
    user counts: signalling it is refused, but it is there).  The file is never read through
    a link."""
    try:
        fd = os.open(pid_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd) as handle:
            pid = int(handle.read(64).strip())
    except (OSError, ValueError):
        return None
    if pid <= 1:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


@dataclass(frozen=True)
class Daemon:
    """A live process a pid file names, and whether it is the daemon imgpipe started."""

    pid: int
    uid: int          # its real uid
    command: str      # its command line, NULs as spaces (nginx rewrites its own)
    ours: bool        # the command line carries what imgpipe started it with

    def check_signal(self, what: str) -> None:
        """Refuse, in one line, to signal a process this one may not or must not stop."""
        if not self.ours:
            raise ImgpipeError(f"{what}: pid {self.pid} is not the process imgpipe started "
                               f"(its command line is {self.command[:120]!r}): not signalled",
                               hint="the pid file is stale or was planted: remove "
                               "it once you have checked nothing of imgpipe's runs")
        if os.geteuid() not in (0, self.uid):
            owner = _account(self.uid)
            who = owner if self.uid == 0 else f"{owner} or root"
            raise ImgpipeError(f"{what} runs as {owner} (pid {self.pid}): only {who} can "
                               "stop it", hint=f"ask {owner} to stop it")


def _account(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def daemon_in_file(pid_file: str | os.PathLike[str], marker: str) -> Daemon | None:
    """The live process ``pid_file`` names, with whether its command line holds ``marker``
    (the config path imgpipe started it with); None when nothing lives there."""
    pid = pid_in_file(pid_file)
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            command = handle.read(8192).replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/status") as handle:
            uid = next(int(line.split()[1]) for line in handle if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None  # gone meanwhile
    return Daemon(pid, uid, command, f" {marker} " in f" {command} ")


def open_log(log_path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """A daemon's log, opened for appending: made exclusively, or an existing regular file
    of this user's (or root's) with one link; never through a link.  The caller closes it."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(log_path, flags | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        pass
    try:
        fd = os.open(log_path, flags)
    except OSError as exc:
        raise ImgpipeError(f"{log_path} is not a regular file ({exc.strerror}): refused",
                           hint="remove it: logs are never opened through a link"
                           ) from None
    info = os.fstat(fd)
    if not (info.st_mode & 0o170000 == 0o100000 and info.st_uid in (0, os.geteuid())
            and info.st_nlink == 1):
        os.close(fd)
        raise ImgpipeError(f"{log_path} is not a log of yours alone (owner uid {info.st_uid}, "
                           f"{info.st_nlink} link(s)): refused",
                           hint="remove it, then start again")
    return fd
