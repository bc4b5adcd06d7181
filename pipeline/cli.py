"""The `imgpipe` command: parses, dispatches, and is the one place errors are printed.

Exit codes: 0 ok, 1 failed, 2 usage or configuration error, 130 interrupted.
An ImgpipeError prints ``error: … (hint: …)`` and no traceback; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import logging
import shutil
import sys
from pathlib import Path

import click

from imgpipe.pipeline.clikit import CONTEXT, invocation, reporting, settings_of
from imgpipe.pipeline.errors import ImgpipeError
from imgpipe.pipeline.output import Invocation, Result, emit_error
from imgpipe.pipeline.process import Terminated, raise_on_sigterm

__all__ = ["CONTEXT", "cli", "invocation", "main", "reporting", "run", "settings_of"]

@click.group(context_settings=CONTEXT)
@click.option("--config", "config_path", metavar="FILE", envvar="IMGPIPE_CONFIG",
              help="imgpipe.yaml to use (default: the nearest one above the current "
              "directory, else built-in defaults: registry 127.0.0.1:5000, outputs in ./build).")
@click.option("-v", "--verbose", is_flag=True, help="Log every external command and request.")
@click.version_option(package_name="imgpipe", prog_name="imgpipe")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: bool) -> None:
    """Build GPU-cluster images, push them to the head-node registry, and run them with Slurm.

    \b
    First steps on one machine (no imgpipe.yaml needed):
      imgpipe doctor                  what this machine has and lacks
      imgpipe registry up             start the registry on 127.0.0.1:5000
      imgpipe registry status         is it up, what does it hold

    Every command takes --help; commands that report take --json.
    """
    inv = invocation(ctx)
    inv.config = config_path
    inv.verbose = verbose
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if not verbose:  # retries are reported by the error that ends them, not line by line
        logging.getLogger("urllib3").setLevel(logging.ERROR)


@cli.command(context_settings=CONTEXT)
@reporting
def doctor(ctx: click.Context) -> Result:
    """Check the engine, BuildKit, registry, squashfs tools, Slurm, Enroot, Pyxis and disk.

    Each missing piece comes with the way to get it.  Exits 1 when something
    required is missing; Slurm, Enroot and Pyxis are only needed on the cluster.

    \b
    Example:
      imgpipe doctor --json | jq '.data.checks[] | select(.verdict != "ok")'
    """
    from imgpipe.pipeline.doctor import run_checks

    checks = run_checks(settings_of(ctx))
    marks = {"ok": "ok  ", "warn": "warn", "missing": "MISS"}
    lines = []
    for check in checks:
        lines.append(f"{marks[check.verdict]}  {check.name:<18} {check.detail}")
        if check.fix and check.verdict != "ok":
            lines.append(f"      {'':<18} fix: {check.fix}")
    failed = [c for c in checks if c.verdict == "missing" and c.required]
    return Result({"checks": checks}, lines, ok=not failed)


@cli.command(name="base-image", context_settings=CONTEXT)
@click.option("--tag", default="imgpipe/debian-python:bookworm", show_default=True,
              help="Name of the image to create in the engine.")
@click.option("--suite", default="bookworm", show_default=True, help="Debian release.")
@click.option("--mirror", default="http://deb.debian.org/debian", show_default=True,
              help="Debian mirror debootstrap fetches from.")
@click.option("--rebuild", is_flag=True, help="Make it again even if the image exists.")
@reporting
def base_image(ctx: click.Context, tag: str, suite: str, mirror: str, rebuild: bool) -> Result:
    """Make a Debian base image with Python by debootstrap (for hosts that cannot pull).

    Needs root and debootstrap; reuses the image when it already exists.

    \b
    Example (then build the cpu flavor on it):
      imgpipe base-image --tag local/debian-python:bookworm
    """
    from imgpipe.pipeline.baseimage import ensure_base_image

    made, created = ensure_base_image(tag, suite, mirror, rebuild=rebuild)
    verb = "created" if created else "already present"
    return Result({"tag": made, "created": created}, [f"{made}: {verb}"])


def _register_subcommands() -> None:
    from imgpipe.pipeline import cli_build, cli_convert
    from imgpipe.pipeline.cli_cache import cache
    from imgpipe.pipeline.cli_nccl import nccl
    from imgpipe.pipeline.cli_recipes import recipes
    from imgpipe.pipeline.cli_registry import registry
    from imgpipe.pipeline.cli_report import report
    from imgpipe.pipeline.cli_sandbox import sandbox

    cli.add_command(registry)
    cli.add_command(recipes)
    cli.add_command(nccl)
    cli.add_command(cache)
    cli.add_command(sandbox)
    cli.add_command(report)
    for command in [*cli_build.COMMANDS, *cli_convert.COMMANDS]:
        cli.add_command(command)


_register_subcommands()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (tests call this in-process)."""
    inv = Invocation()
    try:
        rv = cli.main(args=argv, prog_name="imgpipe", standalone_mode=False, obj=inv)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:  # usage errors: exit 2 with click's message
        exc.show()
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        print("imgpipe: interrupted; temporary files removed", file=sys.stderr)
        return 130
    except Terminated:
        print("imgpipe: stopped by SIGTERM; temporary files removed", file=sys.stderr)
        return 143
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise  # anything else is a bug: keep its traceback
        emit_error(inv, "no-space", _no_space(exc), "free space there, or point imgpipe.yaml "
                   "at a larger file system")
        return 1
    except ImgpipeError as exc:
        if not inv.command:
            inv.command = " ".join(a for a in (argv if argv is not None else sys.argv[1:])
                                   if not a.startswith("-"))[:60]
        emit_error(inv, exc.code, exc.message, exc.hint)
        if inv.verbose:
            logging.getLogger("imgpipe").debug("error detail", exc_info=exc)
        return exc.exit_code
    return rv if isinstance(rv, int) else 0


def _no_space(exc: OSError) -> str:
    """The folder that filled up, and what it has left (atomic writes left nothing)."""
    where = Path(exc.filename).parent if exc.filename else Path.cwd()
    try:
        free = f"{shutil.disk_usage(where).free / (1 << 20):.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"no space left in {where} ({free})"


def run() -> None:
    """Console-script entry point."""
    raise_on_sigterm()
    sys.exit(main())
