"""``imgpipe node-config --remove``: what imgpipe put on a node, taken back in one command.

Taken back, each file kept first as ``--apply`` keeps what it replaces (``nodebackup``, so
``--rollback`` puts the node back as it was): the Pyxis line ``--apply --accept pyxis`` added
(its marked comment and the line after it), the ``importer=`` option ``--accept importer``
put on the site's own Pyxis line (the rest of that line left byte for byte), the importer
link, the site config ``/etc/imgpipe/imgpipe.yaml``, and the files the admin guide has a site
add for imgpipe alone: ``/etc/sudoers.d`` files whose every rule runs an imgpipe program, the
``imgpipe-*.service`` units (and their ``.wants``/``.requires`` links and drop-ins, and a
unit's ``imgpipe-*.conf`` drop-in such as slurmd's), ``/etc/logrotate.d/imgpipe``.  A
node-local squashfs folder is emptied of every entry no job uses, then removed when nothing
is left; what a running job still uses is kept and named.  Kept and said: a
shared squashfs folder (every node reads it), the venv the link named, the service account,
the backups (for ``--rollback``), the audit log, a sudoers file that mixes imgpipe's rules
with the site's.  Nothing of the site's own files changes but the lines imgpipe added.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.configlayers import SITE_CONFIG
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.mounts import filesystem_type, is_shared_type
from imgpipe.commands.site.nodebackup import BACKUPS, Backup
from imgpipe.commands.site.nodecheck import PYXIS_MARKER, NodePlan, _rewrite, pyxis_lines
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.trust import CacheTrust
from imgpipe.enroot.cache.uses import prune
from imgpipe.enroot.nodeconfig import find_plugstack, importer_path

__all__ = ["Removal", "remove_node"]

PROGRAMS = ("imgpipe-cache-writer", "imgpipe-audit", "imgpipe-pyxis-importer")
UNITS = "etc/systemd/system"
LOGROTATE = "/etc/logrotate.d/imgpipe"
AUDIT_LOG = "/var/log/imgpipe"


@dataclass
class Removal:
    """What ``--remove`` took back and what it left, a line each."""

    done: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _under(root: Path, path: str | Path) -> Path:
    return root / str(path).lstrip("/")


def remove_node(settings: Settings, plan: NodePlan) -> Removal:
    """Take imgpipe off the node (or node image) at ``plan.root``, whose site config
    ``settings`` is."""
    root = plan.root
    if os.geteuid() != 0 and root == Path("/"):
        raise ConfigError("node-config --remove writes /etc and /usr/local/bin: run it as root")
    plugstack, how = (plan.plugstack, "--plugstack") if plan.plugstack else find_plugstack(root)
    edits = _plugstack_edits(root, plugstack)
    for path in edits:
        kind = filesystem_type(path)
        if is_shared_type(kind) and not plan.shared_plugstack:
            raise ConfigError(f"refused: {path} is on {kind}, which other hosts mount: taking "
                              "imgpipe's lines out changes every node that reads it at once",
                              hint="pass --shared-plugstack once every node may lose them")
    backup, removal = Backup(root), Removal()
    for path, text in edits.items():
        removal.done += backup.keep(path)
        removal.done.append(f"took imgpipe's Pyxis line or importer= out of {_rewrite(path, text)}")
    _remove_link(root, backup, removal)
    units = _units(root)
    for path in [_under(root, SITE_CONFIG), _under(root, LOGROTATE), *units]:
        if os.path.lexists(path):
            removal.done += backup.keep(path)
            path.unlink()
            removal.done.append(f"removed {path}")
    _remove_sudoers(root, backup, removal)
    with_imgpipe = _under(root, SITE_CONFIG).parent
    if with_imgpipe.is_dir():
        left = sorted(p.name for p in with_imgpipe.iterdir())
        if left:
            removal.kept.append(f"{with_imgpipe}: {', '.join(left[:8])} (the site's own "
                                "files there: profiles, a CA, other configs)")
        else:
            with_imgpipe.rmdir()
    _empty_cache(settings, root, removal)
    _say_kept(settings, root, removal)
    if how.startswith("Slurm's default"):
        removal.kept.append(f"{plugstack}: no slurm.conf here says slurmd reads it (configless "
                            "Slurm?): take importer= out of the plugstack slurmd does read "
                            "(the controller's) before imgpipe leaves the nodes, or every "
                            "--container-image step there fails")
    if edits:
        removal.done.append("restart slurmd on the node: its plugstack changed")
    if units:
        removal.done.append("systemctl daemon-reload: units were removed")
    return removal


def _plugstack_edits(root: Path, plugstack: str) -> dict[Path, str]:
    """Each plugstack file (includes followed) as it is without imgpipe's lines."""
    wanted = f"importer={importer_path()}"
    texts: dict[Path, list[str]] = {}
    for path, number, line in pyxis_lines(root, plugstack):
        lines = texts.setdefault(path, path.read_text().splitlines(keepends=True))
        index = number - 1
        if index > 0 and lines[index - 1].strip() == PYXIS_MARKER:
            lines[index - 1] = lines[index] = ""
            continue
        code, hash_mark, comment = line.partition("#")
        if wanted in code.split():  # the option alone out, the rest as it stands
            taken = code.replace(f" {wanted}", "", 1) if f" {wanted}" in code else " ".join(
                w for w in code.split() if w != wanted) + " "
            lines[index] = taken + hash_mark + comment + (
                "\n" if lines[index].endswith("\n") else "")
    return {path: "".join(lines) for path, lines in texts.items()
            if "".join(lines) != path.read_text()}


