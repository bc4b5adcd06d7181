"""A Pyxis importer on imgpipe's shared squashfs cache (plugstack: ``importer=PATH``).

Pyxis (0.21+) runs ``IMPORTER get URI`` and takes the squashfs path printed on
stdout, then ``IMPORTER release`` when the step ends.  URI comes in Enroot's
form (``docker://[USER@][REGISTRY#]IMAGE[:TAG]``).  ``get`` converts under the
digest's lock when needed, so the first job to need a digest converts it and
every other node reuses the file.  ``release`` never deletes a shared cache
entry; it only forgets this step's record, and may be called any number of
times.  What goes to stderr is what the user sees when the import fails.

Configuration comes from ``$IMGPIPE_CONFIG`` or ``/etc/imgpipe/imgpipe.yaml``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from imgpipe.pipeline.config import load_settings
from imgpipe.pipeline.errors import ImgpipeError

SITE_CONFIG = Path("/etc/imgpipe/imgpipe.yaml")
USAGE = "usage: imgpipe-pyxis-importer get URI | release"


def _step_record() -> Path:
    runtime = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    step = os.environ.get("SLURM_STEP_ID", "nostep")
    return runtime / f"imgpipe-importer.{os.getuid()}.{job}.{step}"


def get(uri: str) -> Path:
    from imgpipe.enroot.convert import convert
    from imgpipe.enroot.squash import SquashOptions
    from imgpipe.pipeline.wiring import registry_client, storage
    from imgpipe.registry.reference import Reference

    explicit = os.environ.get("IMGPIPE_CONFIG") or (str(SITE_CONFIG) if SITE_CONFIG.is_file()
                                                    else None)
    settings = load_settings(explicit)
    ref = Reference.parse(uri, default_registry=settings.registry.address)
    enroot = settings.enroot
    conversion = convert(
        registry_client(settings), storage(settings), ref,
        SquashOptions(enroot.compression, enroot.zstd_level, enroot.processors),
        say=lambda text: print(f"imgpipe: {text}", file=sys.stderr, flush=True))
    from imgpipe.enroot.usage import parse_size, prune, record_use

    marker = record_use(storage(settings), conversion.path,
                        os.environ.get("SLURM_JOB_ID", "nojob"),
                        os.environ.get("SLURM_STEP_ID", "nostep"))
    # A name others can predict in a shared /tmp: never through a link, private to the user.
    fd = os.open(_step_record(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as record:
        record.write(f"{conversion.path}\n{marker}\n")
    if conversion.converted and enroot.cache_max_size:
        prune(storage(settings), max_size=parse_size(enroot.cache_max_size))
    return conversion.path


def release() -> None:
    """End this step's use of the entry it got; the shared file itself always stays."""
    from imgpipe.enroot.usage import release_use

    record = _step_record()
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return  # released already (Pyxis calls release twice), or nothing was got
    with os.fdopen(fd) as handle:
        lines = handle.read().splitlines()
    if len(lines) > 1 and "/.imgpipe/uses/" in lines[1]:
        release_use(Path(lines[1]))
    record.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 2 and args[0] == "get":
            print(get(args[1]), flush=True)
            return 0
        if len(args) == 1 and args[0] == "release":
            release()
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
    from imgpipe.pipeline.process import raise_on_sigterm

    raise_on_sigterm()
    sys.exit(main())
