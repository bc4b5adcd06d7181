"""The git revision images are built from, and the tags and labels it gives them.

Tags follow docker's metadata conventions (docker/metadata-action): the branch
(``type=ref,event=branch``), each git tag (``event=tag``) and its semver forms
(``{{version}}``, ``{{major}}.{{minor}}``, ``{{major}}`` except for 0.x and pre-releases),
``pr-N`` for a pull request (``event=pr``), ``sha-<7>`` (``type=sha``).  In GitHub Actions
the ref comes from ``GITHUB_REF`` (checkouts there are detached); elsewhere from the
work tree.  A dirty tree gets no ref tags: its bytes are not the ref's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.process import run, which

SEMVER = re.compile(r"^v?(?P<major>0|[1-9]\d*)\.(?P<minor>\d+)\.(?P<patch>\d+)"
                    r"(?:-(?P<pre>[0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$")
TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def tag_safe(name: str) -> str:
    """A ref as a docker tag: ``feature/x`` -> ``feature-x``, at most 128 characters, not
    starting with ``.`` or ``-``."""
    return TAG_UNSAFE.sub("-", name).lstrip(".-")[:128]


def semver_tags(git_tag: str) -> list[str]:
    """``v1.2.3`` -> 1.2.3, 1.2, 1; a pre-release or 0.x gives fewer; not semver: none."""
    match = SEMVER.match(git_tag)
    if match is None:
        return []
    version = git_tag.removeprefix("v").split("+", 1)[0]
    if match["pre"]:
        return [version]
    tags = [version, f"{match['major']}.{match['minor']}"]
    if match["major"] != "0":
        tags.append(match["major"])
    return tags


def source_url(remote: str | None) -> str | None:
    """The remote as a browsable https URL (``git@host:org/repo.git`` too); None for a
    local path or no remote: a label naming a folder on the build host helps nobody."""
    if not remote:
        return None
    if match := re.match(r"^(?:ssh://)?git@([^:/]+)[:/](.+?)(?:\.git)?/?$", remote):
        return f"https://{match[1]}/{match[2]}"
    if match := re.match(r"^https?://(?:[^@/]+@)?(.+?)(?:\.git)?/?$", remote):
        return f"https://{match[1]}"
    return None


@dataclass(frozen=True)
class Revision:
    sha: str  # 12 characters
    dirty: bool
    remote: str | None
    full_sha: str = ""
    branch: str | None = None
    git_tags: tuple[str, ...] = ()
    pull_request: int | None = None

    @property
    def tag(self) -> str:
        return f"{self.sha}-dirty" if self.dirty else self.sha

    @property
    def source(self) -> str | None:
        return source_url(self.remote)

    def ref_tags(self) -> list[str]:
        """The docker metadata tags of this revision, in that order, without repeats."""
        if self.dirty:
            return []
        names = [tag_safe(self.branch)] if self.branch else []
        for git_tag in self.git_tags:
            names += [tag_safe(git_tag), *semver_tags(git_tag)]
        if self.pull_request is not None:
            names.append(f"pr-{self.pull_request}")
        names.append(f"sha-{(self.full_sha or self.sha)[:7]}")
        return list(dict.fromkeys(name for name in names if name))


def _git(folder: Path, *args: str) -> str | None:
    done = run(["git", "-C", str(folder), *args], check=False, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else None


def _github_ref(environ: dict[str, str]) -> tuple[str | None, tuple[str, ...], int | None]:
    ref = environ.get("GITHUB_REF", "")
    if ref.startswith("refs/heads/"):
        return ref.removeprefix("refs/heads/"), (), None
    if ref.startswith("refs/tags/"):
        return None, (ref.removeprefix("refs/tags/"),), None
    if match := re.match(r"^refs/pull/(\d+)/", ref):
        return None, (), int(match[1])
    return None, (), None


def revision(folder: Path, environ: dict[str, str] | None = None) -> Revision | None:
    """The revision of the git work tree holding ``folder``, or None outside git."""
    environ = dict(os.environ) if environ is None else environ
    if which("git") is None:
        return None
    full = _git(folder, "rev-parse", "HEAD")
    if full is None:
        return None
    status = _git(folder, "status", "--porcelain", "--untracked-files=no") or ""
    remote = _git(folder, "config", "--get", "remote.origin.url") or None
    if environ.get("GITHUB_ACTIONS") == "true" and environ.get("GITHUB_REF"):
        branch, git_tags, pull_request = _github_ref(environ)
    else:
        head = _git(folder, "rev-parse", "--abbrev-ref", "HEAD")
        branch = head if head and head != "HEAD" else None
        git_tags = tuple((_git(folder, "tag", "--points-at", "HEAD") or "").split())
        pull_request = None
    return Revision(full[:12], bool(status), remote, full, branch, git_tags, pull_request)
