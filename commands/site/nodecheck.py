"""`imgpipe node-config --check | --apply`: a node that already runs Pyxis and Enroot, against
what imgpipe needs.

``--check`` reads the node's own files (plugstack.conf and what it includes, enroot.conf, the
Pyxis plugin's version, the importer link, /etc/imgpipe) and says, as a diff per file, only
what imgpipe needs there; a line that would change what the site's existing jobs do is marked,
with the choice that leaves them as they are.  ``--apply`` writes imgpipe's own files (the
site config, the importer link, a Pyxis line where the node has none) and, only when asked
with ``--accept importer``, adds ``importer=`` to the site's own Pyxis line.  Every file it
replaces is kept under ``/var/lib/imgpipe/backups/STAMP/``; a second run changes nothing.
``--root DIR`` reads and writes a node image instead of this host (a chroot).
"""

from __future__ import annotations

import filecmp
import glob
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.base.adminpath import Admins, walk_admin_folder
from imgpipe.base.config import Settings
from imgpipe.base.configlayers import SITE_CONFIG
from imgpipe.base.errors import ConfigError
from imgpipe.base.files import atomic_write
from imgpipe.enroot.nodeconfig import (
    IMPORTER_AFFECTS,
    IMPORTER_SINCE,
    PLUGSTACK_FILE,
    PYXIS_SO_CANDIDATES,
    Version,
    detect_pyxis,
    importer_path,
)

__all__ = ["Finding", "NodeCheck", "apply_node", "check_node"]

PLUGSTACK = "/etc/slurm/plugstack.conf"
BACKUPS = "/var/lib/imgpipe/backups"


@dataclass(frozen=True)
class Finding:
    """One file's verdict: ``ok``, or a diff (``-``/``+`` lines) of what imgpipe needs."""

    file: str
    verdict: str  # ok | missing | differs | conflict | info
    ours: bool  # imgpipe's own file (--apply writes it) or the site's (shown; --accept)
    diff: list[str] = field(default_factory=list)
    affects: str = ""  # how the change would alter the site's existing jobs
    safer: str = ""


@dataclass(frozen=True)
class NodeCheck:
    root: Path
    pyxis: tuple[str, Version] | None
    findings: list[Finding]

    @property
    def needed(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict in ("missing", "differs")]


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def pyxis_lines(root: Path) -> list[tuple[Path, int, str]]:
    """Every plugstack line that loads Pyxis: (file, line number, line), includes followed."""
    found: list[tuple[Path, int, str]] = []
    pending, seen = [_under(root, PLUGSTACK)], set()
    while pending:
        path = pending.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and words[0] == "include":
                pending += sorted(Path(p) for p in glob.glob(str(_under(root, words[1]))))
            elif len(words) >= 2 and words[0] in ("required", "optional") \
                    and os.path.basename(words[1]) == "spank_pyxis.so":
                found.append((path, number, line))
    return found


def _importer_target() -> Path:
    """This imgpipe's importer: what the node's link should name."""
    return Path(sys.executable).parent / "imgpipe-pyxis-importer"


def check_node(settings: Settings, root: Path = Path("/"),
               site_config: Path | None = None) -> NodeCheck:
    """What this node (or the node image at ``root``) lacks of what imgpipe needs; the site
    config it should have is ``site_config``, by default this host's."""
    if site_config is None and SITE_CONFIG.is_file():
        site_config = SITE_CONFIG
    pyxis = detect_pyxis(tuple(str(_under(root, c)) for c in PYXIS_SO_CANDIDATES))
    findings = [_site_config(root, site_config), _importer_link(root)]
    findings.append(_plugstack(root, pyxis))
    findings += _enroot_conf(settings, root)
    return NodeCheck(root, pyxis, findings)


def _site_config(root: Path, source: Path | None) -> Finding:
    target = _under(root, str(SITE_CONFIG))
    if source is None or source.resolve() == target.resolve():
        return Finding(str(SITE_CONFIG), "ok" if target.is_file() else "missing", True,
                       [] if target.is_file() else ["+ (the site config: imgpipe site init, "
                                                    "or --site-config FILE)"])
    if target.is_file() and filecmp.cmp(source, target, shallow=False):
        return Finding(str(SITE_CONFIG), "ok", True)
    return Finding(str(SITE_CONFIG), "differs" if target.is_file() else "missing", True,
                   [f"+ (a copy of {source})"])


def _importer_link(root: Path) -> Finding:
    link = _under(root, importer_path())
    target = _importer_target()
    if link.is_symlink() and os.readlink(link) == str(target):
        return Finding(importer_path(), "ok", True)
    if link.exists() and not link.is_symlink():
        return Finding(importer_path(), "conflict", True,
                       ["  a file that is not imgpipe's link stands there: left as it is"])
    return Finding(importer_path(), "differs" if link.is_symlink() else "missing", True,
                   ([f"- -> {os.readlink(link)}"] if link.is_symlink() else [])
                   + [f"+ -> {target}"])


