"""`imgpipe cache ls|prune`: what the shared squashfs cache holds, what in it is unsafe, and
keeping it bounded."""

from __future__ import annotations

from imgpipe.base.config import Settings
from imgpipe.commands.wiring import storage
from imgpipe.enroot.cache.layout import audit
from imgpipe.enroot.cache.uses import Entry, Pruned, entries, prune

__all__ = ["Entry", "Pruned", "list_cache", "prune_cache"]


def list_cache(settings: Settings) -> tuple[list[Entry], list[str]]:
    """Every squashfs file and blob (size, last use, users) and every unsafe thing found."""
    cache = storage(settings)
    return entries(cache), audit(cache)


def prune_cache(settings: Settings, max_size: int | None, unused_for_s: float | None,
                dry_run: bool) -> Pruned:
    return prune(storage(settings), max_size, unused_for_s, dry_run)
