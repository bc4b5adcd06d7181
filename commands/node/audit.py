"""The node side's audit log (docs/admin.md, "Audit log"): who imported what, when, from which
registry, as which digest.

Where the site config (a file root owns and nobody else may write) sets ``audit.log``, every
import the importer answers (``get``, ``take``, ``broadcast``) and every shared entry the cache
writer makes is recorded by ``record``: it runs the recorder (``audit.recorder``,
``imgpipe.commands.node.auditlog``) through ``sudo -n`` as root, or directly when root runs
the importer, with the Slurm job's id.  A site's own ``/etc/imgpipe/imgpipe.yaml`` is asked
too when the importer reads another file (``$IMGPIPE_CONFIG``): a job's environment cannot
turn the site's audit off.  A record that fails fails the import, in one line naming what to
fix: the admin chose an audit by setting the key, and a log that silently misses lines is
worth nothing.  Nothing of it reaches stdout (Pyxis reads the squashfs path there).

Without ``audit.log`` nothing changes, and nothing more than this module is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from imgpipe.base.errors import ConfigError, ImgpipeError

if TYPE_CHECKING:
    from imgpipe.enroot.convert import Conversion

SITE_CONFIG = "/etc/imgpipe/imgpipe.yaml"
DEFAULT_RECORDER = "/opt/imgpipe/bin/imgpipe-audit"  # base.config's (a test keeps them equal)
RECORD_TIMEOUT_S = 60.0
SECTION = "docs/admin.md, \"Audit log\""


@dataclass(frozen=True)
class AuditSite:
    """The audit a site config asks for: the file, its log and the recorder sudo allows."""

    config: str
    log: str
    recorder: str

    def argv(self, fields: list[str]) -> list[str]:
        """The recorder's command line: through sudo unless root asks."""
        call = [self.recorder, "--config", self.config, *fields]
        return call if os.geteuid() == 0 else [system_sudo(), "-n", *call]

    def sudoers(self) -> str:
        return f"ALL ALL=(root) NOPASSWD: {self.recorder} --config {self.config} *"


def audit_keys(path: str) -> AuditSite | None:
    """The audit ``path`` sets; None when it sets none (or cannot be read: the importer's own
    reading of it says why).  ConfigError when a file root does not own alone sets it."""
    import yaml

    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            raw = yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError):
        return None
    audit = raw.get("audit") if isinstance(raw, dict) else None
    if not isinstance(audit, dict) or audit.get("log") is None:
        return None
    if info.st_uid != 0 or info.st_mode & 0o022:
        raise ConfigError(f"{path}: audit.log: only a file root owns and nobody else may write "
                          f"may set it (this one: uid {info.st_uid}, mode "
                          f"{info.st_mode & 0o7777:04o})",
                          hint="set it in the site's /etc/imgpipe/imgpipe.yaml")
    from imgpipe.commands.node.auditlog import AUDIT_PATH

    log, recorder = audit.get("log"), audit.get("recorder", DEFAULT_RECORDER)
    for key, value in (("audit.log", log), ("audit.recorder", recorder)):
        if not isinstance(value, str) or not AUDIT_PATH.fullmatch(value):
            raise ConfigError(f"{path}: {key}: must be an absolute path of letters, digits "
                              "and . _ + -")
    return AuditSite(os.path.abspath(path), str(log), str(recorder))


def configured(config: str | None = None) -> AuditSite | None:
    """The audit to record to: ``config``'s (the cache writer's one file), else that of the
    importer's file (``$IMGPIPE_CONFIG``) and then the site's; None when none sets one."""
    candidates = [config] if config else [os.environ.get("IMGPIPE_CONFIG") or SITE_CONFIG,
                                          SITE_CONFIG]
    for path in dict.fromkeys(candidates):
        site = audit_keys(path)
        if site is not None:
            return site
    return None


def record(event: str, image: str, digest: str | None, squashfs: str | os.PathLike[str] | None,
           result: str, config: str | None = None) -> None:
    """One line of the audit log, where the site keeps one; ImgpipeError (one line naming
    what to fix) when the recorder does not take it."""
    site = configured(config)
    if site is None:
        return
    from imgpipe.base import process
    from imgpipe.base.terminal import shown

    job = os.environ.get("SLURM_JOB_ID", "")
    fields = [event, image, digest or "-", os.fspath(squashfs) if squashfs else "-", result,
              job if job.isascii() and job.isdigit() and len(job) <= 20 else "-"]
    argv = site.argv(fields)
    try:
        process.run(argv, timeout=RECORD_TIMEOUT_S, what="the audit recorder")
    except ImgpipeError as exc:
        said = process.last_line(getattr(exc, "stderr", "")) or exc.message
        sudo = os.path.basename(argv[0]) == "sudo" and said.startswith("sudo:")
        raise ImgpipeError(
            f"the audit log {site.log} ({site.config}) did not take this {event}: "
            f"{shown(said, 300)}",
            hint=(f"as root, on every node, in /etc/sudoers.d/imgpipe: {site.sudoers()}" if sudo
                  else f"fix what it says ({SECTION})")) from None


def result_of(conversion: Conversion) -> str:
    """What a conversion's answer was: found, fetched (a published squashfs) or converted."""
    if not conversion.converted:
        return "found"
    return "fetched" if conversion.published else "converted"


SUDO_PATHS = ("/usr/bin/sudo", "/bin/sudo", "/usr/local/bin/sudo")


def system_sudo() -> str:
    """The system's sudo, never one the job's PATH names (a user's own ``sudo`` script would
    skip the line and exit 0)."""
    for path in SUDO_PATHS:
        if os.access(path, os.X_OK):
            return path
    return SUDO_PATHS[0]  # not installed: the run fails, naming it
