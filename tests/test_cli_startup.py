"""`imgpipe --help` starts without the heavy modules: command modules load on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click

from imgpipe.pipeline.cli import LAZY_COMMANDS, cli


def test_the_command_list_matches_each_commands_own_help() -> None:
    """The one-line help kept beside the lazy table is what each command says itself."""
    ctx = click.Context(cli)
    for name, (module, attribute, text) in LAZY_COMMANDS.items():
        command = getattr(importlib.import_module(module), attribute)
        assert cli.get_command(ctx, name) is command
        shown = click.Command(name, help=text).get_short_help_str(60)
        assert shown == command.get_short_help_str(60), name


def test_help_imports_no_command_module() -> None:
    probe = ("import sys\n"
             "from imgpipe.pipeline.cli import main\n"
             "code = main(['--help'])\n"
             "heavy = sorted(m for m in ('requests', 'pydantic', 'jinja2', 'docker', "
             "'python_on_whales', 'imgpipe.pipeline.cli_build', 'imgpipe.registry.client') "
             "if m in sys.modules)\n"
             "print(code, heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last == "0 []", last
    assert "sandbox" in done.stdout and "report" in done.stdout


def test_a_lazy_command_runs_and_its_usage_errors_still_exit_2(cli) -> None:
    code, out, err = cli("recipes", "table", "--profile", "local", "--max-nodes", "2")
    assert code == 0, out + err
    code, _, err = cli("build", "--no-such-option")
    assert code == 2 and "no-such-option" in err
