"""`imgpipe registry …`: the head node's registry and what it holds."""

from __future__ import annotations

from dataclasses import asdict

import click

from imgpipe.base.units import human_bytes
from imgpipe.cli.blobcache import cache
from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.registry.registry import (
    collect_garbage,
    list_registry,
    list_tags,
    registry_status,
    remove_image,
)
from imgpipe.commands.shared.wiring import local_registry


@click.group(context_settings=CONTEXT)
def registry() -> None:
    """Run the head node's registry and look after what it holds.

    \b
    Examples:
      imgpipe registry up                   # start it (idempotent)
      imgpipe registry status               # address, mode, storage, repositories
      imgpipe registry tags local/bert      # tags with their digests
      imgpipe registry rm local/bert:old    # delete that manifest
      imgpipe registry gc                   # reclaim the bytes nothing uses any more
      imgpipe registry cache up             # a blob cache in front of it, for a rack
    """


registry.add_command(cache)


@registry.command(context_settings=CONTEXT)
@click.option("--mode", type=click.Choice(["auto", "container", "binary"]), default=None,
              help="Override registry.server.mode: a registry:2 container, or Debian's "
              "docker-registry binary as a background process.")
@reporting
def up(ctx: click.Context, mode: str | None) -> Result:
    """Start the registry (a no-op when it already runs).

    Listens on registry.server.bind and registry.port (default 127.0.0.1:5000),
    stores blobs in registry.server.data_dir, and allows deletion so that
    `imgpipe registry rm` and `gc` work.
    """
    settings = settings_of(ctx)
    if mode:
        server = settings.registry.server.model_copy(update={"mode": mode})
        settings = settings.model_copy(
            update={"registry": settings.registry.model_copy(update={"server": server})})
    local = local_registry(settings)
    state, started = local.up()
    if state.mode == "external":
        lines = [f"registry already answering: {settings.registry.url} (external: not started "
                 "from this checkout, so `registry down` and `gc` here leave it alone)"]
        return Result({"started": False, "mode": "external", "url": settings.registry.url,
                       "data_dir": None, "pid": None, "container": None}, lines)
    verb = "started" if started else "already running"
    lines = [f"registry {verb}: {settings.registry.url} ({state.mode})",
             f"data: {local.data_dir}"]
    return Result({"started": started, "mode": state.mode, "url": settings.registry.url,
                   "data_dir": local.data_dir, "pid": state.pid, "container": state.container},
                  lines)


@registry.command(context_settings=CONTEXT)
@reporting
def down(ctx: click.Context) -> Result:
    """Stop the registry started by `up` (a no-op when nothing runs); data is kept."""
    stopped = local_registry(settings_of(ctx)).down()
    if stopped.mode in ("container", "binary"):
        return Result({"stopped": True, "mode": stopped.mode},
                      [f"registry stopped ({stopped.mode})"])
    if stopped.mode == "external":
        return Result({"stopped": False, "mode": "external"},
                      [f"{stopped.address} is served by a program imgpipe did not start; "
                       "left running"])
    return Result({"stopped": False, "mode": "down"}, ["registry was not running"])


@registry.command(context_settings=CONTEXT)
@reporting
def status(ctx: click.Context) -> Result:
    """Is the registry reachable; which mode; storage used; repositories and tags.

    Exits 1 when the registry does not answer.
    """
    status = registry_status(settings_of(ctx))
    data = asdict(status)
    lines = [f"registry: {status.url}", f"mode:     {status.mode}"]
    if not status.reachable:
        lines.append(f"reachable: no ({status.error})")
        return Result(data, lines, ok=False)
    lines.append("reachable: yes")
    if status.storage_bytes is not None:
        lines.append(f"storage:  {human_bytes(status.storage_bytes)} in {status.data_dir}")
    lines.append(f"content:  {status.repositories} repositories, {status.tags} tags")
    return Result(data, lines)


