"""docs/reference/, generated from the code: one section per command (from click), the
configuration keys, the profile format and the environment (``commands.builds.reference``).

    .venv/bin/python -m imgpipe.cli.reference --write docs/reference   # after a change
    .venv/bin/python -m imgpipe.cli.reference --check docs/reference   # what the test runs
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import click

from imgpipe.cli.main import cli

PAGES = ("commands.md", "configuration.md", "profiles.md", "environment.md")


def _walk(command: click.Command, ctx: click.Context, path: list[str]
          ) -> Iterator[tuple[list[str], click.Command, click.Context]]:
    yield path, command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, click.Context(sub, info_name=name, parent=ctx,
                                                    **sub.context_settings), [*path, name])


def anchor(path: list[str]) -> str:
    """The section's anchor, as MkDocs' toc makes it from the heading."""
    return "-".join(["imgpipe", *path])


def _help_blocks(text: str) -> list[str]:
    """A command's help as Markdown: paragraphs, and click's \\b blocks (examples) as code."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if lines and lines[0].strip() == "\b":
            body = lines[1:]
            title = body[0].strip() if body and body[0].strip().endswith(":") else None
            code = textwrap.dedent("\n".join(body[1:] if title else body)).splitlines()
            out += ([f"*{title.rstrip(':')}:*", ""] if title else []) + [
                "```sh", *[line.rstrip() for line in code], "```", ""]
        else:
            out += [" ".join(line.strip() for line in lines), ""]
    return out


def _options(command: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option) or param.hidden:
            continue
        names = ", ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])
        value = "" if param.is_flag else f" {param.make_metavar(ctx)}"
        default = ""
        if param.show_default and param.default not in (None, False, ()):
            default = f" [default: {param.default}]"
        text = " ".join((param.help or "").split()) + default
        rows.append(f"| {names}{value.replace('|', '/')} | {text.replace('|', '/')} |")
    return ["| option | meaning |", "|---|---|", *rows, ""] if rows else []


def commands_page() -> str:
    from imgpipe.commands.builds.reference import GENERATED

    root = click.Context(cli, info_name="imgpipe", **cli.context_settings)
    lines = [GENERATED, "# Commands", "",
             "Every command and its options, from the commands themselves (`imgpipe COMMAND "
             "--help` prints the same). Exit codes: 0 ok, 1 failed, 2 usage or configuration "
             "error, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM (scancel, a time "
             "limit). Reporting commands take `--json` (one envelope: version, status, data, "
             "errors).", ""]
    for path, command, ctx in _walk(cli, root, []):
        title = " ".join(["imgpipe", *path])
        lines += [f"## {title}", "", "```text", command.get_usage(ctx).replace("Usage: ", ""),
                  "```", ""]
        lines += _help_blocks(command.help or "")
        lines += _options(command, ctx)
        if isinstance(command, click.Group):
            subs = [n for n in command.list_commands(ctx)
                    if not (command.get_command(ctx, n) or click.Command(n)).hidden]
            lines += ["Commands: " + ", ".join(f"[{n}](#{anchor([*path, n])})" for n in subs),
                      ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def generate() -> dict[str, str]:
    from imgpipe.commands.builds.reference import config_page, environment_page, profiles_page

    return {"commands.md": commands_page(), "configuration.md": config_page(),
            "profiles.md": profiles_page(), "environment.md": environment_page()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("--write", "--check"):
        print("usage: python -m imgpipe.cli.reference --write|--check DIR", file=sys.stderr)
        return 2
    folder = Path(args[1])
    stale = []
    for name, text in generate().items():
        path = folder / name
        if args[0] == "--write":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            stale.append(str(path))
    if stale:
        print(f"out of date: {', '.join(stale)} (python -m imgpipe.cli.reference --write "
              f"{folder})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
