"""``imgpipe-pyxis-importer get URI | release``: the program Pyxis (0.21+) runs to import an
image (``plugstack.conf``: ``importer=PATH``); its work is ``imgpipe.commands.node.importer``.
``stage URI`` and ``take URI [SHA256 STAGED MANIFEST]`` are what the recipes run where
squashfs caches are node-local (``imgpipe.commands.node.fanout``); ``broadcast URI``, one
task per node under ``srun --mpi=pmix``, gets the image onto every node of the job at once
(``imgpipe.commands.node.broadcast``); ``ahead URI FOLDER`` is its batch host's fetch,
which the recipes start with the job (``imgpipe.commands.node.batchfetch``).

``get`` prints the squashfs path Pyxis mounts or unpacks; ``release`` ends the step's
recorded use when the step ends.  What goes to stderr is what the user sees when the import
fails: one line, never a traceback.  Configuration comes from ``$IMGPIPE_CONFIG`` or
``/etc/imgpipe/imgpipe.yaml``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Pyxis runs the importer with the job's environment.  A user's PYTHONPATH (a yaml.py of
# theirs, packages of another Python) must not decide what the importer imports, or every
# container job of that user fails, nvcr.io's too: then the importer runs again isolated
# (python -I ignores PYTHON* variables and the user's site folder), before importing more.
ISOLATE_FROM = ("PYTHONPATH", "PYTHONUSERBASE", "PYTHONSTARTUP", "PYTHONPLATLIBDIR")
if (not sys.flags.isolated and os.path.basename(sys.argv[0]) == "imgpipe-pyxis-importer"
        and any(os.environ.get(name) for name in ISOLATE_FROM)):
    os.execv(sys.executable, [sys.executable, "-I", "-m", "imgpipe.cli.importer",
                              *sys.argv[1:]])

from imgpipe.commands.node.importer import (  # noqa: E402 (after the isolation above)
    fast_get,
    get,
    is_foreign,
    record_step,
    release,
    through_mirrors,
)

USAGE = ("usage: imgpipe-pyxis-importer get URI | release | stage URI | take URI "
         "[SHA256 STAGED MANIFEST] | broadcast URI | ahead URI FOLDER")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and args[0] == "release":
        try:
            release()
        except OSError as exc:
            print(f"imgpipe: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 1
        return 0
    from imgpipe.base.errors import ImgpipeError

    try:
        if len(args) == 2 and args[0] == "get":
            uri = through_mirrors(args[1])
            if is_foreign(uri):  # another registry's image: as Pyxis alone would
                from imgpipe.commands.node.foreign import enroot_get

                path = enroot_get(uri)
            else:
                path = _from_the_site(args[1], uri)
                record_step(path)
            print(path, flush=True)
            return 0
        if args[:1] in (["stage"], ["take"]) and len(args) in (2, 5):
            return _fanout(args)
        if len(args) == 3 and args[0] == "ahead":  # the batch host's fetch, for a broadcast
            from imgpipe.commands.node.batchfetch import fetch_ahead

            return fetch_ahead(args[1], args[2])
        if len(args) == 2 and args[0] == "broadcast":
            from imgpipe.commands.node.broadcast import broadcast

            print(broadcast(args[1]), flush=True)
            return 0
    except ImgpipeError as exc:
        print(f"imgpipe: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # stderr is all the user sees: one line, never a traceback
        where = f" {exc.filename}" if exc.filename else ""
        print(f"imgpipe: error:{where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(USAGE, file=sys.stderr)
    return 2


def _from_the_site(asked: str, uri: str) -> Path:
    """``uri`` from the site's registry; where it is the site's mirror of ``asked`` (another
    registry's image), a failure names the command that copies it there."""
    from imgpipe.base.errors import ImgpipeError

    try:
        return fast_get(uri, "get") or get(uri)
    except ImgpipeError as exc:
        if uri == asked:
            raise
        from imgpipe.commands.node.foreign import mirror_hint

        raise ImgpipeError(f"{asked} is taken from the site registry's mirror, and "
                           f"{exc.message}", hint=mirror_hint(asked)) from None


def _fanout(args: list[str]) -> int:
    from pathlib import Path

    from imgpipe.commands.node.fanout import Staged, stage, take

    if args[0] == "stage" and len(args) == 2:
        print(stage(args[1]).line(), flush=True)
        return 0
    if args[0] == "take":
        staged = (Staged(Path(args[3]), args[2], Path(args[3]), args[4]) if len(args) == 5
                  else None)
        print(take(args[1], staged), flush=True)
        return 0
    print(USAGE, file=sys.stderr)
    return 2


def run() -> None:
    if sys.argv[1:2] in (["get"], ["stage"], ["take"], ["broadcast"], ["ahead"]):
        # a conversion may run: SIGTERM must clean up
        from imgpipe.base.signals import raise_on_sigterm

        raise_on_sigterm()
    sys.exit(main())


if __name__ == "__main__":  # the isolated re-run above
    run()
