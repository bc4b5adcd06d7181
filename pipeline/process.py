"""The one place imgpipe starts external programs.

Argv is always a list, stdin is closed unless input is given, stderr is
captured and shown only when the program fails, and every call has a timeout.
Argv is logged at debug level; the environment never is (it may hold secrets).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from imgpipe.pipeline.errors import CommandError, ToolMissingError

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
    "enroot": "enroot (https://github.com/NVIDIA/enroot/releases)",
}

DEFAULT_TIMEOUT_S = 300.0
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
