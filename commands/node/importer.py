"""The Pyxis importer's work on imgpipe's shared squashfs cache (the program is
``imgpipe.cli.importer``; plugstack: ``importer=PATH``).

Pyxis (0.21+) runs ``IMPORTER get URI`` and takes the squashfs path printed on
stdout, then ``IMPORTER release`` when the step ends.  URI comes in Enroot's
form (``docker://[USER@][REGISTRY#]IMAGE[:TAG]``).  ``get`` converts under the
digest's lock when needed, so the first job to need a digest converts it and
every other node reuses the file, or fetches the squashfs published beside the
image when the job's IMGPIPE_SQUASHFS_PINS (the recipes set it) names its digest.
``release`` never deletes a shared cache
entry; it only ends this step's recorded use, and may be called any number of
times.  What goes to stderr is what the user sees when the import fails.

With Pyxis's squashfuse mode a job starts in well under a second, so ``get`` for a
digest already converted answers on a fast path: the standard library, yaml and
imgpipe's light modules only (no pydantic, no requests), no network for a digest and
one HEAD request for a tag.  Anything it does not recognise (credentials, TLS, an
index, a digest not converted yet) goes the full way.

Configuration comes from ``$IMGPIPE_CONFIG`` or ``/etc/imgpipe/imgpipe.yaml``.  Where the
site sets ``audit.log``, each answer is a line of its audit log (``imgpipe.commands.node.audit``);
the fast path then starts the recorder too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from imgpipe.registry.ranges import Verified
    from imgpipe.registry.reference import Reference

SITE_CONFIG = "/etc/imgpipe/imgpipe.yaml"
# The defaults of imgpipe.base.config that the fast path reads (tests/unit/test_node_site.py
# keeps them equal).
DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SCHEME = "127.0.0.1", 5000, "http"
DEFAULT_SQUASHFS_DIR = "build/squashfs"
# base.config's TRUSTED_KEYS (the same test): a file that sets one is read by the full loader
TRUSTED_KEYS = ("enroot.cache_owner", "enroot.cache_writer", "audit.log", "audit.recorder")
BROADCAST_AHEAD_ENV = "IMGPIPE_BROADCAST_AHEAD"  # the folder of a broadcast's fetch started ahead
DOCKER_HUB = "registry-1.docker.io"
IMPORTED = "imported-by-enroot"  # a step record's first line for another registry's image


def pyxis_folder() -> str | None:
    """``$PYXIS_RUNTIME_PATH/UID``: the folder of this user's that Pyxis makes on each node
    for its own imports (Pyxis sets PYXIS_RUNTIME_PATH for importers); None outside Pyxis
    or when it is not this user's alone."""
    import stat

    runtime = os.environ.get("PYXIS_RUNTIME_PATH", "")
    if not runtime.startswith("/"):
        return None
    folder = os.path.join(runtime, str(os.getuid()))
    try:
        os.mkdir(folder, 0o700)  # Pyxis made it (root's /run/pyxis): this is for a test
    except OSError:
        pass
    try:
        info = os.lstat(folder)
    except OSError:
        return None
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
        return folder
    return None


def cache_folder() -> str | None:
    """This user's private folder of the node's squashfs cache (``.imgpipe/tmp/uUID``), by
    name alone: nothing is asked of the file system (it may be Lustre) until it is used."""
    squashfs = (_quick() or {}).get("squashfs_dir")
    return os.path.join(str(squashfs), ".imgpipe", "tmp", f"u{os.getuid()}") if squashfs \
        else None


def _own_folder(folder: str) -> bool:
    """``folder`` made 0700 where missing, and this user's alone."""
    import stat

    try:
        os.mkdir(folder, 0o700)
    except OSError:
        pass
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and not info.st_mode & 0o077)


def import_folder() -> str | None:
    """Where this user's import of another registry's image goes: Pyxis's runtime folder of
    the user (the squashfs cache is then not touched at all), else the cache's private
    folder; None when neither is usable."""
    pyxis = pyxis_folder()
    if pyxis:
        return pyxis
    cache = cache_folder()
    return cache if cache and _own_folder(cache) else None


