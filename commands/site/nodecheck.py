"""`imgpipe node-config --check | --apply`: a node that already runs Pyxis and Enroot, against
what imgpipe needs.

``--check`` reads the node's own files (the plugstack slurmd reads and what it includes,
enroot.conf, the Pyxis plugin's version, the importer link and whether a job user can run it,
/etc/imgpipe, the registry's CA) and says, as a diff per file, only what imgpipe needs there;
a line that would change what the site's existing jobs do is marked, with the choice that
leaves them as they are.  ``--apply`` writes imgpipe's own files (the site config, the
importer link) and, only when ``--accept`` names it, a change to the site's jobs: a Pyxis line
where the plugstack loads none (``pyxis``, with ``importer``/``container_scope``/``squashfuse``
for its options), or ``importer=`` on the site's own line (``importer``).  Nothing is written
where slurmd would not read it; each run's backups are kept (``nodebackup``) and a second run
changes nothing.  ``--root DIR`` reads and writes a node image instead of this host.
"""

from __future__ import annotations

import filecmp
import fnmatch
import glob
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.configlayers import SITE_CONFIG
from imgpipe.base.errors import ConfigError
from imgpipe.base.files import atomic_write
from imgpipe.base.mounts import filesystem_type, is_shared_type
from imgpipe.commands.site.nodebackup import Backup, walk_folder
from imgpipe.commands.site.nodeboot import NODE_LOCAL, UNIT, WANTS, make_cache, unit_text
from imgpipe.commands.site.noderunnable import python_problem, runnable_by_others
from imgpipe.enroot.nodeconfig import (
    CLEANUP_PATH,
    IMPORTER_AFFECTS,
    IMPORTER_SINCE,
    PYXIS_SO_CANDIDATES,
    SQUASHFUSE_IMPORTER_SINCE,
    SQUASHFUSE_SINCE,
    SYSTEM_VENV,
    Version,
    detect_pyxis,
    find_plugstack,
    importer_path,
    pyxis_line,
    slurm_conf_value,
)

__all__ = ["PYXIS_MARKER", "Finding", "NodeCheck", "NodePlan", "apply_node", "check_node"]

IMPORTER_NAME = "imgpipe-pyxis-importer"
PYXIS_MARKER = "# added by imgpipe node-config --apply --accept pyxis"  # --remove finds it


@dataclass(frozen=True)
class Finding:
    """One file's verdict: ``ok``, or a diff (``-``/``+`` lines) of what imgpipe needs."""

    file: str
    verdict: str  # ok | missing | differs | conflict | info
    ours: bool  # imgpipe's own file (--apply writes it) or the site's (shown; --accept)
    diff: list[str] = field(default_factory=list)
    affects: str = ""  # how the change would alter the site's existing jobs
    safer: str = ""
    accept: str = ""  # the --accept name that lets --apply write it ("" for imgpipe's own)


@dataclass(frozen=True)
class NodeCheck:
    root: Path
    pyxis: tuple[str, Version] | None
    findings: list[Finding]
    plugstack: tuple[str, str]  # the file slurmd reads, and how that was learnt

    @property
    def needed(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict in ("missing", "differs")]


@dataclass(frozen=True)
class NodePlan:
    """What the check compares with: where things are on this node, as the admin said."""

    root: Path = Path("/")
    site_config: Path | None = None
    plugstack: str | None = None  # --plugstack: else found as slurmd finds it
    venv: Path | None = None  # --venv: the node's imgpipe; else this one (root /) or /opt/imgpipe
    accept: frozenset[str] = frozenset()
    shared_plugstack: bool = False  # --shared-plugstack: a plugstack every node reads, known


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _shown(root: Path, path: Path) -> str:
    return "/" + str(path.relative_to(root)).lstrip("/")


def pyxis_lines(root: Path, plugstack: str) -> list[tuple[Path, int, str]]:
    """Every plugstack line that loads Pyxis: (file, line number, line), includes followed."""
    found: list[tuple[Path, int, str]] = []
    pending, seen = [_under(root, plugstack)], set()
    while pending:
        path = pending.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and words[0] == "include":  # relative: to the file's folder
                pattern = (_under(root, words[1]) if words[1].startswith("/")
                           else path.parent / words[1])
                pending += sorted(Path(p) for p in glob.glob(str(pattern)))
            elif len(words) >= 2 and words[0] in ("required", "optional") \
                    and os.path.basename(words[1]) == "spank_pyxis.so":
                found.append((path, number, line))
    return found


