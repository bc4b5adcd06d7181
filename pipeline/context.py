"""Build contexts: which files an image's build sees, and staging them for BuildKit.

``.dockerignore`` follows Docker's rules: patterns are relative to the context
root, ``*`` and ``?`` stay within one path element, ``**`` crosses elements, a
leading ``!`` re-includes, the last matching pattern wins, and a pattern that
matches a directory excludes everything below it.

A staged context is a private copy of the image folder (after .dockerignore)
plus ``.wheels/``: the wheel directory offered for air-gapped sites (empty
when none), which Dockerfiles bind-mount in the RUN steps that install Python
packages; and ``.python/``: the Python packages pip installed on the build host
for the platform being built (``imgpipe.pipeline.hostsite``; empty for a flavor
without ``python:``), which Dockerfiles copy into their virtual environment.
Staging keeps the user's folder untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.errors import ConfigError
from imgpipe.base.files import file_sha256

WHEELS_DIR = ".wheels"
PYTHON_DIR = ".python"


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    exclude: bool


def _translate(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            if i < len(pattern) and pattern[i] == "/":
                out[-1] = "(?:.*/)?"
                i += 1
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(char))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!") or body.startswith("^"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end
        elif char == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out) + r"\Z")


def parse_dockerignore(text: str) -> list[Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        if not exclude:
            line = line[1:].strip()
        line = os.path.normpath(line.lstrip("/"))
        if line in (".", ""):
            continue
        rules.append(Rule(_translate(line), exclude))
    return rules


def is_excluded(relpath: str, rules: list[Rule]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for rule in rules:
        if any(rule.pattern.match(prefix) for prefix in prefixes):
            excluded = rule.exclude
    return excluded


@dataclass(frozen=True)
class ContextFile:
    path: str  # relative, with /
    mode: int
    digest: str  # sha256 of the content, or of the link target for symlinks
    link: str | None = None


def context_files(folder: Path) -> list[ContextFile]:
    """Every file of the build context, after .dockerignore, sorted by path."""
    ignore = folder / ".dockerignore"
    rules = parse_dockerignore(ignore.read_text()) if ignore.is_file() else []
    found: list[ContextFile] = []
    for root, dirs, files in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        rel_root = "" if rel_root == "." else rel_root + "/"
        # Prune excluded directories unless an exception could re-include something below.
        has_exceptions = any(not r.exclude for r in rules)
        dirs[:] = sorted(d for d in dirs
                         if has_exceptions or not is_excluded(rel_root + d, rules))
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            rel = rel_root + name
            if is_excluded(rel, rules):
                continue
            full = Path(root) / name
            info = full.lstat()
            if full.is_symlink():
                target = os.readlink(full)
                found.append(ContextFile(rel, 0o777, hashlib.sha256(target.encode()).hexdigest(),
                                         target))
            elif full.is_file():
                found.append(ContextFile(rel, info.st_mode & 0o7777, file_sha256(full)))
    return sorted(found, key=lambda f: f.path)


@dataclass(frozen=True)
class Wheel:
    name: str
    size: int
    sha256: str = ""  # of the content: a rebuilt wheel under the same name is a change


def wheels_in(folder: Path | None) -> list[Wheel]:
    """The wheels offered to builds, each with the hash of its content."""
    if folder is None:
        return []
    if not folder.is_dir():
        raise ConfigError(f"wheels directory {folder} does not exist",
                          hint="pass --wheels with a folder of .whl files, or leave it out")
    return sorted((Wheel(p.name, p.stat().st_size, file_sha256(p))
                   for p in folder.glob("*.whl")), key=lambda w: w.name)


def stage_context(folder: Path, files: list[ContextFile], wheels_dir: Path | None,
                  dest: Path) -> Path:
    """Copy the context into ``dest`` with ``.wheels/`` (hard links where possible) and an
    empty ``.python/``."""
    for item in files:
        target = dest / item.path
        target.parent.mkdir(parents=True, exist_ok=True)
        source = folder / item.path
        if item.link is not None:
            os.symlink(item.link, target)
        else:
            shutil.copy2(source, target)
    (dest / PYTHON_DIR).mkdir(exist_ok=True)
    wheels = dest / WHEELS_DIR
    wheels.mkdir(exist_ok=True)
    for wheel in wheels_in(wheels_dir):
        source = wheels_dir / wheel.name  # type: ignore[operator]
        try:
            os.link(source, wheels / wheel.name)
        except OSError:
            shutil.copy2(source, wheels / wheel.name)
    return dest


def sync_context(folder: Path, files: list[ContextFile], wheels_dir: Path | None,
                 dest: Path) -> Path:
    """``stage_context`` into ``dest``, a folder kept between builds, changing only what
    differs (an unchanged file keeps its time): BuildKit then sends only what changed and
    keeps one snapshot of the context, not one per build.  ``.python/`` is its maker's."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {item.path for item in files}
    for item in files:
        target = dest / item.path
        if item.link is not None:
            if target.is_symlink() and os.readlink(target) == item.link:
                continue
            _clear(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(item.link, target)
            continue
        if (target.is_file() and not target.is_symlink()
                and file_sha256(target) == item.digest):
            if target.stat().st_mode & 0o7777 != item.mode:
                os.chmod(target, item.mode)
            continue
        _clear(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(folder / item.path, target)
    for root, dirs, names in os.walk(dest, topdown=False):
        rel = os.path.relpath(root, dest)
        if rel.split(os.sep)[0] in (WHEELS_DIR, PYTHON_DIR):
            continue
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            if prefix + name not in wanted:
                os.unlink(os.path.join(root, name))
        if prefix and not any(w.startswith(prefix) for w in wanted):
            with contextlib.suppress(OSError):
                os.rmdir(root)
    wheels = dest / WHEELS_DIR
    wheels.mkdir(exist_ok=True)
    offered = {wheel.name: wheel for wheel in wheels_in(wheels_dir)}
    for present in wheels.iterdir():
        if present.name not in offered or file_sha256(present) != offered[present.name].sha256:
            _clear(present)
    for name in offered:
        if not (wheels / name).exists():
            source = wheels_dir / name  # type: ignore[operator]
            try:
                os.link(source, wheels / name)
            except OSError:
                shutil.copy2(source, wheels / name)
    (dest / PYTHON_DIR).mkdir(exist_ok=True)
    return dest


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
