"""`imgpipe lock pull`: imgpipe.lock written back from what the registry holds."""

from __future__ import annotations

import click

from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.builds.images import pull_lock


@click.group(context_settings=CONTEXT)
def lock() -> None:
    """imgpipe.lock: the digests the recipes and conversions pin.

    The registry is the source of truth: every push labels the image with the hash of
    its inputs, so a checkout without the lock (a fresh CI runner) still skips unchanged
    images, and `lock pull` writes the lock back.
    """


@lock.command(context_settings=CONTEXT)
@click.argument("images", nargs=-1, metavar="[IMAGE]...")
@click.option("--flavor", "flavors", multiple=True, type=click.Choice(["ngc", "cpu"]),
              help="Only this flavor (repeatable; default: every flavor of each image).")
@reporting
def pull(ctx: click.Context, images: tuple[str, ...], flavors: tuple[str, ...]) -> Result:
    """Write imgpipe.lock from the registry: each image's version tag, its digest and the
    inputs its labels record.

    \b
    Example (a fresh runner, before `imgpipe ci`):
      imgpipe lock pull && imgpipe plan
    """
    pulled = pull_lock(settings_of(ctx), images, flavors)
    lines = [f"{key}: {entry.pinned}" + (" (new)" if key in pulled.changed else "")
             for key, entry in sorted(pulled.entries.items())]
    return Result({"entries": pulled.entries, "changed": pulled.changed},
                  lines or ["the registry holds no image pushed by imgpipe for this catalog"])