def new_line_target(root: Path, plugstack: str) -> str:
    """Where a new Pyxis line is read: ``pyxis.conf`` in the folder the plugstack's first
    ``include`` names (when its pattern takes that name), else the plugstack itself."""
    try:
        text = _under(root, plugstack).read_text(errors="replace")
    except OSError:
        return plugstack
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] == "include":
            folder, pattern = os.path.split(words[1])
            if not glob.has_magic(folder) and fnmatch.fnmatch("pyxis.conf", pattern):
                # Slurm reads a relative include from the including file's folder
                return os.path.join(os.path.dirname(plugstack), folder, "pyxis.conf")
    return plugstack


def importer_target(plan: NodePlan) -> Path:
    """The importer the node's link should name: --venv's, this imgpipe's on the node itself,
    else the system-wide venv the install lines make (a node image)."""
    if plan.venv is not None:
        return plan.venv / "bin" / IMPORTER_NAME
    if plan.root == Path("/"):
        return Path(sys.executable).parent / IMPORTER_NAME
    return Path(SYSTEM_VENV) / "bin" / IMPORTER_NAME


def check_node(settings: Settings, plan: NodePlan = NodePlan()) -> NodeCheck:
    """What this node (or the node image at ``plan.root``) lacks of what imgpipe needs."""
    root = plan.root
    site_config = plan.site_config
    if site_config is None and SITE_CONFIG.is_file():
        site_config = SITE_CONFIG
    plugstack = (plan.plugstack, "--plugstack") if plan.plugstack else find_plugstack(root)
    named = [line.split("#", 1)[0].split()[1] for _, _, line in pyxis_lines(root, plugstack[0])]
    plugin_dirs = (slurm_conf_value(root, "PluginDir") or "").split(":")  # a relative name's
    where = [*dict.fromkeys([*(n for n in named if n.startswith("/")),
                             *(os.path.join(d, n) for n in named if not n.startswith("/")
                               for d in [*plugin_dirs, *map(os.path.dirname,
                                                            PYXIS_SO_CANDIDATES)] if d),
                             *PYXIS_SO_CANDIDATES])]
    pyxis = detect_pyxis(tuple(str(_under(root, c)) for c in where))
    findings = [_site_config(root, site_config), *_ca_file(settings, root),
                _importer_link(plan), _plugstack(plan, pyxis, plugstack[0])]
    findings += _boot_unit(settings, plan)
    findings += _enroot_conf(settings, root)
    return NodeCheck(root, pyxis, findings, plugstack)


def _boot_unit(settings: Settings, plan: NodePlan) -> list[Finding]:
    """The unit that makes a node-local squashfs folder at each boot (nodeboot), where images
    reach the nodes one by one; none for a shared folder."""
    distribution = settings.enroot.distribution
    if distribution not in NODE_LOCAL:
        return []
    folder = str(settings.path(settings.outputs.squashfs_dir))
    wanted = unit_text(importer_target(plan).parent / "imgpipe", folder, distribution)
    unit, link = _under(plan.root, UNIT), _under(plan.root, WANTS)
    current = unit.read_text(errors="replace") if unit.is_file() else None
    linked = link.is_symlink() and os.readlink(link) == UNIT
    if current == wanted and linked:
        return [Finding(UNIT, "ok", True)]
    start = next((f"- {line}" for line in (current or "").splitlines()
                  if line.startswith("ExecStart=")), None)
    return [Finding(UNIT, "missing" if current is None else "differs", True, [
        *([start] if start and current != wanted else []),
        f"+ ExecStart={importer_target(plan).parent / 'imgpipe'} node-config --make-cache "
        f"{folder}  (the node-local folder at each boot, before slurmd; enabled: {WANTS})"])]


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