@registry.command(name="ls", context_settings=CONTEXT)
@reporting
def list_repositories(ctx: click.Context) -> Result:
    """List every repository with its tags (pages through the whole catalog), and which
    tags have a squashfs published beside them (imgpipe push --squashfs)."""
    address, repositories = list_registry(settings_of(ctx))
    lines = []
    for r in repositories:
        line = f"{r['name']}  {', '.join(r['tags']) or '(no tags)'}"
        if r["squashfs"]:
            line += "  [squashfs published: " + ", ".join(
                f"{tag} ({'/'.join(kinds)})" for tag, kinds in sorted(r["squashfs"].items())) + "]"
        lines.append(line)
    if not repositories:
        lines = ["(the registry holds no repositories)"]
    return Result({"registry": address, "repositories": repositories}, lines)


@registry.command(context_settings=CONTEXT)
@click.argument("repository")
@reporting
def tags(ctx: click.Context, repository: str) -> Result:
    """List REPOSITORY's tags and the manifest digest each points to.

    \b
    Example:
      imgpipe registry tags local/bert --json
    """
    name, infos = list_tags(settings_of(ctx), repository)
    lines = [f"{info.tag:<24} {info.digest}" for info in infos] or ["(no tags)"]
    return Result({"repository": name, "tags": infos}, lines)


@registry.command(context_settings=CONTEXT)
@click.argument("image", metavar="REPO:TAG")
@click.option("--force", is_flag=True, help="Delete even when other tags share the manifest "
              "(they are deleted too).")
@reporting
def rm(ctx: click.Context, image: str, force: bool) -> Result:
    """Delete the manifest REPO:TAG points to.

    The registry deletes manifests, not tags: every other tag pointing to the same
    manifest (the version and git-revision tags of a build, say) goes too.  Those are
    listed and the deletion refused unless --force.  The bytes stay on disk until
    `imgpipe registry gc`; imgpipe.lock and `plan` then see the manifest gone.

    \b
    Example:
      imgpipe registry rm local/bert:0.1.0 --force && imgpipe registry gc
    """
    ref, removal = remove_image(settings_of(ctx), image, force)
    others = [t for t in removal.tags if t != ref.tag]
    lines = [f"deleted {ref.repository}@{removal.digest}"]
    if others:
        lines.append(f"also removed tags pointing to it: {', '.join(others)}")
    if removal.artifacts:
        lines.append(f"also removed {len(removal.artifacts)} artifact(s) published beside it "
                     f"(its squashfs): {', '.join(a[:19] for a in removal.artifacts)}")
    for digest in removal.skipped:
        lines.append(f"skipped {digest[:19]}: listed beside it, but its manifest does not name "
                     "it as subject (or a tag keeps it)")
    lines.append("run `imgpipe registry gc` to free its bytes")
    return Result({"repository": ref.repository, "digest": removal.digest,
                   "tags": removal.tags, "artifacts": removal.artifacts}, lines)


@registry.command(context_settings=CONTEXT)
@click.option("--delete-untagged", is_flag=True,
              help="Also delete manifests no tag points to.  Known to destroy the children "
              "of multi-platform indexes: use only when you know there are none.")
@reporting
def gc(ctx: click.Context, delete_untagged: bool) -> Result:
    """Free the blobs no manifest uses (stops the registry for the collection).

    Artifacts published beside an image (its squashfs) are kept while the image
    is, and deleted first when it is gone.  The registry is stopped while the
    collector runs and started again after, as the registry requires.
    """
    collected = collect_garbage(settings_of(ctx), delete_untagged)
    before, after, orphans = collected.before, collected.after, collected.orphans
    freed = max(before - after, 0)
    lines = [f"deleted {len(o.artifacts)} artifact(s) of {o.repository}@{o.digest[:19]}, "
             "which is gone" for o in orphans if o.artifacts]
    lines += [f"skipped {d[:19]} in {o.repository}: listed as an artifact of "
              f"{o.digest[:19]}, but its manifest does not name it (or a tag keeps it)"
              for o in orphans for d in o.skipped]
    lines.append(f"freed {human_bytes(freed)} ({human_bytes(before)} -> {human_bytes(after)})")
    return Result({"bytes_before": before, "bytes_after": after, "bytes_freed": freed,
                   "orphaned_artifacts": orphans}, lines)
