"""What every command module shares: click's context settings, the per-run Invocation,
settings loaded on first use, and ``reporting`` (--json and the Result renderer).

Kept apart from ``cli.py``, which imports every command module to register it, so that
each command module imports on its own (``import imgpipe.cli.build``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from imgpipe.cli.output import Invocation, Result, emit

if TYPE_CHECKING:  # pydantic models: imported when a command first needs its settings
    from imgpipe.base.config import Settings

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def invocation(ctx: click.Context) -> Invocation:
    return ctx.ensure_object(Invocation)


def settings_of(ctx: click.Context) -> Settings:
    """Settings for this run, loaded on first use (so --help works with a broken config)."""
    from imgpipe.base.configlayers import load_settings

    inv = invocation(ctx)
    cached = ctx.meta.get("imgpipe.settings")
    if cached is None:
        cached = load_settings(inv.config)
        ctx.meta["imgpipe.settings"] = cached
    return cached


def reporting(fn: Callable[..., Result]) -> Callable[..., int]:
    """Give a command --json and render the Result it returns; exit 1 when not ok."""

    @click.option("--json", "as_json", is_flag=True,
                  help="Print one JSON envelope (version, status, data, errors) on stdout.")
    @click.pass_context
    @functools.wraps(fn)
    def wrapper(ctx: click.Context, as_json: bool, **kwargs: Any) -> int:
        inv = invocation(ctx)
        inv.json = inv.json or as_json
        inv.command = ctx.command_path.partition(" ")[2]
        result = fn(ctx, **kwargs)
        emit(inv, result)
        return 0 if result.ok else 1

    return wrapper


def parsed_by(parse: Callable[[str], Any]) -> Callable[[click.Context, click.Parameter, Any],
                                                      Any]:
    """A click callback that converts an option's text with ``parse``; its ValueError
    becomes a usage error naming the option (exit 2)."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc

    return callback