def _plugstack(root: Path, pyxis: tuple[str, Version] | None) -> Finding:
    wanted = f"importer={importer_path()}"
    if pyxis is None:
        return Finding(PLUGSTACK_FILE, "info", False, ["  no Pyxis here (spank_pyxis.so): "
                                                       "jobs run without it"])
    if pyxis[1] < IMPORTER_SINCE:
        return Finding(PLUGSTACK_FILE, "info", False, [
            f"  Pyxis {'.'.join(map(str, pyxis[1]))} has no importer= (0.21+): the recipes "
            "pin squashfs paths instead; nothing to change"])
    lines = pyxis_lines(root)
    if not lines:
        return Finding(PLUGSTACK_FILE, "missing", True,
                       [f"+ required {pyxis[0].removeprefix(str(root).rstrip('/'))} "
                        f"runtime_path=/run/pyxis {wanted}"], IMPORTER_AFFECTS)
    path, number, line = lines[0]
    options = [w for w in line.split("#", 1)[0].split()[2:]]
    current = next((o for o in options if o.startswith("importer=")), None)
    shown = "/" + str(path.relative_to(root)).lstrip("/")
    if current == wanted:
        return Finding(shown, "ok", False)
    if current is not None:
        return Finding(shown, "conflict", False, [f"  line {number}: the site's Pyxis already "
                                                  f"uses {current}: left as it is"])
    return Finding(shown, "differs", False, [f"- {line}", f"+ {line.rstrip()} {wanted}"],
                   IMPORTER_AFFECTS, "leave it out: the recipes then pin squashfs paths "
                   "(imgpipe convert on the login node), and Pyxis imports as before")


def _enroot_conf(settings: Settings, root: Path) -> list[Finding]:
    """Nothing of enroot.conf is needed; what a site set is left as it is.  Said once."""
    from imgpipe.enroot.nodeconfig import ENROOT_CONF, _registry_lines

    options = [f"  option (not needed with importer=): #{c.line} ({c.affects})"
               for c in _registry_lines(settings)]
    kept = "file stays as it is" if _under(root, ENROOT_CONF).is_file() else "defaults stay"
    return [Finding(ENROOT_CONF, "ok", False, [f"  nothing needed: the site's {kept}", *options])]


def apply_node(settings: Settings, root: Path = Path("/"), site_config: Path | None = None,
               accept: frozenset[str] = frozenset()) -> list[str]:
    """Write what ``check_node`` found missing in imgpipe's own files (and, with ``accept``
    naming ``importer``, the site's Pyxis line); each replaced file is kept beside it.
    Returns what it did, a line each (empty: nothing to do)."""
    if os.geteuid() != 0 and root == Path("/"):
        raise ConfigError("node-config --apply writes /etc and /usr/local/bin: run it as root")
    if site_config is None and SITE_CONFIG.is_file():
        site_config = SITE_CONFIG
    checked = check_node(settings, root, site_config)
    done = []
    stamp = time.strftime("%Y%m%d%H%M%S")
    for finding in checked.findings:
        if finding.verdict not in ("missing", "differs"):
            continue
        target = _under(root, finding.file)
        _walk(target.parent)
        if finding.file == str(SITE_CONFIG) and site_config is not None:
            done += _replace(root, target, site_config.read_bytes(), stamp, 0o644)
        elif finding.file == importer_path():
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                target.unlink()
            os.symlink(_importer_target(), target)
            done.append(f"linked {target} -> {_importer_target()}")
        elif finding.file == PLUGSTACK_FILE and finding.verdict == "missing":
            text = f"# imgpipe node-config --apply {stamp}\n{finding.diff[0][2:]}\n"
            done += _replace(root, target, text.encode(), stamp, 0o644)
        elif not finding.ours and "importer" in accept:
            path = _under(root, finding.file)
            old, new = finding.diff[0][2:], finding.diff[1][2:]
            text = path.read_text().replace(old, new, 1)
            done += _replace(root, path, text.encode(), stamp, path.stat().st_mode & 0o777)
    return done


def _walk(folder: Path, mode: int = 0o755) -> None:
    """As root, a folder written in: walked from / without following a link, every folder
    on the way root's and closed to others (imgpipe.base.adminpath); made where missing."""
    if os.geteuid() == 0:
        walk_admin_folder(folder, Admins.of(), create_mode=mode, adopt=lambda names: None,
                          refuse=lambda what, hint: ConfigError(what, hint=hint))


def _replace(root: Path, path: Path, data: bytes, stamp: str, mode: int) -> list[str]:
    """Write ``path``, keeping what was there under /var/lib/imgpipe/backups/STAMP/ (never
    beside it: plugstack.conf includes every file of its folder)."""
    said = []
    if path.exists():
        backup = _under(root, BACKUPS) / stamp / path.relative_to(root)
        _walk(backup.parent, 0o700)
        shutil.copy2(path, backup)
        said.append(f"kept {path} as {backup}")
    atomic_write(path, data, mode=mode)
    return [*said, f"wrote {path}"]
