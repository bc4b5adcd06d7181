"""The audit recorder's work (``imgpipe-audit``, started by ``imgpipe.cli.audit``): one JSON
line per import, appended as root to the log the site config names (``audit.log``).

Job users (and the cache writer's service account) run it as root through one sudoers line::

    ALL ALL=(root) NOPASSWD: /opt/imgpipe/bin/imgpipe-audit --config /etc/imgpipe/imgpipe.yaml *

So anyone may call it, with any arguments after the config, and it is narrow:

- it reads only the config ``--config`` names, walked from ``/`` without following a link
  (``imgpipe.base.adminpath``): a regular file root owns in a folder of root's, that nobody
  else may write;
- of the environment it reads only ``SUDO_UID``, the uid sudo vouches for (sudo sets it and a
  caller cannot), the record's ``uid``; root calling it directly records its own (0);
- it takes exactly six arguments of fixed forms (``Entry.parse``): an event of ``EVENTS``, an
  image reference (``Reference.parse``), a ``sha256:`` digest, the squashfs path, a result of
  ``RESULTS`` and the Slurm job id, each length-capped, no control characters; ``-`` is
  "not known" where one may be missing;
- it appends exactly one line with one ``write()`` under ``flock``, to a regular file root
  owns with no group or other bits and one link, opened without following a link (made
  0600 when missing), in a folder root owns that nobody else may write.

What the line says beyond ``uid``, ``user``, ``host`` and ``time`` is what the caller's importer
said: the audit log vouches for who asked, not for what they named.  It starts on the standard
library, yaml and three small modules of imgpipe's (a job's start waits on it).
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass

from imgpipe.base.adminpath import Admins, open_admin_folder
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.terminal import shown
from imgpipe.registry.errors import ReferenceFormatError
from imgpipe.registry.reference import Reference

EVENTS = ("get", "take", "broadcast", "write")
RESULTS = ("found", "converted", "fetched", "received", "taken", "imported")
UNKNOWN = "-"
# base.config's AuditConfig takes the same paths (tests/unit/test_audit.py keeps them equal).
AUDIT_PATH = re.compile(r"(/[A-Za-z0-9_+-][A-Za-z0-9._+-]*)+")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
JOB = re.compile(r"[0-9]{1,20}")
IMAGE_MAX, SQUASHFS_MAX, CONFIG_MAX = 1024, 2048, 1 << 20
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
ROOT_ONLY = Admins.of()  # root, no service account: the log and its config are root's alone

# /etc/logrotate.d/imgpipe: logrotate's own rotation (``imgpipe-audit --config FILE
# --logrotate`` prints it for the configured log); ``create`` makes the fresh file root's
# and 0600 at once, and the recorder makes it so too when it is missing.
LOGROTATE = """\
{log} {{
    weekly
    rotate 52
    compress
    delaycompress
    missingok
    notifempty
    create 0600 root root
}}
"""


@dataclass(frozen=True)
class Entry:
    """What a caller says of one import: every field checked, none trusted further."""

    event: str
    image: Reference
    digest: str | None
    squashfs: str | None
    result: str
    job: str | None

    @classmethod
    def parse(cls, args: list[str]) -> Entry:
        """``EVENT IMAGE DIGEST SQUASHFS RESULT JOB``; ImgpipeError naming the first bad one."""
        if len(args) != 6:
            raise ImgpipeError(f"takes EVENT IMAGE DIGEST SQUASHFS RESULT JOB, not {len(args)} "
                               "argument(s)", hint="the importer calls it; it is not for people")
        event, image, digest, squashfs, result, job = args
        if event not in EVENTS:
            raise ImgpipeError(f"event {shown(event, 40)}: must be one of {', '.join(EVENTS)}")
        if result not in RESULTS:
            raise ImgpipeError(f"result {shown(result, 40)}: must be one of {', '.join(RESULTS)}")
        if len(image) > IMAGE_MAX:
            raise ImgpipeError(f"image: longer than {IMAGE_MAX} characters")
        try:
            ref = Reference.parse(image)
        except ReferenceFormatError:
            raise ImgpipeError(f"image {shown(image, 80)}: not an image reference with its "
                               "registry") from None
        if digest != UNKNOWN and not DIGEST.fullmatch(digest):
            raise ImgpipeError(f"digest {shown(digest, 80)}: must be sha256: and 64 lower-case "
                               "hex digits, or -")
        if len(squashfs) > SQUASHFS_MAX or not squashfs.isprintable() or not squashfs:
            raise ImgpipeError(f"squashfs {shown(squashfs, 80)}: must be a path of at most "
                               f"{SQUASHFS_MAX} printable characters, or -")
        if job != UNKNOWN and not JOB.fullmatch(job):
            raise ImgpipeError(f"job {shown(job, 40)}: must be a Slurm job id (digits), or -")
        return cls(event, ref, None if digest == UNKNOWN else digest,
                   None if squashfs == UNKNOWN else squashfs, result,
                   None if job == UNKNOWN else job)

    def line(self, uid: int, now: float | None = None) -> bytes:
        """The JSON line of the log (``uid``: whom sudo vouches for)."""
        now = time.time() if now is None else now
        try:
            user: str | None = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = None
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        record = {"time": f"{stamp}.{int(now % 1 * 1000):03d}Z", "host": os.uname().nodename,
                  "uid": uid, "user": user, "event": self.event, "image": str(self.image),
                  "registry": self.image.registry, "digest": self.digest,
                  "squashfs": self.squashfs, "result": self.result, "job": self.job}
        return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode()


def caller_uid(environ: Mapping[str, str], euid: int) -> int:
    """Whom the line names: the uid sudo vouches for (SUDO_UID), else root's own."""
    if euid != 0:
        raise ImgpipeError("imgpipe-audit runs as root only", hint="job users run it through "
                           "the sudoers line docs/admin.md shows (\"Audit log\")")
    text = environ.get("SUDO_UID")
    if text is None:
        return 0
    if not JOB.fullmatch(text):
        raise ImgpipeError(f"SUDO_UID {shown(text, 40)} is not a uid")
    return int(text)


