"""`imgpipe --help` starts without the heavy modules (command modules load on first use), and
user mistakes met on the way are one line, never a traceback."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click

from imgpipe.cli.main import LAZY_COMMANDS, cli


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
             "from imgpipe.cli.main import main\n"
             "code = main(['--help'])\n"
             "heavy = sorted(m for m in ('requests', 'pydantic', 'jinja2', 'docker', "
             "'python_on_whales', 'imgpipe.cli.build', 'imgpipe.registry.client') "
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


def test_an_unusable_path_is_a_one_line_error(cli) -> None:
    code, out, err = cli("recipes", "render", "--profile", "local", "--nodes", "2",
                         "--image", "/images/bert.sqsh", "-o", "/proc/nope")
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "error: /proc/nope: No such file or directory (hint: check the path and its "
        "permissions)"]


def test_a_stale_build_state_file_means_build_again(cli) -> None:
    """build/state/builds.json from another imgpipe version (other fields): no traceback,
    the image simply counts as not built here."""
    import shutil
    from pathlib import Path

    shutil.copytree(Path(__file__).resolve().parents[2] / "images" / "bert",
                    cli.folder / "images" / "bert")
    state = cli.folder / "build" / "state"
    state.mkdir(parents=True)
    (state / "builds.json").write_text('{"bert/cpu": {"image_id": 5, "old": true}, "x": []}')
    from tests.services import free_port

    cli.write_config({"registry": {"port": free_port()}})  # nothing answers there
    code, _, err = cli("push", "bert")
    assert code == 1 and "Traceback" not in err
    assert err.strip().startswith("error: bert/cpu has not been built here, and the registry "
                                  "cannot be asked")
    assert err.strip().endswith("(hint: imgpipe build bert --flavor cpu)")
    assert len(err.strip().splitlines()) == 1


def _complete(words: str, index: int) -> list[str]:
    from pathlib import Path

    imgpipe = str(Path(sys.executable).parent / "imgpipe")
    done = subprocess.run([imgpipe], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "COMP_WORDS": words,
                               "COMP_CWORD": str(index), "_IMGPIPE_COMPLETE": "bash_complete"})
    assert done.returncode == 0, done.stderr
    return [line.split(",", 1)[1] for line in done.stdout.splitlines()]


def test_shell_completion_knows_the_lazy_commands_and_their_choices() -> None:
    """What the README tells users to put in their shell: commands (loaded on demand),
    subcommands and option choices complete."""
    from concurrent.futures import ThreadPoolExecutor

    asked = [("imgpipe reg", 1), ("imgpipe registry ", 2),
             ("imgpipe recipes render --runtime ", 4)]
    with ThreadPoolExecutor(max_workers=3) as pool:  # three shells: most of it is Python's start
        command, subcommands, runtimes = pool.map(lambda ask: _complete(*ask), asked)
    assert command == ["registry"]
    assert set(subcommands) >= {"up", "down", "status", "ls", "rm"}
    assert runtimes == ["pyxis", "charliecloud", "host"]


def test_version() -> None:
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-c", "from imgpipe.cli.main import run; run()",
                           "--version"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"imgpipe, version {version('imgpipe')}"
