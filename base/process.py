"""The one place imgpipe starts external programs.

Argv is always a list, stdin is closed unless input is given, stderr is
captured and shown only when the program fails, and every call has a timeout.
Argv is logged at debug level; the environment never is (it may hold secrets).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from imgpipe.base.daemon import open_log
from imgpipe.base.errors import CommandError, ToolMissingError

log = logging.getLogger(__name__)

# Debian package that provides each program imgpipe may call, for hints.
PACKAGE_OF = {
    "docker": "docker.io",
    "dockerd": "docker.io",
    "docker-registry": "docker-registry",
    "mksquashfs": "squashfs-tools",
    "unsquashfs": "squashfs-tools",
    "tar2sqfs": "squashfs-tools-ng",
    "sbatch": "slurm-wlm",
    "srun": "slurm-wlm",
    "shellcheck": "shellcheck",
    "debootstrap": "debootstrap",
    "htpasswd": "apache2-utils",
    "nginx": "nginx-light",
    "enroot": "enroot (https://github.com/NVIDIA/enroot/releases)",
    "ch-run": "charliecloud-runtime",
    "squashfuse": "squashfuse",
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "ip": "iproute2",
    "unshare": "util-linux",
    "runuser": "util-linux",
}

DEFAULT_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1
F_SETPIPE_SZ = 1031  # fcntl: resize a pipe (Linux)


def die_with_parent() -> None:
    """In a child, before exec: SIGKILL it when imgpipe dies, even by kill -9 (Linux
    PR_SET_PDEATHSIG), so no tar2sqfs, mksquashfs or docker push outlives its caller."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the explicit kill on exceptions still applies
STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class Completed:
    """What a finished program left: argv, exit code and its captured output."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def which(program: str) -> str | None:
    """Path of ``program`` on PATH, or None."""
    return shutil.which(program)


def require(program: str) -> str:
    """Path of ``program``; raises ToolMissingError naming the package to install."""
    path = which(program)
    if path is None:
        package = PACKAGE_OF.get(os.path.basename(program), program)
        raise ToolMissingError(
            f"{program} is not installed", argv=[program], hint=f"install {package}"
        )
    return path


def run(
    argv: Sequence[str],
    *,
    input_text: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    what: str | None = None,
) -> Completed:
    """Run ``argv`` and return its output; raise CommandError when it fails.

    ``input_text`` is the only way data (passwords included) reaches the
    program's stdin.  ``what`` names the step in the error message.
    """
    argv = [str(a) for a in argv]
    require(argv[0])
    log.debug("run: %s", shlex.join(argv))
    full_env = None if env is None else {**os.environ, **env}
    try:
        proc = subprocess.run(
            argv,
            input=input_text,
            stdin=None if input_text is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
            check=False,
            preexec_fn=die_with_parent,
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandError(
            f"{what or argv[0]} did not finish within {timeout:.0f} s",
            argv=argv,
            stderr=_text(exc.stderr),
        ) from exc
    except OSError as exc:
        raise CommandError(f"cannot run {argv[0]}: {exc.strerror}", argv=argv) from exc
    done = Completed(argv, proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise CommandError(
            f"{what or shlex.join(argv[:3])} failed (exit {proc.returncode}): "
            f"{last_line(proc.stderr) or last_line(proc.stdout)}",
            argv=argv,
            returncode=proc.returncode,
            stderr=proc.stderr[-STDERR_TAIL_CHARS:],
        )
    return done


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, stripped (for one-line errors)."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data


def stream(
    argv: Sequence[str],
    on_line: Callable[[str], None],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    what: str | None = None,
) -> Completed:
    """Run ``argv`` with stdout and stderr merged, handing each line to ``on_line``.

    For long work that reports progress (builds, pushes).  The last lines are
    kept for the error when it fails; the timeout kills it.
    """
    argv = [str(a) for a in argv]
    require(argv[0])
    log.debug("stream: %s", shlex.join(argv))
    full_env = None if env is None else {**os.environ, **env}
    tail: deque[str] = deque(maxlen=40)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                env=full_env, cwd=cwd, bufsize=1, preexec_fn=die_with_parent)
    except OSError as exc:
        raise CommandError(f"cannot run {argv[0]}: {exc.strerror}", argv=argv) from exc
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    started = time.monotonic()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
    output = "\n".join(tail)
    if proc.returncode != 0:
        if time.monotonic() - started >= timeout:
            message = f"{what or argv[0]} did not finish within {timeout:.0f} s"
        else:
            message = (f"{what or shlex.join(argv[:3])} failed (exit {proc.returncode}): "
                       f"{last_error_line(output)}")
        raise CommandError(message, argv=argv, returncode=proc.returncode,
                           stderr=output[-STDERR_TAIL_CHARS:])
    return Completed(argv, proc.returncode, output, "")


def last_error_line(text: str) -> str:
    """The line that best explains a failure: the last one mentioning an error, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        lowered = line.lower()
        if "error" in lowered or "failed" in lowered or "denied" in lowered:
            return line
    return lines[-1] if lines else ""


@dataclass
class Spawned:
    """A daemon :func:`spawn` started: its pid, and whether it has exited yet."""

    pid: int
    _proc: subprocess.Popen[bytes]

    def exited(self) -> bool:
        return self._proc.poll() is not None


