"""The docs say what the code does, and fail the suite the day they stop: the reference pages
are what the code generates; every `imgpipe …` line in the README, docs/ and the commands'
--help examples parses with click (nothing runs); every profile named exists; every
config_*.sh name is one the recipes' scaling makes; every repository path quoted exists;
every config key has a meaning and every key the docs name is one."""

from __future__ import annotations

import re
import shlex
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import click
import pytest

from imgpipe.cli.main import cli
from imgpipe.cli.reference import main as reference
from imgpipe.commands.builds.reference import config_keys
from imgpipe.recipes.errors import ShapeError
from imgpipe.recipes.profiles import SHIPPED, load_profile
from imgpipe.recipes.scaling import shape_for

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench/README.md",
         *sorted((ROOT / "docs").glob("*.sh"))]  # the scripts the pages show
SEPARATORS = {"&&", "||", ";", "|", "&"}
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:\[[^\]]*\])?|.*<[^>]*>.*|\.\.\.|…|[A-Z]+:.*)$")


def _code_lines(text: str) -> Iterator[tuple[bool, str]]:
    """(whole command?, text): shell lines of fenced blocks, continuations joined (whole
    commands), and inline code spans (which may name a command and leave its arguments)."""
    fenced = shell = False
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            shell = line.strip()[3:] in ("sh", "bash", "shell", "console", "")
            continue
        if fenced and not shell:
            continue
        if fenced:
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            yield True, pending
            pending = ""
        else:
            spans = line.split("`")[1::2]  # what stands between backticks
            yield from ((False, span) for span in spans
                        if re.match(r"^(?:\S*/)?imgpipe ", span.strip()))


def imgpipe_lines() -> list[tuple[str, bool, list[str]]]:
    """(where, whole command?, argv after `imgpipe`) of every imgpipe command shown."""
    found = []
    for page in PAGES:
        text = page.read_text()
        if page.suffix == ".sh":  # a script is all code
            text = f"```sh\n{text}\n```\n"
        for whole, line in _code_lines(text):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            segment: list[str] = []
            for word in [*words, ";"]:
                if word not in SEPARATORS:
                    segment.append(word)
                    continue
                names = [i for i, w in enumerate(segment) if Path(w).name == "imgpipe"
                         and w not in ("imgpipe/", )]
                argv = segment[names[0] + 1:] if names else []
                argv = argv[:next((i for i, w in enumerate(argv)
                                   if w.startswith((">", "<", "2>"))), len(argv))]
                if argv:
                    found.append((f"{page.relative_to(ROOT)}: {line.strip()[:90]}", whole,
                                  argv))
                segment = []
    return found


def _resolve(argv: list[str]) -> tuple[click.Command, click.Context, list[str]]:
    """The command ``argv`` names and its context, parsed as `imgpipe` would (no callback
    runs but the parameters' own conversions)."""
    with warnings.catch_warnings():  # click 8.2 deprecates protected_args, which 8.1 needs
        warnings.simplefilter("ignore", DeprecationWarning)
        return _resolve_quietly(argv)


def _resolve_quietly(argv: list[str]) -> tuple[click.Command, click.Context, list[str]]:
    ctx = cli.make_context("imgpipe", list(argv))
    command: click.Command = cli
    rest = [*ctx.protected_args, *ctx.args]
    while isinstance(command, click.Group) and rest:
        name, sub, rest = command.resolve_command(ctx, rest)
        assert name is not None and sub is not None
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
        rest = [*ctx.protected_args, *ctx.args] if isinstance(sub, click.Group) else ctx.args
    return command, ctx, rest