def _ca_file(settings: Settings, root: Path) -> list[Finding]:
    """The registry's CA, which the site config names but --apply does not copy."""
    if settings.registry.ca_file is None:
        return []
    ca = str(settings.path(settings.registry.ca_file))
    if _under(root, ca).is_file():
        return [Finding(ca, "ok", False)]
    return [Finding(ca, "info", False, [f"  registry.ca_file names {ca}, which this node lacks:"
                                        " put the registry's CA there (the node image)"])]


def _importer_link(plan: NodePlan) -> Finding:
    link = _under(plan.root, importer_path())
    target, venv = importer_target(plan), importer_target(plan).parent.parent
    # the venv's Python first: a venv of RHEL 9's 3.9 took no imgpipe, and its missing
    # importer would hide why
    why = python_problem(_under(plan.root, str(venv)), str(venv)) or runnable_by_others(
        plan.root, target)
    if why is not None:
        return Finding(importer_path(), "conflict", True,
                       [f"  -> {target}, which a job user cannot run: {why}",
                        "  install imgpipe where every user can run it (/opt/imgpipe: "
                        "imgpipe node-config prints how) or name it with --venv DIR"])
    if link.is_symlink() and os.readlink(link) == str(target):
        return Finding(importer_path(), "ok", True)
    if link.exists() and not link.is_symlink():
        return Finding(importer_path(), "conflict", True,
                       ["  a file that is not imgpipe's link stands there: left as it is"])
    return Finding(importer_path(), "differs" if link.is_symlink() else "missing", True,
                   ([f"- -> {os.readlink(link)}"] if link.is_symlink() else [])
                   + [f"+ -> {target}"])


def _plugstack(plan: NodePlan, pyxis: tuple[str, Version] | None, plugstack: str) -> Finding:
    root = plan.root
    wanted = f"importer={importer_path()}"
    if pyxis is None:
        return Finding(plugstack, "info", False, ["  no Pyxis here (spank_pyxis.so): "
                                                  "jobs run without it"])
    if pyxis[1] < IMPORTER_SINCE:
        return Finding(plugstack, "info", False, [
            f"  Pyxis {'.'.join(map(str, pyxis[1]))} has no importer= (0.21+): the recipes "
            "pin squashfs paths instead; nothing to change"])
    lines = pyxis_lines(root, plugstack)
    if not lines:
        target = new_line_target(root, plugstack)
        options, said = _new_line_options(plan, pyxis[1], wanted)
        line = pyxis_line(pyxis[0].removeprefix(str(root).rstrip("/")),
                          ["runtime_path=/run/pyxis", *options], [], frozenset())
        return Finding(target, "missing", False, [f"+ {line}", *said],
                       "every srun on the node loads Pyxis"
                       + (f"; {IMPORTER_AFFECTS}" if wanted in options else ""),
                       "leave Pyxis off this node", "pyxis")
    path, number, line = lines[0]
    options = line.split("#", 1)[0].split()[2:]
    current = next((o for o in options if o.startswith("importer=")), None)
    shown = _shown(root, path)
    if current == wanted:
        return Finding(shown, "ok", False)
    if current is not None:
        return Finding(shown, "conflict", False, [f"  line {number}: the site's Pyxis already "
                                                  f"uses {current}: left as it is"])
    on = {o.split("=", 1)[0] for o in options
          if o.split("=", 1)[-1].lower() in ("1", "true", "yes", "y")}
    mounted = "use_squashfuse" in on and pyxis[1] >= SQUASHFUSE_IMPORTER_SINCE
    code, hash_mark, comment = line.partition("#")  # Slurm drops what follows a '#'
    kept = code[len(code.rstrip()):] or (" " if hash_mark else "")  # the spacing as it was
    changed = f"{code.rstrip()} {wanted}{kept}{hash_mark}{comment}"
    return Finding(shown, "differs", False, [f"- {line}", f"+ {changed}"],
                   IMPORTER_AFFECTS + ("; and since this line has use_squashfuse=1, Pyxis "
                                       "then mounts what the importer returns read-only, "
                                       "nvcr.io's images too, which it unpacked before"
                                       if mounted else "")
                   + ("; and since this line has use_enroot_load=1, which Pyxis skips when an "
                      "importer is set, nvcr.io's images are then imported to a squashfs in "
                      "Pyxis's runtime folder and unpacked, not loaded"
                      if "use_enroot_load" in on else ""),
                   "leave it out: the recipes then pin squashfs paths "
                   "(enroot.pyxis_importer: false; imgpipe convert on the login node), and "
                   "Pyxis imports as before", "importer")


