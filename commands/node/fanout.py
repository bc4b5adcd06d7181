"""One registry read per job where squashfs caches are node-local (``enroot.distribution``:
``sbcast``): the importer's ``stage`` and ``take``, which the recipes run around Slurm's own
``sbcast`` (``imgpipe.recipes.staging`` renders that part).

``stage URI`` runs on the job's batch host: it gets the image as the importer always does
(the published squashfs a pin names, or a conversion; a cache hit reads nothing), and
prints what ``sbcast`` copies and where each node receives it: a fresh, unguessable name in
the node-local cache's temporary folder (1777 on every node, so the name must be
unpredictable; sbcast creates it exclusively).

``take URI [SHA256 STAGED MANIFEST]`` runs once on every node of the job: the copy is taken
only if it is this user's own regular file, not a link, and hashes to SHA256 (the pin, or
the batch host's file); it then becomes this user's entry on the node, under the name the
importer looks up, so Pyxis's own ``get`` finds it.  A node without a good copy (sbcast
failed or was missing, a node the job got on requeue, a corrupt copy) fetches for itself
and says so in one line.  Without the staged arguments (``fetch``), every node fetches.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.configlayers import parse_settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.units import human_bytes
from imgpipe.commands.node.audit import record
from imgpipe.commands.node.importer import config_file, fast_get, get, say
from imgpipe.commands.shared.wiring import storage
from imgpipe.enroot.cache.storage import Storage, fetched_stem
from imgpipe.enroot.cache.trust import check_entry
from imgpipe.enroot.published.pins import Pins
from imgpipe.registry.reference import Reference

READ_BLOCK = 8 << 20
_SHA256 = "sha256:"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Staged:
    """What the batch host hands ``sbcast`` and every node's ``take``."""

    source: Path     # the batch host's entry
    sha256: str      # what every copy must hash to
    dest: Path       # where each node receives the copy
    manifest: str    # the image manifest the entry is of

    def line(self) -> str:
        return f"{self.source} {self.sha256} {self.dest} {self.manifest}"


def node_settings() -> Settings:
    """The node's settings: the one config file the importer reads."""
    path = config_file()  # one file, never a user's or a project's layer
    return parse_settings(Path(path)) if path else Settings(root=Path.cwd())


def pinned_reference(uri: str, settings: Settings) -> Reference:
    """``uri`` parsed; ImgpipeError unless it names a digest."""
    ref = Reference.parse(uri, default_registry=settings.registry.address)
    if ref.digest is None:
        raise ImgpipeError(f"{uri} is not pinned to a digest: staging copies one image's "
                           "bytes to every node", hint="render the recipes from imgpipe.lock")
    return ref


def file_sha256(fd: int) -> str:
    """The sha256 of what ``fd`` holds, read from its start."""
    hasher = hashlib.sha256()
    offset = 0
    while block := os.pread(fd, READ_BLOCK, offset):
        hasher.update(block)
        offset += len(block)
    return _SHA256 + hasher.hexdigest()


def stage(uri: str) -> Staged:
    """Get ``uri`` on this (the batch) host and name the copy every node receives."""
    settings = node_settings()
    ref = pinned_reference(uri, settings)
    path = fast_get(uri, "get") or get(uri)
    cache = storage(settings)
    pinned = [pin for pin in Pins.from_env().for_image(ref.digest or "")
              if path.name.startswith(fetched_stem(ref.repository, pin) + ".")]
    if pinned:  # a fetched pin: checked when fetched, named by its digest
        sha256 = pinned[0]
    else:  # a conversion: hash it, the nodes check against that
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            sha256 = file_sha256(fd)
        finally:
            os.close(fd)
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    dest = cache.tmp / f"sbcast.u{os.getuid()}.{job}.{secrets.token_hex(8)}.sqsh"
    return Staged(path, sha256, dest, ref.digest or "")


