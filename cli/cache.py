"""`imgpipe cache ls|prune`: what the shared squashfs cache holds, and keeping it bounded."""

from __future__ import annotations

import time

import click

from imgpipe.base.terminal import shown
from imgpipe.base.units import human_bytes, parse_size
from imgpipe.cli.clikit import CONTEXT, parsed_by, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.node.cache import Entry, list_cache, prune_cache


def _age(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:.1f} d" if days >= 1 else f"{seconds / 3600:.1f} h"


@click.group(context_settings=CONTEXT)
def cache() -> None:
    """The shared squashfs cache (outputs.squashfs_dir): list it, prune it.

    \b
    Examples:
      imgpipe cache ls
      imgpipe cache prune --max-size 500G
      imgpipe cache prune --unused-for 30 --dry-run
    """


def _name(entry: Entry) -> str:
    """An entry's name; a private one's with its user's folder (u<uid>/NAME)."""
    folder = entry.path.parent.name
    private = folder[1:].isdigit() and folder.startswith("u")
    return f"{folder}/{entry.path.name}" if private else entry.path.name


@cache.command(name="ls", context_settings=CONTEXT)
@reporting
def ls_command(ctx: click.Context) -> Result:
    """Each squashfs file and blob: size, last use, and the jobs using it now; then
    anything unsafe in the cache (wrong owners or modes, links, planted entries)."""
    found, unsafe, unseen = list_cache(settings_of(ctx))
    now = time.time()
    lines = [f"{'kind':<8} {'size':>10} {'last use':>9}  name (users)"]
    for entry in found:
        users = f" ({', '.join(entry.users)})" if entry.users else ""
        lines.append(f"{entry.kind:<8} {human_bytes(entry.size):>10} "
                     f"{_age(now - entry.last_use):>9}  {shown(_name(entry))}"
                     f"{shown(users)}")
    total = sum(e.size for e in found)
    lines.append(f"{len(found)} entries, {human_bytes(total)}")
    lines += [unseen] if unseen else []
    lines += [f"unsafe: {problem}" for problem in unsafe]  # audit escaped the names in them
    return Result({"entries": [{"kind": e.kind, "path": e.path, "size": e.size,
                                "last_use": e.last_use, "users": e.users} for e in found],
                   "total": total, "unsafe": unsafe, "unreadable": unseen}, lines)


@cache.command(name="prune", context_settings=CONTEXT)
@click.option("--max-size", default=None, metavar="SIZE", callback=parsed_by(parse_size),
              help="Remove least recently used entries until the cache holds at most SIZE "
              "(e.g. 500G, 800M).")
@click.option("--unused-for", type=click.FloatRange(min=0), default=None, metavar="DAYS",
              help="Remove entries not used for DAYS days.")
@click.option("--dry-run", is_flag=True, help="Say what would go, remove nothing.")
@reporting
def prune_command(ctx: click.Context, max_size: int | None, unused_for: float | None,
                  dry_run: bool) -> Result:
    """Remove cache entries, blobs first (they can be fetched again), least recently used
    first.  A squashfs a running job uses (recorded by the Pyxis importer until its
    release) or whose conversion is running is never removed."""
    if max_size is None and unused_for is None:
        raise click.UsageError("say how much to prune: --max-size SIZE or --unused-for DAYS")
    result = prune_cache(settings_of(ctx), max_size,
                         unused_for * 86400 if unused_for is not None else None, dry_run)
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {len(result.removed)} entries ({human_bytes(result.freed)}); "
             f"{human_bytes(result.total_after)} left"]
    lines += [f"  {verb} {e.kind} {shown(e.path.name)}" for e in result.removed]
    lines += [f"  kept (in use: {shown(', '.join(e.users)) or 'locked'}) {shown(e.path.name)}"
              for e in result.kept_in_use]
    skipped = result.skipped_line()
    lines += [skipped] if skipped else []
    return Result({"removed": [str(e.path) for e in result.removed],
                   "kept_in_use": [str(e.path) for e in result.kept_in_use],
                   "not_yours": [str(e.path) for e in result.not_yours],
                   "freed": result.freed, "total_after": result.total_after,
                   "dry_run": dry_run}, lines)
