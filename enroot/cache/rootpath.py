"""The cache paths root (or the service account) acts on: never one a job user could prepare.

``imgpipe node-config --make-cache DIR`` runs as root on every node, and so may ``doctor``,
``cache prune`` and the cache writer.  Before root acts on a cache path it is walked from
``/`` without following a link (``imgpipe.base.adminpath``, the walk every command root runs
on a configured path shares): no component a link, every folder above it root's or the
service account's and closed to others unless sticky, and an existing cache folder adopted
only when root or the service account made it and it is empty or already an imgpipe cache
(``.imgpipe/`` inside).  Refusals are one line naming the folder and the owner to fix.
"""

from __future__ import annotations

from pathlib import Path

from imgpipe.base.adminpath import Admins, walk_admin_folder
from imgpipe.enroot.cache.trust import CacheTrust
from imgpipe.enroot.errors import ConvertError

LAYOUT_FOLDER = ".imgpipe"


def _refuse(what: str, hint: str) -> ConvertError:
    return ConvertError(what, hint=hint)


def _is_cache(names: list[str]) -> str | None:
    if not names or LAYOUT_FOLDER in names:
        return None
    from imgpipe.base.terminal import shown

    listed = shown(", ".join(sorted(names)[:3])) + (", ..." if len(names) > 3 else "")
    return f"already holds other files ({listed}): it is not an imgpipe cache"


def walk_admin_path(path: Path, trust: CacheTrust, create_mode: int | None = None) -> bool:
    """Check the cache folder ``path`` for root's use (see the module's rules); with
    ``create_mode``, make it (exactly that mode, exclusively) and the folders above it
    (0755) where they do not exist yet.  Returns whether the cache folder was made.  Raises
    ConvertError, one line."""
    admins = Admins(trust.admins, trust.admin_names())
    return walk_admin_folder(path, admins, create_mode=create_mode, adopt=_is_cache,
                             refuse=_refuse, what="an imgpipe cache")