def _record_dir() -> str:
    """A folder of this user's alone for the step records: Pyxis's runtime folder of this
    user, else $XDG_RUNTIME_DIR, else ~/.cache/imgpipe (never a predictable name in a shared
    /tmp); made 0700 and checked to be the user's own, not a link."""
    import stat

    candidates = [pyxis_folder() or "", os.environ.get("XDG_RUNTIME_DIR", "")]
    home = os.path.expanduser("~")
    if home and home != "~":
        candidates.append(os.path.join(home, ".cache", "imgpipe"))
    candidates.append("cache")  # the node cache's folder of this user's: asked last
    for folder in filter(None, candidates):
        if folder == "cache":  # never made above a cache nobody set up
            cache = cache_folder()
            if cache and _own_folder(cache):
                return cache
            continue
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            info = os.lstat(folder)
        except OSError:
            continue
        if (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
                and not info.st_mode & 0o077):
            return folder
    raise OSError("no private folder for the step record: not $PYXIS_RUNTIME_PATH/"
                  f"{os.getuid()}, $XDG_RUNTIME_DIR, ~/.cache/imgpipe or the squashfs "
                  "cache's .imgpipe/tmp/uUID (each must be a folder of yours alone, 0700)")


def _step_record() -> str:
    """This user's record of what this step got (the release path needs only ``os``)."""
    import socket

    job = os.environ.get("SLURM_JOB_ID", "nojob")
    step = os.environ.get("SLURM_STEP_ID", "nostep")
    return os.path.join(_record_dir(), f"importer.{socket.gethostname()}.{job}.{step}")


def config_file() -> str | None:
    return os.environ.get("IMGPIPE_CONFIG") or (SITE_CONFIG if os.path.isfile(SITE_CONFIG)
                                                 else None)


_QUICK: dict[str | None, dict[str, Any] | None] = {}


def _quick() -> dict[str, Any] | None:
    """quick_settings of this process's config file, read once."""
    path = config_file()
    if path not in _QUICK:
        _QUICK[path] = quick_settings(path)
    return _QUICK[path]


