"""`imgpipe registry cache …`: the blob cache (nginx) in front of the registry."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from imgpipe.base.units import human_bytes
from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.registry.blobcache import (
    CacheStatus,
    cache_config,
    cache_down,
    cache_status,
    cache_up,
)


@click.group(context_settings=CONTEXT)
def cache() -> None:
    """A collapsing blob cache (nginx) in front of the registry, for a rack or many jobs.

    Many nodes asking for the same layer at once cost the registry one copy: nginx
    fetches each piece of a blob once (proxy_cache_lock) and serves the rest from its
    cache.  Only blobs by digest pass through it; manifests always come from the
    registry, and every blob is checked against its digest, so the cache can never
    change what a job runs.  Anyone who can reach its port can read every blob it has
    cached: bind it to the cluster network and set registry.cache_server.allow.

    Clients use it when registry.blob_cache names it (e.g. http://rack1:5080); when it
    does not answer they say so in one line and fetch from the registry.

    \b
    Examples:
      imgpipe registry cache up                 # start nginx (registry.cache_server)
      imgpipe registry cache status             # running? where? how much is cached
      imgpipe registry cache config -o nginx.conf   # the file, for a host's own nginx
      imgpipe registry cache down
    """


def _lines(status: CacheStatus) -> list[str]:
    lines = [f"blob cache: {status.url} -> {status.upstream}",
             f"running:    {'yes, pid ' + str(status.pid) if status.running else 'no'}"]
    if status.running and not status.answers:
        lines.append("answers:    no (see the error log in its state folder)")
    lines.append(f"cached:     {human_bytes(status.cache_bytes)} in {status.cache_dir}")
    setting = status.blob_cache_setting
    lines.append(f"clients:    registry.blob_cache: {setting}" if setting else
                 "clients:    registry.blob_cache is not set: nothing here uses it yet")
    return lines


@cache.command(context_settings=CONTEXT)
@reporting
def up(ctx: click.Context) -> Result:
    """Start the blob cache (a no-op when it already runs).

    Renders nginx.conf into registry.cache_server.state_dir and runs Debian's nginx
    (package nginx-light) from there: its pid, logs and temporary files stay in that
    folder.  Listens on registry.cache_server.bind and port (default 127.0.0.1:5080)
    and forwards to the registry's URL (registry.scheme, host, port).
    """
    status = cache_up(settings_of(ctx))
    verb = "started" if status.started else "already running"
    return Result(asdict(status), [f"blob cache {verb}: {status.url}", *_lines(status)[2:]])


@cache.command(context_settings=CONTEXT)
@reporting
def down(ctx: click.Context) -> Result:
    """Stop the blob cache started by `up` (a no-op when none runs); its blobs stay."""
    stopped = cache_down(settings_of(ctx))
    return Result({"stopped": stopped},
                  ["blob cache stopped" if stopped else "blob cache was not running"])


@cache.command(context_settings=CONTEXT)
@reporting
def status(ctx: click.Context) -> Result:
    """Whether the blob cache runs and answers, where, and how much it holds.

    Exits 1 when it does not run.
    """
    status = cache_status(settings_of(ctx))
    return Result(asdict(status), _lines(status), ok=status.running and status.answers)


@cache.command(context_settings=CONTEXT)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the file here instead of printing it.")
@reporting
def config(ctx: click.Context, output: Path | None) -> Result:
    """Print the nginx.conf that `up` runs, for a host that runs nginx itself.

    The paths in it are registry.cache_server's; nginx runs it in the foreground
    (a systemd unit's ExecStart):  nginx -c FILE -p STATE_DIR -e STATE_DIR/error.log

    \b
    Example:
      imgpipe registry cache config -o /etc/imgpipe/blob-cache.conf
    """
    text = cache_config(settings_of(ctx), output)
    if output is not None:
        return Result({"output": output}, [f"wrote {output}"])
    return Result({"config": text}, text.rstrip("\n").splitlines())
