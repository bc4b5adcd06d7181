"""``imgpipe node-config --upgrade --venv NEW``: a new imgpipe on a node while jobs run.

Pyxis runs the importer once per container step (``get``) and again when the step ends
(``release``); a conversion, a fetch or a broadcast may be running in one at any moment, and
the importer imports most of its modules only when it needs them.  So a new imgpipe is never
installed over the one in use (a running importer would import half of each): it goes into a
venv of its own beside the old (``NEW``), and the importer link is swapped to it in one
``rename`` (a step starting at that instant runs the old or the new one, never neither).
Importers already running finish on the old venv's files; the next step runs the new one,
and a step that started on the old one ends (``release``) on the new one, which reads the
old one's records (tests/e2e/test_node_upgrade.py runs that on a Pyxis sandbox).

Refused in one line, with nothing changed: a NEW that a job user could not run (the same
check as ``--apply``), or one whose cache layout is not the layout of the node's squashfs
folder (the new importer would refuse every job there).  The swap is recorded like an
``--apply`` run, so ``--rollback`` puts the old link back.  What still runs from the old
venv is listed: remove it once nothing does.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from imgpipe.base import process
from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.files import atomic_write
from imgpipe.commands.site.nodebackup import Backup, walk_folder
from imgpipe.commands.site.nodeboot import UNIT
from imgpipe.commands.site.nodecheck import NodePlan, importer_target
from imgpipe.commands.site.noderunnable import python_problem, runnable_by_others
from imgpipe.enroot.nodeconfig import importer_path

__all__ = ["upgrade_node", "processes_running_from"]

LAYOUT_PROBE = "from imgpipe.enroot.cache.storage import LAYOUT_VERSION; print(LAYOUT_VERSION)"


def _under(root: Path, path: str | Path) -> Path:
    return root / str(path).lstrip("/")


def upgrade_node(settings: Settings, plan: NodePlan) -> list[str]:
    """Point the node's importer link at ``plan.venv``'s importer; what was done, a line
    each.  ConfigError (nothing changed) when the new venv cannot serve the node's jobs."""
    root = plan.root
    if plan.venv is None:
        raise ConfigError("--upgrade needs --venv NEW: the new imgpipe's venv, installed "
                          "beside the one in use",
                          hint="python3 -m venv /opt/imgpipe-NEW && /opt/imgpipe-NEW/bin/pip "
                          "install imgpipe-*.whl, then node-config --upgrade --venv "
                          "/opt/imgpipe-NEW")
    if os.geteuid() != 0 and root == Path("/"):
        raise ConfigError("node-config --upgrade writes /usr/local/bin: run it as root")
    target = importer_target(plan)
    why = python_problem(_under(root, plan.venv), str(plan.venv)) or runnable_by_others(
        root, target)
    if why is not None:
        raise ConfigError(f"refused: a job user could not run {target}: {why}",
                          hint="install the new imgpipe where every user can run it (root's "
                          "folders, mode 755)")
    _same_layout(settings, root, plan.venv)
    link = _under(root, importer_path())
    old = os.readlink(link) if link.is_symlink() else None
    if old == str(target):
        return [f"{importer_path()} names {target} already: nothing to do"]
    if os.path.lexists(link) and old is None:
        raise ConfigError(f"refused: {importer_path()} is a file, not imgpipe's link",
                          hint="node-config --check says what stands there")
    backup = Backup(root)
    done = backup.keep(link)
    walk_folder(link.parent)
    swap = link.with_name(f".{link.name}.{secrets.token_hex(8)}")
    os.symlink(target, swap)
    os.replace(swap, link)  # one rename: a step starting now runs the old or the new one
    done.append(f"linked {link} -> {target}" + (f" (was {old})" if old else ""))
    if old is not None:
        done += _boot_unit(root, Path(old).parent.parent, plan.venv, backup)
        done.append(_still_running(Path(old).parent.parent))
    return done


def _boot_unit(root: Path, old: Path, new: Path, backup: Backup) -> list[str]:
    """imgpipe's boot unit (nodeboot) pointed at the new venv where it ran the old one."""
    unit = _under(root, UNIT)
    if unit.is_symlink() or not unit.is_file():
        return []
    text = unit.read_text()
    before = f"ExecStart={old}/bin/imgpipe "
    if before not in text:
        return []
    done = backup.keep(unit)
    atomic_write(unit, text.replace(before, f"ExecStart={new}/bin/imgpipe ").encode(),
                 mode=0o644)
    return [*done, f"wrote {unit}: ExecStart runs {new}/bin/imgpipe (systemctl daemon-reload)"]


def _same_layout(settings: Settings, root: Path, venv: Path) -> None:
    """Refuse a venv whose cache layout differs from the node's squashfs folder's."""
    python = _under(root, venv / "bin" / "python")
    try:
        probe = process.run([str(python), "-I", "-c", LAYOUT_PROBE], timeout=60, check=False)
    except ImgpipeError as exc:
        raise ConfigError(f"refused: {python} does not run ({exc.message})") from None
    wanted = probe.stdout.strip()
    if probe.returncode != 0 or not wanted:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"refused: {venv} holds no imgpipe that runs here ({last})")
    folder = settings.path(settings.outputs.squashfs_dir)
    version = _under(root, folder) / ".imgpipe" / "VERSION"
    try:
        found = version.read_text().strip()
    except FileNotFoundError:
        return  # no cache here yet: the new importer makes it
    except OSError as exc:
        raise ConfigError(f"refused: {version} cannot be read ({exc.strerror})") from None
    if found != wanted:
        raise ConfigError(f"refused: the new imgpipe uses cache layout {wanted[:20]}, "
                          f"{folder} holds layout {found[:20]}: every job there would fail",
                          hint="point the site config's outputs.squashfs_dir at a new folder "
                          "(imgpipe node-config --make-cache DIR) in the same change")


def processes_running_from(venv: Path) -> list[int]:
    """The processes whose command line runs a program of ``venv`` (its Python, a script)."""
    prefix = str(venv).rstrip("/") + "/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")[:2]
        except OSError:
            continue
        if any(word.decode(errors="replace").startswith(prefix) for word in words):
            found.append(int(entry.name))
    return sorted(found)


def _still_running(venv: Path) -> str:
    running = processes_running_from(venv)
    if not running:
        return (f"nothing runs from {venv} now: remove it once nothing names it either (the "
                "sudoers lines of the cache writer and the audit recorder, audit.recorder, "
                "enroot.cache_writer, a boot unit of the site's own: point them at the new "
                "venv)")
    shown = ", ".join(map(str, running[:10])) + (" …" if len(running) > 10 else "")
    return (f"{len(running)} process(es) still run from {venv} (pids {shown}): they finish "
            "there; remove it once none does (the next step already runs the new one)")