def _write_unit(settings: Settings, plan: NodePlan, backup: Backup) -> list[str]:
    """The boot unit and its wants link written; on the node itself, the folder made now
    too (the unit makes it at each later boot)."""
    unit, link = _under(plan.root, UNIT), _under(plan.root, WANTS)
    folder = str(settings.path(settings.outputs.squashfs_dir))
    done = backup.keep(unit)
    atomic_write(unit, unit_text(importer_target(plan).parent / "imgpipe", folder,
                                 settings.enroot.distribution).encode(), mode=0o644)
    done.append(f"wrote {unit}")
    if not (link.is_symlink() and os.readlink(link) == UNIT):
        walk_folder(link.parent)
        done += backup.keep(link)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(UNIT, link)
        done.append(f"linked {link} -> {UNIT} (enabled at boot)")
    if plan.root == Path("/"):
        made, said, _ = make_cache(settings, folder, None)
        done += [f"{made}: {line}" for line in said] or [f"{made}: made already"]
    return done


def _replace_line(text: str, old: str, new: str) -> str:
    """``text`` with the line that is exactly ``old`` (the active Pyxis line, never a
    commented copy of it) made ``new``."""
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines):
        if line.rstrip("\n") == old:
            lines[number] = new + ("\n" if line.endswith("\n") else "")
            break
    return "".join(lines)


def _on_shared_storage(root: Path, findings: list[Finding], accept: frozenset[str]) -> str | None:
    """The site file a run would change that lies on a file system other hosts mount (NFS,
    Lustre...): every node reading it changes at once."""
    for finding in findings:
        if finding.accept in accept and finding.accept in ("pyxis", "importer") \
                and finding.verdict in ("missing", "differs"):
            kind = filesystem_type(_under(root, finding.file))
            if is_shared_type(kind):
                return f"{finding.file} is on {kind}"
    return None


def _rewrite(target: Path, text: str) -> Path:
    """A site file written anew, keeping its mode, owner and group (a new one: 0644, root's)."""
    info = target.stat() if target.is_file() else None
    atomic_write(target, text.encode(), mode=info.st_mode & 0o777 if info else 0o644)
    if info is not None and os.geteuid() == 0:
        os.chown(target, info.st_uid, info.st_gid)
    return target


def _new_line_options(plan: NodePlan, version: Version, wanted: str
                      ) -> tuple[list[str], list[str]]:
    """The accepted options of a new Pyxis line that this node can take, and a line for each
    accepted one it cannot: container_scope=job only where Pyxis's cleanup finds enroot,
    use_squashfuse=1 only from Pyxis 0.22."""
    options, said = [], []
    if "importer" in plan.accept:
        options.append(wanted)
    if "container_scope" in plan.accept:
        if any(_under(plan.root, f"{folder}/enroot").exists() for folder in CLEANUP_PATH):
            options.append("container_scope=job")
        else:
            said.append("  container_scope=job left out: Pyxis's end-of-job cleanup runs enroot "
                        f"from {':'.join(CLEANUP_PATH)} and would drain the node")
    if "squashfuse" in plan.accept:
        if version >= SQUASHFUSE_SINCE:
            options.append("use_squashfuse=1")
        else:
            said.append(f"  use_squashfuse=1 left out: Pyxis {'.'.join(map(str, version))} has "
                        "none (0.22+)")
    return options, said


def _enroot_conf(settings: Settings, root: Path) -> list[Finding]:
    """Nothing of enroot.conf is needed; what a site set is left as it is.  Said once."""
    from imgpipe.enroot.nodeconfig import ENROOT_CONF, _registry_lines

    options = [f"  option (not needed with importer=): #{c.line} ({c.affects})"
               for c in _registry_lines(settings)]
    kept = "file stays as it is" if _under(root, ENROOT_CONF).is_file() else "defaults stay"
    return [Finding(ENROOT_CONF, "ok", False, [f"  nothing needed: the site's {kept}", *options])]


