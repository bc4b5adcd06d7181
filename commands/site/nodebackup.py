"""What `node-config --apply` keeps, and `--rollback` puts back.

Each run that writes anything records, under ``/var/lib/imgpipe/backups/STAMP/`` (0700, root's,
never beside the files: plugstack.conf includes every file of its folder), a copy of every file
it replaces (a link as a link) and, in ``.created``, every path it made where nothing was.
``--rollback`` puts the last such run back: copies restored, created paths removed, and the
folder renamed ``STAMP.rolled-back`` so that a second rollback goes one run further back.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from imgpipe.base.adminpath import Admins, walk_admin_folder
from imgpipe.base.errors import ConfigError
from imgpipe.base.files import atomic_write

__all__ = ["BACKUPS", "Backup", "rollback", "walk_folder"]

BACKUPS = "/var/lib/imgpipe/backups"
CREATED = ".created"
STAMP = re.compile(r"\d{14}(-\d+)?")


def walk_folder(folder: Path, mode: int = 0o755) -> None:
    """As root, a folder written in: walked from / without following a link, every folder
    on the way root's and closed to others (imgpipe.base.adminpath); made where missing."""
    if os.geteuid() == 0:
        walk_admin_folder(folder, Admins.of(), create_mode=mode, adopt=lambda names: None,
                          refuse=lambda what, hint: ConfigError(what, hint=hint))


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


class Backup:
    """One run's record, made on its first use (a run that writes nothing leaves none)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        stamp = time.strftime("%Y%m%d%H%M%S")
        folder = _under(root, BACKUPS) / stamp
        suffix = 0
        while folder.exists() or folder.with_name(f"{folder.name}.rolled-back").exists():
            suffix += 1
            folder = _under(root, BACKUPS) / f"{stamp}-{suffix}"
        self.folder = folder

    def keep(self, path: Path) -> list[str]:
        """Before ``path`` (under root) is written: keep what is there, or record that
        nothing was.  A line saying what was kept, if anything."""
        relative = path.relative_to(self.root)
        walk_folder(self.folder, 0o700)
        if not os.path.lexists(path):
            with open(self.folder / CREATED, "a") as handle:
                handle.write(f"/{relative}\n")
            return []
        copy = self.folder / relative
        walk_folder(copy.parent, 0o700)
        if path.is_symlink():
            os.symlink(os.readlink(path), copy)
        else:
            shutil.copy2(path, copy, follow_symlinks=False)
        info = path.lstat()  # owner and group too: --rollback gives them back
        os.chown(copy, info.st_uid, info.st_gid, follow_symlinks=False)
        return [f"kept {path} as {copy}"]


def _last_run(root: Path) -> Path | None:
    folder = _under(root, BACKUPS)
    try:
        runs = sorted(p for p in folder.iterdir() if STAMP.fullmatch(p.name) and p.is_dir()
                      and not p.is_symlink())
    except FileNotFoundError:
        return None
    return runs[-1] if runs else None


def rollback(root: Path) -> list[str]:
    """Put the last recorded run back; what was done, a line each."""
    if os.geteuid() != 0 and root == Path("/"):
        raise ConfigError("node-config --rollback writes /etc and /usr/local/bin: run it as root")
    run = _last_run(root)
    if run is None:
        raise ConfigError(f"nothing to roll back: no run of node-config --apply is recorded "
                          f"under {_under(root, BACKUPS)}")
    done = []
    kept = [Path(folder) / name for folder, _, names in os.walk(run) for name in names]
    for copy in sorted(p for p in kept if p != run / CREATED and
                       (p.is_symlink() or p.is_file())):
        target = root / copy.relative_to(run)
        walk_folder(target.parent)
        held = copy.lstat()
        if copy.is_symlink():  # one rename: a step starting now finds the old or the new one
            swap = target.with_name(f".{target.name}.{os.getpid()}.rollback")
            swap.unlink(missing_ok=True)
            os.symlink(os.readlink(copy), swap)
            os.replace(swap, target)
        else:
            atomic_write(target, copy.read_bytes(), mode=held.st_mode & 0o777)
        os.chown(target, held.st_uid, held.st_gid, follow_symlinks=False)
        done.append(f"restored {target} from {copy}")
    created = run / CREATED
    if created.is_file():
        for line in created.read_text().splitlines():
            target = _under(root, line)
            if target.is_symlink() or target.is_file():
                target.unlink()
                done.append(f"removed {target} (node-config --apply had made it)")
    run.rename(run.with_name(f"{run.name}.rolled-back"))
    return [*done, f"rolled back the run of {run.name}: restart slurmd on the node"]