def _synopsis(argv: list[str]) -> None:
    """A line with placeholders (IMAGE, DIR, N): its command and options must exist."""
    command: click.Command = cli
    ctx = click.Context(cli, info_name="imgpipe", **cli.context_settings)
    for word in argv:
        if isinstance(command, click.Group) and not word.startswith("-") \
                and not PLACEHOLDER.match(word):
            sub = command.get_command(ctx, word)
            assert sub is not None, f"no command {word!r}"
            command, ctx = sub, click.Context(sub, info_name=word, parent=ctx,
                                              **sub.context_settings)
        elif word.startswith("--"):
            names = {o for p in command.get_params(ctx) for o in
                     (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
            assert word.split("=")[0] in names, f"{command.name} has no option {word}"


LINES = imgpipe_lines()


def test_the_pages_show_many_commands() -> None:
    assert len(LINES) > 150, len(LINES)  # the extraction itself works


@pytest.mark.parametrize(("where", "whole", "argv"), LINES,
                         ids=[f"{i}" for i in range(len(LINES))])
def test_every_imgpipe_line_parses(where: str, whole: bool, argv: list[str]) -> None:
    if {"--help", "-h", "--version"} & set(argv):
        return
    try:
        if not whole or any(PLACEHOLDER.match(word) or "$" in word for word in argv):
            _synopsis(argv)
        else:
            _resolve(argv)
    except click.BadParameter as exc:
        if "does not exist" not in exc.format_message():  # an example's path: fine here
            pytest.fail(f"{where}: {exc.format_message()}")
    except (click.ClickException, AssertionError) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        pytest.fail(f"{where}: {message}")


@cache
def _defined_profiles() -> set[str]:
    names = set(SHIPPED) | {"site"}  # `imgpipe site init` names its profile "site"
    for _, _, argv in LINES:
        if argv[:3] == ["recipes", "profile", "new"] and len(argv) > 3:
            names.add(argv[3])
        if "--profile-name" in argv:
            names.add(argv[argv.index("--profile-name") + 1])
    return names


def test_every_profile_named_exists() -> None:
    wrong = []
    for where, _, argv in LINES:
        named = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w in ("--profile", "--from")]
        if argv[:3] == ["recipes", "profile", "check"] and len(argv) > 3:
            named.append(argv[3])
        wrong += [f"{where}: {name}" for name in named
                  if not PLACEHOLDER.match(name) and name not in _defined_profiles()]
    assert wrong == []


def _config_names(nodes: int, gpus: int) -> set[str]:
    names = set()
    for profile in map(load_profile, SHIPPED):
        if profile.gpus_per_node == gpus:
            for phase in (1, 2):
                try:
                    names.add(shape_for(profile, nodes, phase).config_name)
                except ShapeError:
                    pass
    return names


def test_every_config_file_named_is_one_the_recipes_write() -> None:
    wrong = []
    for page in PAGES:
        for match in re.finditer(r"config_(\d+)x(\d+)x(\d+)x(\d+)\.sh", page.read_text()):
            if match[0] not in _config_names(int(match[1]), int(match[2])):
                wrong.append(f"{page.relative_to(ROOT)}: {match[0]} (render writes "
                             f"{sorted(_config_names(int(match[1]), int(match[2])))})")
    assert wrong == []


PATH = re.compile(r"(?<![\w/.~$-])((?:docs|enroot|cli|commands|pipeline|registry|recipes|base|"
                  r"images|tests|bench|\.ci|\.github)/[\w./-]*[\w/])")


def test_every_repository_path_quoted_exists() -> None:
    missing = []
    for page in PAGES:
        for match in PATH.finditer(page.read_text()):
            path = match[1]
            relative = (page.parent / path) if page.parent != ROOT and not \
                (ROOT / path).exists() else ROOT / path
            if not (ROOT / path).exists() and not relative.exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


def test_every_config_key_has_a_meaning_and_every_key_named_exists() -> None:
    from imgpipe.base.config import Settings
    from imgpipe.commands.builds.reference import _fields

    assert [key for key, _, _, text in _fields(Settings) if not text] == []
    from imgpipe.base.config import RENAMED_ENROOT_KEYS

    keys = set(config_keys()) | {f"enroot.{old}" for old in RENAMED_ENROOT_KEYS}  # still read
    sections = {key.split(".")[0] for key in keys if "." in key}
    named = set()
    for page in PAGES:
        for match in re.finditer(r"`((?:registry|outputs|docker|build|enroot|recipes)"
                                 r"(?:\.[a-z_]+)+)(?::[^`]*)?`", page.read_text()):
            named.add((page.relative_to(ROOT), match[1]))
    files = ("io", "conf", "yaml", "json", "md", "py", "sh", "d")  # docker.io, enroot.conf
    wrong = [f"{page}: {key}" for page, key in sorted(named)
             if key not in keys and not any(k.startswith(key + ".") for k in keys)
             and key.split(".")[0] in sections and key.rsplit(".", 1)[1] not in files]
    assert wrong == []


def test_the_reference_pages_are_what_the_code_generates() -> None:
    assert reference(["--check", str(ROOT / "docs" / "reference")]) == 0