def spawn(argv: Sequence[str], log_path: str | os.PathLike[str], *,
          env: Mapping[str, str] | None = None, inherit_env: bool = True) -> Spawned:
    """Start a daemon in a process group of its own, output appended to ``log_path``.

    The caller stops it (``os.killpg``).  For services that outlive one call (the sandbox
    cluster's daemons, the head node's registry), never for work whose result is awaited.
    ``inherit_env=False`` gives it ``env`` alone, not this process's environment too.
    """
    argv = [str(a) for a in argv]
    require(argv[0])
    log.debug("spawn: %s", shlex.join(argv))
    full_env = (None if env is None else {**os.environ, **env}) if inherit_env else dict(env or {})
    with os.fdopen(open_log(log_path), "ab") as handle:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=handle,
                                    stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)
        except OSError as exc:
            raise CommandError(f"cannot run {argv[0]}: {exc.strerror}", argv=argv) from exc
    return Spawned(proc.pid, proc)


def feed(argv: Sequence[str], write: Callable[[IO[bytes]], object], *, timeout: float,
         cwd: str | os.PathLike[str] | None = None, pipe_size: int = 0,
         what: str | None = None) -> Completed:
    """Run ``argv`` while ``write`` fills its stdin (a stream too large to hold).

    Returns whatever the exit status (stderr captured); the writer's own error wins over
    the program's, a program that stops reading ends the writing quietly, and the timeout
    (after the input is written) raises CommandError.  ``pipe_size`` widens the pipe.
    """
    argv = [str(a) for a in argv]
    require(argv[0])
    log.debug("feed: %s", shlex.join(argv))
    errors: list[bytes] = []
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, cwd=cwd, bufsize=pipe_size or -1,
                                preexec_fn=die_with_parent)
    except OSError as exc:
        raise CommandError(f"cannot run {argv[0]}: {exc.strerror}", argv=argv) from exc
    assert proc.stdin is not None and proc.stderr is not None
    if pipe_size:
        with contextlib.suppress(OSError):  # a smaller pipe still works, only slower
            fcntl.fcntl(proc.stdin.fileno(), F_SETPIPE_SZ, pipe_size)
    stderr = proc.stderr
    reader = threading.Thread(target=lambda: errors.extend(stderr), daemon=True)
    reader.start()
    try:
        write(proc.stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the program stopped reading: its exit status says why
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait()
        raise CommandError(f"{what or argv[0]} did not finish within {timeout:.0f} s",
                           argv=argv) from exc
    reader.join(5)
    return Completed(argv, code, "", b"".join(errors).decode(errors="replace"))


def attached(argv: Sequence[str]) -> int:
    """Run ``argv`` on this terminal (stdin, stdout and stderr inherited); its exit status.

    For commands a person runs through imgpipe interactively (``imgpipe sandbox run``).
    """
    argv = [str(a) for a in argv]
    require(argv[0])
    log.debug("attached: %s", shlex.join(argv))
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as exc:
        raise CommandError(f"cannot run {argv[0]}: {exc.strerror}", argv=argv) from exc


class Producer:
    """A program whose stdout this process reads as it goes (a pipe of ``pipe_size``
    bytes), stderr kept for the error message; it dies with imgpipe.  Its stdin is closed,
    or with ``with_input`` a pipe this process writes to (:meth:`send`, :meth:`end_input`)."""

    def __init__(self, argv: Sequence[str], pipe_size: int = 0, with_input: bool = False
                 ) -> None:
        self.argv = [str(a) for a in argv]
        log.debug("producer: %s", shlex.join(self.argv))
        try:
            self._proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE if with_input else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                preexec_fn=die_with_parent)
        except OSError as exc:
            raise CommandError(f"cannot run {self.argv[0]}: {exc.strerror}",
                               argv=self.argv) from exc
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self.fd = self._proc.stdout.fileno()
        if pipe_size:
            with contextlib.suppress(OSError):  # a smaller pipe still works, only slower
                fcntl.fcntl(self.fd, F_SETPIPE_SZ, pipe_size)
        self._errors: list[bytes] = []
        stderr = self._proc.stderr
        self._reader = threading.Thread(target=lambda: self._errors.extend(stderr),
                                        daemon=True)
        self._reader.start()

    def send(self, data: bytes) -> None:
        """Write ``data`` to its stdin (OSError once it has stopped reading)."""
        stdin = self._proc.stdin
        if stdin is None or stdin.closed:
            raise BrokenPipeError("the program's input is closed")
        view = memoryview(data)
        try:
            while view:
                view = view[stdin.write(view) or 0:]
        except ValueError as exc:  # closed meanwhile, by close()
            raise BrokenPipeError("the program's input is closed") from exc

    def end_input(self) -> None:
        """Close its stdin: it reads to the end of its input."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def stderr_tail(self) -> str:
        """The last line of what it said on stderr, once it has ended."""
        self._reader.join(5)
        return last_line(b"".join(self._errors).decode(errors="replace"))

    def close(self) -> int:
        """Stop it if it still runs; its exit status."""
        if self._proc.poll() is None:
            self._proc.kill()
        code = self._proc.wait()
        self.end_input()
        assert self._proc.stdout is not None
        self._proc.stdout.close()
        return code