def take(uri: str, staged: Staged | None) -> Path:
    """This node's entry of ``uri``: already here, the staged copy once it checks, or
    fetched by this node (said in one line)."""
    settings = node_settings()
    ref = pinned_reference(uri, settings)
    if staged is not None and not all(_DIGEST.fullmatch(d) for d in (staged.sha256,
                                                                     staged.manifest)):
        raise ImgpipeError(f"take: {staged.sha256!r} and {staged.manifest!r} must be sha256 "
                           "digests", hint="pass what `stage` printed")
    here = socket.gethostname()
    found = fast_get(uri, "take")
    if found is not None:
        if staged is not None:
            _discard(staged.dest)
        return found
    if staged is None:
        say(f"{here}: fetching {ref.repository}@{(ref.digest or '')[:19]} (enroot."
             "distribution: fetch)")
        return get(uri, event="take")
    cache = storage(settings)
    cache.prepare()
    cache.sweep()  # copies of earlier jobs no node took
    why = _take_copy(cache, ref, staged, here, settings.enroot.default_compression)
    if isinstance(why, Path):
        record("take", str(ref), staged.manifest, why, "taken")
        return why
    say(f"{here}: {why}; fetching it from the registry")
    return get(uri, event="take")


def _target(cache: Storage, ref: Reference, staged: Staged, compression: str) -> Path:
    """The name the importer looks the copy up by: the pinned file's, else the
    conversion's (then this user's own, in a shared cache)."""
    pins = Pins.from_env().for_image(staged.manifest)
    if staged.sha256 in pins:
        return cache.fetched(ref.repository, staged.sha256)
    return cache.squashfs(ref.repository, staged.manifest, compression)


def _take_copy(cache: Storage, ref: Reference, staged: Staged, here: str, compression: str
               ) -> Path | str:
    """The entry made from the staged copy, or why the copy was not taken."""
    if staged.manifest != ref.digest:
        _discard(staged.dest)
        return (f"the copy is of {staged.manifest[:19]}, this node runs {(ref.digest or '')[:19]}"
                " (another platform)")
    if staged.dest.parent != cache.tmp or not staged.dest.name.startswith(
            f"sbcast.u{os.getuid()}."):
        return f"{staged.dest} is not a staging name of yours in {cache.tmp}: not taken"
    try:
        fd = os.open(staged.dest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "no sbcast copy arrived (sbcast failed, or the job got this node later)"
    except OSError as exc:
        return f"the sbcast copy cannot be opened ({exc.strerror})"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_nlink != 1:
            return (f"{staged.dest.name} is not a copy of yours alone (owner uid "
                    f"{info.st_uid}, {info.st_nlink} link(s)): refused")
        started = time.monotonic()
        got = file_sha256(fd)
        if got != staged.sha256:
            _discard(staged.dest)
            return (f"refused the sbcast copy: it hashes to {got[:19]}…, not "
                    f"{staged.sha256[:19]}…")
        # a private image's entry (its registry asked for a login) is 0600, and so is the
        # copy sbcast made of it: it stays this user's alone (enroot.cache.storage)
        cache.private = not info.st_mode & 0o077
        os.fchmod(fd, cache.entry_mode)
        target = _link_entry(cache, ref, staged, compression, here)
        if not isinstance(target, Path):
            return target
        if os.lstat(target).st_ino != info.st_ino:
            return f"{target.name} changed while it was taken: refused"
        _discard(staged.dest)
        say(f"{here}: took the sbcast copy {got[:19]}… ({human_bytes(info.st_size)}, "
             f"checked in {time.monotonic() - started:.1f} s)")
        return target
    finally:
        os.close(fd)


def _link_entry(cache: Storage, ref: Reference, staged: Staged, compression: str,
                here: str) -> Path | str:
    """Link the checked copy in as this user's entry (never over a file: ``link`` fails on
    one); where another user planted something at that name, into this user's private
    folder instead, which the importer's lookup finds too."""
    target = _target(cache, ref, staged, compression)
    try:
        os.link(staged.dest, target)
        return target
    except FileExistsError:
        pass
    found = fast_get(ref.enroot)
    if found is not None or check_entry(target, cache.trust) is None:
        _discard(staged.dest)
        return found if found is not None else target  # one appeared meanwhile: ours
    if cache.private:
        _discard(staged.dest)
        return f"{target.name} appeared meanwhile"
    say(f"{here}: {target.name} is not yours ({check_entry(target, cache.trust)}): the copy "
        "is kept in your own folder instead")
    cache.private = True
    return _link_entry(cache, ref, staged, compression, here)


def _discard(path: Path) -> None:
    """Remove a staged copy of this user's (never another user's file)."""
    try:
        if os.lstat(path).st_uid == os.getuid():
            os.unlink(path)
    except FileNotFoundError:
        pass