def _folder(path: str, create: bool) -> int:
    """A folder of root's that nobody else may write, walked from ``/`` without following a
    link (made 0700 with ``create``); its descriptor."""
    fd, _ = open_admin_folder(path, ROOT_ONLY, create_mode=0o700 if create else None,
                              adopt=lambda names: None, what="a folder of root's")
    if fd is None:
        raise ImgpipeError(f"{shown(path, 400)} does not exist")
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise ImgpipeError(f"{shown(path, 400)} may be written by others (mode "
                           f"{stat.S_IMODE(mode):04o})", hint=f"chmod go-w {shown(path, 400)}")
    return fd


def audit_log(config: str) -> str:
    """The log ``config`` names (``audit.log``), read only from a file of root's alone."""
    import yaml

    if not AUDIT_PATH.fullmatch(config):
        raise ImgpipeError(f"--config {shown(config, 200)}: must be an absolute path of letters, "
                           "digits and . _ + -")
    folder = _folder(os.path.dirname(config), create=False)
    try:
        fd = os.open(os.path.basename(config), _READ, dir_fd=folder)
    except OSError as exc:
        raise ImgpipeError(f"{config}: {exc.strerror}") from None
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise ImgpipeError(f"{config}: the recorder reads only a config root owns and "
                               f"nobody else may write (uid {info.st_uid}, mode "
                               f"{stat.S_IMODE(info.st_mode):04o})")
        if info.st_size > CONFIG_MAX:
            raise ImgpipeError(f"{config}: larger than {CONFIG_MAX >> 20} MiB: not a config")
        try:
            raw = yaml.load(handle.read(CONFIG_MAX),
                            Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except yaml.YAMLError:
            raise ImgpipeError(f"{config}: not valid YAML") from None
    audit = raw.get("audit") if isinstance(raw, dict) else None
    log = audit.get("log") if isinstance(audit, dict) else None
    if log is None:
        raise ImgpipeError(f"{config} sets no audit.log: nothing to record")
    if not isinstance(log, str) or not AUDIT_PATH.fullmatch(log):
        raise ImgpipeError(f"{config}: audit.log: must be an absolute path of letters, digits "
                           "and . _ + -")
    return log


def append(log: str, line: bytes) -> None:
    """``line`` at the end of ``log``, in one write under an exclusive flock."""
    folder = _folder(os.path.dirname(log), create=True)
    try:
        fd = os.open(os.path.basename(log), _APPEND, 0o600, dir_fd=folder)
    except OSError as exc:
        raise ImgpipeError(f"{log} cannot be opened ({exc.strerror}): only a regular file is "
                           "appended to, never through a link") from None
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077 \
                or info.st_nlink != 1:
            raise ImgpipeError(f"{log} is not root's alone (owner uid {info.st_uid}, mode "
                               f"{stat.S_IMODE(info.st_mode):04o}, {info.st_nlink} link(s))",
                               hint=f"as root: chown root:root {log}; chmod 0600 {log}")
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.write(fd, line) != len(line):
            raise ImgpipeError(f"{log}: the line was cut short (disk full?)")
    finally:
        os.close(fd)


def record_call(config: str, args: list[str], environ: Mapping[str, str]) -> None:
    """The recorder: one line for ``args`` in ``config``'s audit log, or ImgpipeError."""
    kept = os.umask(0o077)  # sudo keeps the caller's: nothing the recorder makes is others'
    try:
        uid = caller_uid(environ, os.geteuid())
        entry = Entry.parse(args)
        append(audit_log(config), entry.line(uid))
    finally:
        os.umask(kept)


def logrotate_file(config: str) -> str:
    """/etc/logrotate.d/imgpipe for the log ``config`` names."""
    return LOGROTATE.format(log=audit_log(config))
