"""`imgpipe config show [--origin]`: the effective configuration, as git config --show-origin
and pip config list print theirs."""

from __future__ import annotations

import json

import click

from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result


@click.group(context_settings=CONTEXT)
def config() -> None:
    """The configuration imgpipe runs with, and where each key came from.

    \b
    Layers, each overriding the one before it key by key:
      /etc/imgpipe/imgpipe.yaml                the site's (an admin installs it)
      $XDG_CONFIG_HOME/imgpipe/imgpipe.yaml    yours (~/.config/imgpipe/imgpipe.yaml)
      imgpipe.yaml                             the project's: the nearest one upwards
      --config FILE or IMGPIPE_CONFIG=FILE     one run's
    """


@config.command(name="show", context_settings=CONTEXT)
@click.option("--origin", is_flag=True, help="Say which file set each key (default: the "
              "built-in value).")
@reporting
def show(ctx: click.Context, origin: bool) -> Result:
    """Print every effective key and its value, one a line, then a warning line for each
    set of keys that cannot work together (e.g. published compressions no node asks for).

    \b
    Examples:
      imgpipe config show
      imgpipe config show --origin | grep -v default
      imgpipe config show --json | jq '.data.keys[] | select(.key == "registry.host")'
    """
    from imgpipe.commands.site.config import conflicts, effective_keys

    settings = settings_of(ctx)
    keys = effective_keys(settings)
    width = max((len(k.origin) for k in keys), default=0)
    lines = [(f"{k.origin:<{width}}  " if origin else "") + f"{k.key}={json.dumps(k.value)}"
             for k in keys]
    found = conflicts(settings)  # each key valid, together they cannot work
    return Result({"keys": [{"key": k.key, "value": k.value, "origin": k.origin}
                            for k in keys], "conflicts": found},
                  lines + [f"warning: {line}" for line in found])