def apply_node(settings: Settings, plan: NodePlan = NodePlan()) -> list[str]:
    """Write what ``check_node`` found missing in imgpipe's own files and, where
    ``plan.accept`` names it, in the site's; each file replaced or made is recorded for
    ``--rollback``.  Returns what it did, a line each (empty: nothing to do)."""
    root = plan.root
    if os.geteuid() != 0 and root == Path("/"):
        raise ConfigError("node-config --apply writes /etc and /usr/local/bin: run it as root")
    site_config = plan.site_config
    if site_config is None and SITE_CONFIG.is_file():
        site_config = SITE_CONFIG
    checked = check_node(settings, plan)
    if checked.plugstack[1].startswith("Slurm's default") and any(
            f.accept in plan.accept and f.accept in ("pyxis", "importer")
            and f.verdict in ("missing", "differs") for f in checked.findings):
        raise ConfigError("refused: no slurm.conf on this node says which plugstack slurmd "
                          "reads (configless Slurm fetches it from slurmctld), and a line "
                          "written where slurmd does not read it does nothing",
                          hint="--plugstack FILE names the file; with configless Slurm add the "
                          "line --check shows to the controller's plugstack.conf")
    shared = _on_shared_storage(root, checked.findings, plan.accept)
    if shared and not plan.shared_plugstack:
        raise ConfigError(f"refused: {shared}, which other hosts mount: changing it changes "
                          "every node that reads it at once, before imgpipe is on each",
                          hint="install imgpipe on every node first (node-config --apply "
                          "without --accept), then pass --shared-plugstack")
    [link] = [f for f in checked.findings if f.file == importer_path()]
    if link.verdict == "conflict" and "importer" in plan.accept:
        why = link.diff[0].strip() if link.diff else "the importer link is not imgpipe's"
        raise ConfigError(f"refused: Pyxis would run {importer_path()} for every "
                          f"--container-image, and {why}",
                          hint="install imgpipe where every user can run it (./setup.sh "
                          "node-wheels; /opt/imgpipe) or name it with --venv DIR, then apply "
                          "again")
    backup = Backup(root)
    done: list[str] = []
    for finding in checked.findings:
        if finding.verdict not in ("missing", "differs"):
            continue
        if not finding.ours and finding.accept not in plan.accept:
            continue
        target = _under(root, finding.file)
        walk_folder(target.parent)
        if finding.file == str(SITE_CONFIG) and site_config is not None:
            done += backup.keep(target)
            done.append(f"wrote {atomic_write(target, site_config.read_bytes(), mode=0o644)}")
        elif finding.file == importer_path():
            done += backup.keep(target)
            if target.is_symlink():
                target.unlink()
            os.symlink(importer_target(plan), target)
            done.append(f"linked {target} -> {importer_target(plan)}")
        elif finding.file == UNIT:
            done += _write_unit(settings, plan, backup)
        elif finding.accept == "pyxis":
            done += backup.keep(target)
            old = target.read_text() if target.is_file() else ""
            text = (old + ("\n" if old and not old.endswith("\n") else "")
                    + PYXIS_MARKER + "\n"
                    + finding.diff[0][2:] + "\n")
            done.append(f"wrote {_rewrite(target, text)}")
            done += [said.strip() for said in finding.diff[1:]]  # accepted, left out
        elif finding.accept == "importer":
            done += backup.keep(target)
            old, new = finding.diff[0][2:], finding.diff[1][2:]
            done.append(f"wrote {_rewrite(target, _replace_line(target.read_text(), old, new))}")
    if "importer" in plan.accept and "pyxis" not in plan.accept and any(
            f.accept == "pyxis" and f.verdict == "missing" for f in checked.findings):
        done.append("importer: no Pyxis line here to add it to (--accept pyxis writes one)")
    kept = sorted(plan.accept & {"container_scope", "squashfuse"})
    if kept and not any(f.accept == "pyxis" and f.verdict == "missing"
                        for f in checked.findings):
        done.append(f"{', '.join(kept)}: left as the site's own Pyxis line has it (only a "
                    "Pyxis line --apply writes takes it)")
    return done
