"""`imgpipe cache ls|prune`: what the shared squashfs cache holds, what in it is unsafe, and
keeping it bounded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.terminal import shown
from imgpipe.base.units import human_bytes, parse_size
from imgpipe.commands.shared.wiring import storage
from imgpipe.enroot.cache.layout import audit
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.uses import (
    Entry,
    Pruned,
    entries,
    prune,
    unreadable_line,
    unreadable_private,
)

__all__ = ["Entry", "Pruned", "list_cache", "prune_after_conversion", "prune_cache"]


def list_cache(settings: Settings) -> tuple[list[Entry], list[str], str | None]:
    """Every squashfs file and blob (size, last use, users), every unsafe thing found, and a
    line for the private entries this account cannot read (None: it saw them all)."""
    cache = storage(settings)
    unreadable = unreadable_private(cache)
    return entries(cache), audit(cache), unreadable_line(unreadable) if unreadable else None


def prune_cache(settings: Settings, max_size: int | None, unused_for_s: float | None,
                dry_run: bool) -> Pruned:
    return prune(storage(settings), max_size, unused_for_s, dry_run)


def prune_after_conversion(cache: Storage, max_size: str, made: Path,
                           say: Callable[[str], None]) -> None:
    """Keep the cache under ``enroot.cache_max_size`` after a conversion (the importer's
    ``get``, the cache writer), never removing ``made``, the entry it made: what this user
    may not remove is left with one line, and nothing here ever fails the conversion that
    just succeeded."""
    try:
        pruned = prune(cache, max_size=parse_size(max_size), keep=frozenset({made}))
    except (ImgpipeError, OSError) as exc:
        say(f"pruning the cache to {max_size} did not finish: {shown(str(exc))}")
        return
    if pruned.removed:
        say(f"pruned {len(pruned.removed)} entries ({human_bytes(pruned.freed)}) to keep the "
            f"cache under {max_size}")
    skipped = pruned.skipped_line()
    if skipped:
        say(skipped)
