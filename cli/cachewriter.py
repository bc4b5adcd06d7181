"""``imgpipe-cache-writer [--config FILE] REPOSITORY@sha256:HEX``: the service account's
conversion for every user (``imgpipe.commands.node.cachewriter``), run by the importer through the
sudoers line a site writes.  It prints the shared entry's path; anything else is one line on
stderr and exit 1 (2 for a call of the wrong form)."""

from __future__ import annotations

import os
import stat
import sys

USAGE = "usage: imgpipe-cache-writer [--config FILE] REPOSITORY@sha256:HEX"
SITE_CONFIG = "/etc/imgpipe/imgpipe.yaml"


def _trusted_config(path: str) -> str | None:
    """Why ``path`` may not configure the writer, or None: it must be a regular file root or
    this account owns, that nobody else may write (a job user's would choose the cache)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(info.st_mode) or info.st_uid not in (0, os.getuid()) \
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path}: the cache writer reads only a config root or this account owns and "
                f"nobody else may write (uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):04o})")
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = SITE_CONFIG
    if len(args) == 3 and args[0] == "--config":
        config, args = args[1], args[2:]
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    why = _trusted_config(config)
    if why is not None:
        print(f"imgpipe-cache-writer: error: {why}", file=sys.stderr)
        return 1
    # sudo keeps the caller's umask: a job user's 077 would leave the shared entries (and
    # their blobs) unreadable to every other user.  The writer's files are its own choice.
    os.umask(0o022)
    from pathlib import Path

    from imgpipe.base.configlayers import parse_settings
    from imgpipe.base.errors import ImgpipeError
    from imgpipe.base.terminal import safe_line
    from imgpipe.commands.node.cachewriter import write_shared

    def say(text: str) -> None:
        print(safe_line(f"imgpipe-cache-writer: {text}"), file=sys.stderr, flush=True)

    try:
        written = write_shared(parse_settings(Path(config)), args[0], say=say)
    except ImgpipeError as exc:
        say(f"error: {exc}")
        return 1
    except OSError as exc:  # whatever stands at a shared name (a folder, say): one line
        say(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        return 1
    print(written.path, flush=True)
    return 0


def run() -> None:
    from imgpipe.base.signals import raise_on_sigterm

    raise_on_sigterm()
    sys.exit(main())
