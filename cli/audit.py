"""``imgpipe-audit --config FILE EVENT IMAGE DIGEST SQUASHFS RESULT JOB``: one line of the
site's audit log, appended as root (``imgpipe.commands.node.auditlog``); the importer and the
cache writer run it through the sudoers line of docs/admin.md ("Audit log").  It prints
nothing when the line is written; anything else is one line on stderr and exit 1 (2 for a
call of the wrong form).  ``imgpipe-audit --config FILE --logrotate`` prints the logrotate
file (``/etc/logrotate.d/imgpipe``) for the log FILE names.
"""

from __future__ import annotations

import os
import sys

# Root may run it with any environment (the importer as root calls it directly): a
# PYTHONPATH must not choose what root imports, so it runs again isolated (python -I), as
# the importer does.  Through sudo the environment is reset and this costs nothing.
ISOLATE_FROM = ("PYTHONPATH", "PYTHONUSERBASE", "PYTHONSTARTUP", "PYTHONPLATLIBDIR",
                "PYTHONHOME", "PYTHONINSPECT")
if (not sys.flags.isolated and os.path.basename(sys.argv[0]) == "imgpipe-audit"
        and any(os.environ.get(name) for name in ISOLATE_FROM)):
    os.execv(sys.executable, [sys.executable, "-I", "-m", "imgpipe.cli.audit", *sys.argv[1:]])

PROGRAM = "imgpipe-audit"
USAGE = (f"usage: {PROGRAM} --config FILE EVENT IMAGE DIGEST SQUASHFS RESULT JOB | "
         f"{PROGRAM} --config FILE --logrotate")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[0] != "--config":
        print(USAGE, file=sys.stderr)
        return 2
    from imgpipe.base.errors import ImgpipeError
    from imgpipe.base.terminal import safe_line
    from imgpipe.commands.node.auditlog import logrotate_file, record_call

    try:
        if args[2:] == ["--logrotate"]:
            print(logrotate_file(args[1]), end="", flush=True)
        else:
            record_call(args[1], args[2:], os.environ)
    except ImgpipeError as exc:
        print(safe_line(f"{PROGRAM}: error: {exc}"), file=sys.stderr)
        return 1
    except OSError as exc:  # one line, never a traceback: the importer shows it to the user
        where = f" {exc.filename}" if exc.filename else ""
        print(safe_line(f"{PROGRAM}: error:{where}: {exc.strerror or exc}"), file=sys.stderr)
        return 1
    return 0


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":  # the isolated re-run above
    run()
