"""The git revision images are built from: short sha, and whether the tree is dirty."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.process import run, which


@dataclass(frozen=True)
class Revision:
    sha: str
    dirty: bool
    remote: str | None

    @property
    def tag(self) -> str:
        return f"{self.sha}-dirty" if self.dirty else self.sha


def revision(folder: Path) -> Revision | None:
    """The revision of the git work tree holding ``folder``, or None outside git."""
    if which("git") is None:
        return None
    head = run(["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"], check=False,
               timeout=30)
    if head.returncode != 0:
        return None
    status = run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                 check=False, timeout=60)
    remote = run(["git", "-C", str(folder), "config", "--get", "remote.origin.url"],
                 check=False, timeout=30).stdout.strip() or None
    return Revision(head.stdout.strip(), bool(status.stdout.strip()), remote)