def quick_settings(path: str | None) -> dict[str, Any] | None:
    """The few settings the fast path needs, read with yaml alone; None when the file
    says anything the fast path would have to interpret (then the full loader decides)."""
    from pathlib import Path

    import yaml

    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as handle:
                info = os.fstat(handle.fileno())
                raw = yaml.load(handle, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (OSError, yaml.YAMLError):
            return None
        if not isinstance(raw, dict):
            return None
        # what the threat model trusts comes only from a file root owns and nobody else may
        # write: any other file that sets it, the full loader refuses (configlayers)
        if (info.st_uid != 0 or info.st_mode & 0o022) and any(
                isinstance(raw.get(section), dict) and raw[section].get(key) is not None
                for section, _, key in (dotted.partition(".") for dotted in TRUSTED_KEYS)):
            return None
    registry = raw.get("registry") or {}
    outputs = raw.get("outputs") or {}
    enroot = raw.get("enroot") or {}
    if not all(isinstance(x, dict) for x in (registry, outputs, enroot)):
        return None
    root = Path(path).parent.resolve() if path else Path.cwd()  # as parse_settings has it
    folder = Path(str(outputs.get("squashfs_dir", DEFAULT_SQUASHFS_DIR)))
    login = registry.get("credentials") or {}
    if not isinstance(login, dict):
        return None
    credentials = str(login.get("source", "none"))
    owner = enroot.get("cache_owner")
    if owner is not None and not isinstance(owner, str):
        return None
    mirrors = registry.get("mirrors") or {}
    if not isinstance(mirrors, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mirrors.items()):
        return None
    return {
        "mirrors": mirrors,
        "cache_owner": owner,
        "address": f"{registry.get('host', DEFAULT_HOST)}:{registry.get('port', DEFAULT_PORT)}",
        "host": str(registry.get("host", DEFAULT_HOST)),
        "credentials": credentials,
        "scheme": registry.get("scheme", DEFAULT_SCHEME),
        "plain": credentials == "none" and not registry.get("ca_file"),
        "blob_cache": registry.get("blob_cache"),  # a tier blobs come through (or None)
        "squashfs_dir": (folder if folder.is_absolute() else root / folder).resolve(),
        # as written (an admin account walks it and never resolves it: enroot.cache.rootpath)
        "squashfs_dir_as_written": Path(os.path.abspath(root / folder)),
        "compression": enroot.get("compression")
        or ("lz4" if enroot.get("squashfuse") is True else "zstd"),
    }


def through_mirrors(uri: str) -> str:
    """``uri`` as the site registry holds it where the site mirrors its registry
    (``registry.mirrors``: a job's ``nvcr.io#nvidia/pytorch:TAG`` runs from the site
    registry's copy, ``imgpipe mirror``), else ``uri`` as it is."""
    from imgpipe.registry.errors import ReferenceFormatError
    from imgpipe.registry.reference import Reference, through_mirror

    quick = _quick()
    if quick is None:  # the full loader decides (and says what is wrong with the file)
        from pathlib import Path

        from imgpipe.base.config import Settings
        from imgpipe.base.configlayers import parse_settings
        from imgpipe.base.errors import ImgpipeError

        path = config_file()
        try:
            settings = parse_settings(Path(path)) if path else Settings()
        except (ImgpipeError, OSError):
            return uri
        mirrors, address = settings.registry.mirrors, settings.registry.address
    else:
        mirrors, address = quick["mirrors"], str(quick["address"])
    if not mirrors or ("://" in uri and not uri.startswith("docker://")):
        return uri
    try:
        ref = Reference.parse(uri, default_registry=DOCKER_HUB)
    except ReferenceFormatError:
        return uri
    site = through_mirror(ref, mirrors, address)
    if site is None:
        return uri
    say(f"{uri}: the site registry's mirror, {site.canonical}")
    return site.enroot


def is_foreign(uri: str) -> bool:
    """Whether ``uri`` is for Enroot rather than imgpipe: another registry's image, an image
    of a local engine (``dockerd://``, ``podman://``), or any image when the config cannot be
    read (imgpipe cannot tell its own registry then: Pyxis's own way serves, said once)."""
    from imgpipe.registry.errors import ReferenceFormatError
    from imgpipe.registry.reference import Reference

    if "://" in uri and not uri.startswith("docker://"):
        return True
    quick = _quick()
    if quick is None:
        from pathlib import Path

        from imgpipe.base.config import Settings
        from imgpipe.base.configlayers import parse_settings
        from imgpipe.base.errors import ImgpipeError

        path = config_file()
        try:
            settings = parse_settings(Path(path)) if path else Settings()
        except (ImgpipeError, OSError) as exc:
            say(f"cannot use {path} ({exc}): {uri} imported by enroot, as Pyxis would "
                "without imgpipe")
            return True
        address = settings.registry.address
    else:
        address = str(quick["address"])
    try:  # a reference that names no registry is Docker Hub's, as Enroot reads it
        return Reference.parse(uri, default_registry=DOCKER_HUB).registry != address
    except ReferenceFormatError:
        return False  # not a reference at all: the full path says so in its one line


def fast_get(uri: str, event: str | None = None) -> Path | None:
    """The squashfs of an already converted image, or None to take the full path; with
    ``event``, a hit is a line of the site's audit log (``imgpipe.commands.node.audit``)."""
    hit = _fast_find(uri)
    if hit is None:
        return None
    if event is not None:
        from imgpipe.commands.node.audit import record

        record(event, str(hit[0]), hit[1], hit[2], "found")
    return hit[2]


def _fast_find(uri: str) -> tuple[Reference, str, Path] | None:
    """``fast_get``'s hit: the reference, the manifest digest it is keyed by, and the file."""
    from imgpipe.commands.node.headdigest import head_digest, platform_entry
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.cache.trust import CacheTrust
    from imgpipe.enroot.published.pins import Pins
    from imgpipe.registry.errors import ReferenceFormatError
    from imgpipe.registry.reference import Reference

    quick = _quick()
    if quick is None:
        return None
    try:
        ref = Reference.parse(uri, default_registry=quick["address"])
    except ReferenceFormatError:
        return None
    if ref.registry != quick["address"]:
        return None  # the full path refuses it with its one line
    online = quick["plain"] and quick["scheme"] in ("http", "https")
    digest = ref.digest
    if digest is None:
        if not online:
            return None
        digest = head_digest(quick["scheme"], quick["address"], ref.repository, ref.reference)
        if digest is None:
            return None
    try:
        storage = Storage(quick["squashfs_dir"], CacheTrust.of(quick["cache_owner"]))
        if storage.shared and not quick["squashfs_dir"].stat().st_mode & 0o1000:
            return None  # the full path refuses it with its one line

        pins = Pins.from_env()

        def find(manifest: str) -> Path | None:
            return storage.find_squashfs(ref.repository, manifest, quick["compression"],
                                         pins.for_image(manifest), say)

        found = find(digest)
        # a pinned index: this node's platform's manifest keys the cache.  A digest the job
        # pins a squashfs for is a manifest's (pins are per platform's manifest): nothing to
        # ask, which spares the registry a request from every node of a broadcast at once
        if found is None and ref.digest is not None and online and not pins.for_image(digest):
            child = platform_entry(quick["scheme"], quick["address"], ref.repository, digest)
            found, digest = (find(child), child) if child and child != digest else (None, "")
        return (ref, digest, found) if found is not None else None
    except Exception:  # anything unexpected: the full path, with its errors, decides
        return None


def say(text: str) -> None:
    from imgpipe.base.terminal import safe_line

    print(safe_line(f"imgpipe: {text}"), file=sys.stderr, flush=True)


def get(uri: str, verified: Verified | None = None, event: str = "get") -> Path:
    """``uri``'s squashfs: found, fetched or converted, and said as ``event`` to the site's
    audit log.  ``verified`` hears each chunk of a published squashfs's ranged fetch once
    checked (the job's broadcast sends it on)."""
    from pathlib import Path

    from imgpipe.base.config import Settings
    from imgpipe.base.configlayers import parse_settings
    from imgpipe.commands.shared.wiring import registry_client, storage
    from imgpipe.enroot.convert import convert, require_served
    from imgpipe.enroot.published.policy import PublishedPolicy
    from imgpipe.enroot.squash.tools import SquashOptions, compression_of
    from imgpipe.registry.reference import Reference

    path = config_file()  # one file, never a user's or a project's layer
    settings = parse_settings(Path(path)) if path else Settings(root=Path.cwd())
    ref = Reference.parse(uri, default_registry=settings.registry.address)
    enroot = settings.enroot
    cache = storage(settings)
    # A login registry's images are private: never written to the shared entries the
    # writer makes for every user (docs/threat-model.md, "the squashfs cache").
    if enroot.cache_writer and cache.shared and not cache.trust.is_admin \
            and settings.registry.credentials.source == "none":
        from imgpipe.commands.node.cachewriter import ask_writer

        require_served(ref, settings.registry.address)
        ask_writer(settings, ref, say)  # the shared entry, for every user; else our own
    conversion = convert(
        registry_client(settings), storage(settings), ref,
        SquashOptions(compression_of(enroot.default_compression), enroot.zstd_level,
                      enroot.processors, enroot.verify_diff_ids),
        say=say,
        connections=enroot.max_connections,
        published=PublishedPolicy(enroot.published, unpinned=enroot.published_unpinned,
                                  range_connections=enroot.range_connections,
                                  verified=verified))
    if conversion.converted and enroot.cache_max_size:
        from imgpipe.commands.node.cache import prune_after_conversion

        prune_after_conversion(storage(settings), enroot.cache_max_size, conversion.path,
                               say)
    from imgpipe.commands.node.audit import record, result_of

    record(event, str(ref), conversion.digest, conversion.path, result_of(conversion))
    return conversion.path


def record_step(squashfs: Path) -> None:
    """Record this step's use of ``squashfs`` (so prune keeps it) and remember it for
    release, in a file only this user reads, never written through a link."""
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.cache.trust import CacheTrust
    from imgpipe.enroot.cache.uses import record_use

    quick = _quick() or {}
    cache = Storage(squashfs.parent, CacheTrust.of(quick.get("cache_owner")))
    cache = Storage(cache.entry_root(squashfs), cache.trust)  # a private entry's cache
    marker = record_use(cache, squashfs, os.environ.get("SLURM_JOB_ID", "nojob"),
                        os.environ.get("SLURM_STEP_ID", "nostep"))
    write_record([str(cache.uses.resolve()), marker.name])


def write_record(lines: list[str]) -> None:
    """This step's record (what release undoes), in a file only this user reads, never
    written through a link."""
    record = _step_record()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record)
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("".join(f"{line}\n" for line in lines))


def release() -> None:
    """End this step's use of the entry it got; the shared file itself always stays.  The
    record must be this user's own regular file, and the marker it names this user's,
    directly in the configured cache's uses folder (compared after resolving the path)."""
    import stat

    record = _step_record()
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return  # released already (Pyxis calls release twice), or nothing was got
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise OSError(f"{record} is not your own step record: refused")
        lines = handle.read(8192).splitlines()
    quick = _quick() or {}
    configured = quick.get("squashfs_dir")
    if len(lines) == 2 and lines[0] == IMPORTED:  # an image of another registry: its file
        path = lines[1]
        with contextlib.suppress(FileNotFoundError):
            if os.path.dirname(path) in (pyxis_folder(), cache_folder()) and os.path.basename(
                    path).startswith("import.") and os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
    elif len(lines) == 2 and configured is not None:
        uses, name = lines
        mine = f"~{os.getuid()}~"
        expected = os.path.join(os.path.realpath(configured), ".imgpipe", "uses")
        if "/" not in name and mine in name and os.path.realpath(uses) == expected == uses:
            marker = os.path.join(uses, name)
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(marker).st_uid == os.getuid():
                    os.unlink(marker)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record)
