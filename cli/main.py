"""The `imgpipe` command: parses, dispatches, and is the one place errors are printed.

Exit codes: 0 ok, 1 failed, 2 usage or configuration error, 130 interrupted (Ctrl-C), 143
stopped by SIGTERM (scancel, a time limit).
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

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.signals import Terminated, raise_on_sigterm
from imgpipe.cli.clikit import CONTEXT, invocation, reporting, settings_of
from imgpipe.cli.output import Invocation, Result, emit_error

__all__ = ["CONTEXT", "LAZY_COMMANDS", "cli", "invocation", "main", "reporting", "run",
           "settings_of"]

# Each command module is imported when its command runs (or its own --help is asked), not
# for `imgpipe --help`: the build, registry and recipes modules pull in requests, pydantic
# models, jinja2 and the Docker clients.  The one-line help shown in the command list is
# kept here; tests/test_cli_startup.py checks it against each command's own.
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("imgpipe.cli.build", "plan",
        "Say which images need a build and why, without building anything."),
    "build": ("imgpipe.cli.build", "build",
        "Build the images whose inputs changed (all when none are named) with BuildKit."),
    "push": ("imgpipe.cli.build", "push",
        "Push what `imgpipe build` built and record the digests in imgpipe.lock."),
    "selftest": ("imgpipe.cli.build", "selftest",
        "Run the self-test image.yaml names, in a container of the last build (no "
        "network)."),
    "mirror": ("imgpipe.cli.build", "mirror",
        "Copy an image (the NGC PyTorch base, say) into the site registry by digest."),
    "ci": ("imgpipe.cli.build", "ci",
        "What CI runs on every merge: plan, build what changed, self-test, push, lock."),
    "lock": ("imgpipe.cli.lock", "lock",
        "imgpipe.lock: the digests the recipes and conversions pin."),
    "convert": ("imgpipe.cli.convert", "convert_command",
        "Convert an image into a squashfs file in outputs.squashfs_dir, once per digest."),
    "node-config": ("imgpipe.cli.convert", "node_config",
        "Print what compute nodes need for imgpipe, and check or set up a node."),
    "verify": ("imgpipe.cli.convert", "verify_command",
        "Convert an image here and compare it byte for byte with its published squashfs."),
    "registry": ("imgpipe.cli.registry", "registry",
        "Run the head node's registry and look after what it holds."),
    "recipes": ("imgpipe.cli.recipes", "recipes",
        "Slurm recipes (Pyxis srun/sbatch) for BERT training, dataset preparation and "
        "NCCL checks."),
    "nccl": ("imgpipe.cli.nccl", "nccl",
        "Cluster validation: read all_reduce_perf logs and judge the fabric."),
    "cache": ("imgpipe.cli.cache", "cache",
        "The shared squashfs cache (outputs.squashfs_dir): list it, prune it."),
    "sandbox": ("imgpipe.cli.sandbox", "sandbox",
        "A local Slurm cluster to try recipes on before a real one (needs root)."),
    "report": ("imgpipe.cli.report", "report",
        "Plots and one HTML page of a BERT workflow's results."),
    "config": ("imgpipe.cli.config", "config",
        "The configuration imgpipe runs with, and where each key came from."),
    "site": ("imgpipe.cli.site", "site",
        "Set a site up: its config in /etc/imgpipe and its own cluster profile."),
}


PATH_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
               errno.EROFS, errno.ELOOP, errno.ENAMETOOLONG}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            import importlib

            module, attribute, _ = LAZY_COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the table above, without importing the commands."""
        rows = []
        width = formatter.width - 6 - max(len(name) for name in self.list_commands(ctx))
        for name in self.list_commands(ctx):
            if name in self.commands:
                rows.append((name, self.commands[name].get_short_help_str(width)))
            else:
                stand_in = click.Command(name, help=LAZY_COMMANDS[name][2])
                rows.append((name, stand_in.get_short_help_str(width)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings=CONTEXT)
@click.option("--config", "config_path", metavar="FILE", envvar="IMGPIPE_CONFIG",
              help="A config file over the others (/etc/imgpipe/imgpipe.yaml, then "
              "~/.config/imgpipe/imgpipe.yaml, then the nearest imgpipe.yaml above the current "
              "directory; with none: registry 127.0.0.1:5000, outputs in ./build).  Also "
              "IMGPIPE_CONFIG.  `imgpipe config show --origin` says which file set what.")
@click.option("-v", "--verbose", is_flag=True, help="Log every external command and request.")
@click.version_option(package_name="imgpipe", prog_name="imgpipe")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: bool) -> None:
    """Build GPU-cluster images, push them to the head-node registry, and run them with Slurm.

    \b
    First steps on one machine (no imgpipe.yaml needed):
      imgpipe doctor                # what this machine has and lacks
      imgpipe registry up           # start the registry on 127.0.0.1:5000
      imgpipe registry status       # is it up, what does it hold

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
    from imgpipe.commands.site.doctor import run_checks

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
@click.option("--tag", default=None,
              help="Name of the image to create in the engine [default: "
              "imgpipe/debian-python:bookworm, with -arm64 etc. for another platform].")
@click.option("--platform", "platform", default=None, metavar="OS/ARCH",
              help="Make it for this platform (linux/arm64: debootstrap --arch arm64, its "
              "second stage under emulation; minutes).  Default: this host's.")
@click.option("--suite", default="bookworm", show_default=True, help="Debian release.")
@click.option("--mirror", default="http://deb.debian.org/debian", show_default=True,
              help="Debian mirror debootstrap fetches from.")
@click.option("--rebuild", is_flag=True, help="Make it again even if the image exists.")
@reporting
def base_image(ctx: click.Context, tag: str | None, platform: str | None, suite: str,
               mirror: str, rebuild: bool) -> Result:
    """Make a Debian base image with Python by debootstrap (for hosts that cannot pull).

    Needs root and debootstrap; reuses the image when it already exists.

    \b
    Example (then build the cpu flavor on it):
      imgpipe base-image --tag local/debian-python:bookworm
    # imgpipe base-image --platform linux/arm64   # the cpu flavor's platform_bases
    """
    from imgpipe.base.platforms import Platform
    from imgpipe.commands.builds.baseimage import make_base_image

    made, created = make_base_image(tag, Platform.parse(platform) if platform else None,
                                    suite, mirror, rebuild)
    verb = "created" if created else "already present"
    return Result({"tag": made, "created": created}, [f"{made}: {verb}"])




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
        if exc.errno == errno.ENOSPC:
            emit_error(inv, "no-space", _no_space(exc), "free space there, or point "
                       "imgpipe.yaml at a larger file system")
            return 1
        if exc.errno in PATH_ERRNOS and exc.filename is not None:
            # A path the user gave (or configured) that cannot be used: say which and why.
            emit_error(inv, "path", f"{exc.filename}: {exc.strerror}",
                       "check the path and its permissions")
            if inv.verbose:
                logging.getLogger("imgpipe").debug("error detail", exc_info=exc)
            return 1
        raise  # anything else is a bug: keep its traceback
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