def _remove_link(root: Path, backup: Backup, removal: Removal) -> None:
    """The importer link, and the links the admin guide has beside it (the cache writer's,
    the audit recorder's): links only, never a file that stands there."""
    folder = _under(root, importer_path()).parent
    for name in PROGRAMS:
        link = folder / name
        if link.is_symlink():
            target = os.readlink(link)
            removal.done += backup.keep(link)
            link.unlink()
            removal.done.append(f"removed {link} (-> {target})")
        elif os.path.lexists(link):
            removal.kept.append(f"{link}: a file that is not imgpipe's link (left as it is)")


def _units(root: Path) -> list[Path]:
    folder = _under(root, UNITS)
    if not folder.is_dir():
        return []
    units = sorted(p for p in folder.glob("imgpipe-*.service") if p.is_file())
    names = {p.name for p in units}
    links = sorted(p for p in folder.glob("*.*/imgpipe-*.service")
                   if p.is_symlink() and p.name in names
                   and p.parent.suffix in (".wants", ".requires"))
    # drop-ins the guide names: slurmd.service.d/imgpipe-cache.conf (slurmd requires the
    # node-local folder: left behind, slurmd would never start again), and any of imgpipe's
    # own units' drop-ins
    drop_ins = sorted({*folder.glob("*.service.d/imgpipe-*.conf"),
                       *folder.glob("imgpipe-*.service.d/*.conf")})
    return [*links, *(p for p in drop_ins if p.is_file() and not p.is_symlink()), *units]


def _remove_sudoers(root: Path, backup: Backup, removal: Removal) -> None:
    folder = _under(root, "/etc/sudoers.d")
    if not folder.is_dir():
        return
    for path in sorted(folder.iterdir()):
        if path.is_symlink() or not path.is_file():
            continue
        rules = [line for line in path.read_text(errors="replace").splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        ours = [line for line in rules if any(p in line for p in PROGRAMS)]
        if not ours:
            continue
        if len(ours) == len(rules):
            removal.done += backup.keep(path)
            path.unlink()
            removal.done.append(f"removed {path} (imgpipe's sudo rules alone)")
        else:
            removal.kept.append(f"{path}: imgpipe's rules among the site's: take them out "
                                "with visudo")


def _empty_cache(settings: Settings, root: Path, removal: Removal) -> None:
    """A node-local squashfs folder emptied of what no job uses, removed once empty."""
    folder = _under(root, settings.path(settings.outputs.squashfs_dir))
    if not (folder / ".imgpipe").is_dir() or folder.is_symlink():
        return
    kind = filesystem_type(folder)
    if is_shared_type(kind):
        removal.kept.append(f"{folder}: on {kind}, every node's cache: empty it once, from "
                            "one host (imgpipe cache prune --max-size 0, as root, or as "
                            "enroot.cache_owner on root-squashed storage: users' private "
                            "entries then go by their own prune), when no node runs imgpipe")
        return
    try:
        pruned = prune(Storage(folder, CacheTrust.of(settings.enroot.cache_owner)), max_size=0)
    except (ImgpipeError, OSError) as exc:
        removal.kept.append(f"{folder}: not emptied ({exc})")
        return
    if pruned.removed:
        removal.done.append(f"removed {len(pruned.removed)} entries of {folder} no job uses")
    if pruned.kept_in_use:
        for entry in pruned.kept_in_use:
            users = ", ".join(u.replace("~", " ") for u in entry.users) or "a running step"
            removal.kept.append(f"{entry.path}: in use ({users}); remove it after that job "
                                "(imgpipe cache prune --max-size 0, as the folder's owner)")
        return
    shutil.rmtree(folder)  # fd-based, never through a link
    removal.done.append(f"removed {folder}")


def _say_kept(settings: Settings, root: Path, removal: Removal) -> None:
    backups = _under(root, BACKUPS)
    if backups.is_dir():
        removal.kept.append(f"{backups}: what each run replaced or removed (node-config "
                            "--rollback puts the last run back; remove the folder to forget)")
    logs = {_under(root, AUDIT_LOG)} | ({_under(root, Path(settings.audit.log).parent)}
                                        if settings.audit.log else set())
    for folder in sorted(p for p in logs if p.is_dir()):
        removal.kept.append(f"{folder}: the audit log, a security record")
    if settings.enroot.cache_owner:
        removal.kept.append(f"account {settings.enroot.cache_owner}: the cache's service "
                            "account (userdel it once no cache it owns remains)")
    removal.kept.append("imgpipe's venv (this program, and the one the link named): remove "
                        "it last, e.g. rm -rf /opt/imgpipe")
