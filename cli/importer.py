"""``imgpipe-pyxis-importer get URI | release``: the program Pyxis (0.21+) runs to import an
image (``plugstack.conf``: ``importer=PATH``); its work is ``imgpipe.commands.importer``.

``get`` prints the squashfs path Pyxis mounts or unpacks; ``release`` ends the step's
recorded use when the step ends.  What goes to stderr is what the user sees when the import
fails: one line, never a traceback.  Configuration comes from ``$IMGPIPE_CONFIG`` or
``/etc/imgpipe/imgpipe.yaml``.
"""

from __future__ import annotations

import sys

from imgpipe.commands.importer import fast_get, get, is_foreign, record_step, release

USAGE = "usage: imgpipe-pyxis-importer get URI | release"


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
            if is_foreign(args[1]):  # another registry's image: as Pyxis alone would
                from imgpipe.commands.foreign import enroot_get

                path = enroot_get(args[1])
            else:
                path = fast_get(args[1]) or get(args[1])
                record_step(path)
            print(path, flush=True)
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


def run() -> None:
    if sys.argv[1:2] == ["get"]:  # a conversion may run: SIGTERM must clean up
        from imgpipe.base.signals import raise_on_sigterm

        raise_on_sigterm()
    sys.exit(main())
