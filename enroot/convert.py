"""Registry image -> squashfs file on shared storage, once per digest.

A digest that has a squashfs returns at once.  Otherwise the conversion runs
under the digest's lock (so processes on one host or many serialize and all
end with the same file): fetch blobs into the shared cache, top layer first,
while the one pass streams each layer that has landed (validated) into the
squash tool, write to a name unique to this host and process, and rename it
into place.  A crash leaves only temporaries, which the next holder of the
lock deletes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, cast

from imgpipe.base.files import SquashfsPath, atomic_path
from imgpipe.base.platforms import Platform, node_platform
from imgpipe.base.removal import remove_tree
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.errors import (
    BlobDigestError,
    ConvertError,
    HostileLayerError,
    NoSpaceError,
)
from imgpipe.enroot.fetch.blobs import MAX_CONNECTIONS, ImageFetch, fetch_image
from imgpipe.enroot.fetch.repair import fetch_again, spoiled_blobs
from imgpipe.enroot.fetch.sources import Arrivals, layer_sources
from imgpipe.enroot.flatten.layerreader import LayerSource
from imgpipe.enroot.flatten.rcfiles import rc_files
from imgpipe.enroot.flatten.streamer import TwoPassesNeeded, write_stream_once
from imgpipe.enroot.flatten.view import LayerCounts, MergedView, merge
from imgpipe.enroot.flatten.viewwriter import write_stream, write_tree
from imgpipe.enroot.published.policy import PublishedPolicy, fetch_trusted
from imgpipe.enroot.squash.tools import SquashOptions, squash_stream, squash_tree
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
from imgpipe.registry.reference import Reference


@dataclass(frozen=True)
class Conversion:
    reference: str
    digest: str
    path: Path
    converted: bool  # False: it was already there
    seconds: float
    size: int
    compression: str
    fetched_bytes: int = 0
    entries: int = 0
    layers: list[LayerCounts] = field(default_factory=list)
    published: str | None = None  # the published squashfs fetched instead of converting

    @property
    def pinned(self) -> Reference:
        """The image converted, by its manifest digest."""
        return Reference.parse(self.reference).with_digest(self.digest)

    @property
    def squashfs(self) -> SquashfsPath:
        """The published file, as recipes pin it."""
        return SquashfsPath(self.path)


# (what, total bytes or None) -> advance(bytes): a progress display's byte counter
Counter = Callable[[str, int | None], Callable[[int], None]]


@dataclass(frozen=True)
class _Target:
    """One conversion under way: the reference, its digest, where the file goes, how it is
    squashed, who hears about progress, and since when."""

    ref: Reference
    digest: str
    final: Path
    options: SquashOptions
    say: Callable[[str], None]
    started: float
    count: Counter = field(default=lambda what, total: lambda n: None)

    def result(self, converted: bool, fetched_bytes: int = 0, entries: int = 0,
               layers: list[LayerCounts] | None = None, published: str | None = None
               ) -> Conversion:
        return Conversion(str(self.ref), self.digest, self.final, converted,
                          time.monotonic() - self.started, self.final.stat().st_size,
                          self.options.compression, fetched_bytes, entries, layers or [],
                          published)


def require_served(ref: Reference, address: str) -> None:
    """imgpipe talks to the one registry it is configured for (with that registry's
    credentials and TLS settings): a reference naming another is refused, never answered
    with content from the configured one under the other's name."""
    if ref.registry != address:
        raise ConvertError(f"{ref} names the registry {ref.registry}, but imgpipe is "
                           f"configured for {address}",
                           hint="convert images of the configured registry, or point "
                           "registry.host and registry.port in imgpipe.yaml at that one")


def resolve_digest(client: RegistryClient, ref: Reference, platform: Platform | None = None
                   ) -> str:
    """The manifest digest ``ref`` names: an index resolved to ``platform`` (default: the
    node's, ``IMGPIPE_PLATFORM`` or the kernel's).  Nothing of the target platform runs:
    any host converts for any platform."""
    try:
        return client.manifest(ref.repository, ref.reference,
                               platform or node_platform()).digest
    except RegistryError as exc:
        if exc.status == 404 and exc.registry_code != "NOT_A_REGISTRY":
            raise ConvertError(f"{ref} is not in the registry",
                               hint=f"push it first, or list tags: imgpipe registry tags "
                               f"{ref.repository}") from exc
        raise


def convert(client: RegistryClient, storage: Storage, ref: Reference,
            options: SquashOptions | None = None,
            say: Callable[[str], None] = lambda _: None,
            with_enroot: bool = False, connections: int = MAX_CONNECTIONS,
            count: Counter | None = None, published: PublishedPolicy | None = None,
            platform: Platform | None = None) -> Conversion:
    """Make sure the squashfs of ``ref`` exists and return where it is; layers are fetched
    over ``connections`` parallel requests (enroot.max_connections).  ``count`` makes a
    byte counter for the fetch and the squash (a progress display's).  ``published``: a
    published squashfs the policy trusts is fetched instead (enroot.published).

    Raises ConvertError (or RegistryError, HostileLayerError) on failure; the
    shared directory then holds no new file.
    """
    options = options or SquashOptions()
    started = time.monotonic()
    require_served(ref, client.address)
    storage.prepare()
    swept = storage.sweep()
    if swept:
        say(f"removed {swept} leftover(s) of interrupted runs")
    policy = published.pinned_for(ref.digest) if published and ref.digest else published
    if ref.digest:  # pinned: no network needed when it was converted (or fetched) before
        existing = storage.find_squashfs(ref.repository, ref.digest, options.compression,
                                         _pins(policy), say)
        if existing is not None:
            return Conversion(str(ref), ref.digest, existing, False,
                              time.monotonic() - started, existing.stat().st_size,
                              options.compression)
    digest = resolve_digest(client, ref, platform)
    if client.used_credentials and not storage.private:
        # the registry asked for a login: what is kept of this image is this user's alone
        storage.private = True
        say(f"{ref.repository} needs a login: its squashfs and blobs are kept for you alone")
    policy = published.pinned_for(digest) if published else None
    target = _Target(ref, digest, storage.squashfs(ref.repository, digest, options.compression),
                     options, say, started, *([count] if count else []))
    done = _converted(client, storage, target, policy, connections, with_enroot)
    if storage.private and done.path.parent == storage.private_dir():
        os.chmod(done.path, storage.entry_mode)  # a copy sbcast makes keeps 0600
    return done


def _converted(client: RegistryClient, storage: Storage, target: _Target,
               policy: PublishedPolicy | None, connections: int, with_enroot: bool
               ) -> Conversion:
    """``convert``'s work once the digest is known: found, fetched or converted."""
    ref, digest, options, say = target.ref, target.digest, target.options, target.say

    def found(conversions: bool | None = None) -> Conversion | None:
        path = storage.find_squashfs(ref.repository, digest, options.compression,
                                     _pins(policy), say, conversions)
        return None if path is None else replace(target, final=path).result(converted=False)

    if (done := found()) is not None:
        return done
    with storage.lock(digest, on_wait=say):
        if (done := found()) is not None:  # another process made it while we waited
            return done
        removed = storage.clean_stale(digest)
        if removed:
            say(f"removed {removed} leftover(s) of an interrupted conversion")
        if with_enroot:
            return _convert_with_enroot(client, target)
        if policy is not None and policy.use:
            fetched = _fetch_published(client, storage, target, policy, connections)
            if fetched is not None:
                return fetched
        if (done := found(conversions=True)) is not None:  # pinned, and none to fetch
            return done
        return _convert_locked(client, storage, target, connections)


def _pins(policy: PublishedPolicy | None) -> frozenset[str]:
    """The squashfs digests a pinned lookup takes (none when published files are off)."""
    return policy.pins if policy is not None and policy.use else frozenset()


def convert_privately(client: RegistryClient, storage: Storage, ref: Reference,
                      options: SquashOptions, dest: Path,
                      say: Callable[[str], None] = lambda _: None,
                      connections: int = MAX_CONNECTIONS, count: Counter | None = None,
                      platform: Platform | None = None) -> Conversion:
    """Convert ``ref`` into ``dest``, a file of the caller's outside the cache's names (what
    `imgpipe verify` compares a published squashfs with), whatever the cache holds; under the
    digest's lock, whose holder owns the digest's work areas."""
    require_served(ref, client.address)
    storage.prepare()
    digest = resolve_digest(client, ref, platform)
    target = _Target(ref, digest, dest, options, say, time.monotonic(),
                     *([count] if count else []))
    with storage.lock(digest, on_wait=say):
        return _convert_locked(client, storage, target, connections)


def _fetch_published(client: RegistryClient, storage: Storage, target: _Target,
                    policy: PublishedPolicy, connections: int) -> Conversion | None:
    """The published squashfs of the target, when the policy trusts one (enroot.published)."""
    repository = target.ref.repository

    def layers_view() -> MergedView:
        image = fetch_image(client, storage, repository, target.digest,
                            connections=connections, say=target.say)
        return merge(layer_sources(image), rc_files(image.config))

    fetched = fetch_trusted(client, storage, repository, target.digest,
                           target.options.compression, policy, layers_view, target.say,
                           lambda total: target.count(f"fetch squashfs {repository}", total))
    if fetched is None:
        return None
    return replace(target, final=fetched.path).result(
        converted=not fetched.cached, fetched_bytes=fetched.received, entries=fetched.entries,
        published=fetched.published.blob)


def _convert_with_enroot(client: RegistryClient, target: _Target) -> Conversion:
    from imgpipe.enroot.squash.enrootimport import enroot_import

    target.say(f"enroot import {target.ref.repository}@{target.digest[:19]}")
    # enroot refuses to write over an existing file: the temporary name must not exist yet
    with atomic_path(target.final, mode=0o644, create=False) as tmp:
        enroot_import(target.ref, target.digest, tmp, target.options,
                      client.base_url.split("://")[0])
    return target.result(converted=True)


def _convert_locked(client: RegistryClient, storage: Storage, target: _Target,
                    connections: int = MAX_CONNECTIONS) -> Conversion:
    """Fetch and convert: tar2sqfs starts on the top layer as soon as it has landed (the
    one pass reads top-down), mksquashfs once every layer has."""
    repository, digest = target.ref.repository, target.digest
    needed, missing = _space_needed(client, storage, repository, digest)
    free = shutil.disk_usage(storage.root).free
    if free < needed:
        raise NoSpaceError(storage.root, needed, free)
    target.say(f"fetch {repository}@{digest[:19]}")
    try:
        with ImageFetch(client, storage, repository, digest, connections=connections,
                        on_bytes=target.count(f"fetch {repository}", missing or None),
                        top_first=target.options.tool == "tar2sqfs",
                        say=target.say) as fetching:
            return _convert_arriving(client, storage, target, Arrivals(fetching))
    except (OSError, ConvertError) as exc:
        if not isinstance(exc, NoSpaceError) and _out_of_space(exc):
            raise NoSpaceError(storage.root, needed,
                               shutil.disk_usage(storage.root).free) from exc
        raise


def _convert_arriving(client: RegistryClient, storage: Storage, target: _Target,
                      arrivals: Arrivals) -> Conversion:
    """Convert as the layers arrive; a layer that fails because its cached blob went bad
    is fetched once more and the conversion runs again, from blobs all in place."""
    rc = rc_files(arrivals.fetching.config)
    layers: list[LayerSource] = arrivals.planned
    ready: Callable[[int], LayerSource] | None = arrivals.ready
    work: Path | None = None
    try:
        for attempt in (1, 2):
            try:
                if target.options.tool == "tar2sqfs":
                    return _squash_stream(target, arrivals, layers, rc, ready)
                if ready is not None:
                    layers, ready = arrivals.all(), None
                target.say(f"merge {len(layers)} layer(s)")
                view = merge(layers, rc)
                if work is None:
                    work = storage.work_dir(target.digest, view.file_bytes)
                return _squash_tree(target, arrivals, layers, view, work)
            except (BlobDigestError, HostileLayerError) as exc:
                spoiled = spoiled_blobs(layers, exc)
                if attempt == 2 or not spoiled:
                    raise
                if ready is not None:
                    layers, ready = _all_or_raise(arrivals, exc), None
                if work is None:
                    work = storage.work_dir(target.digest)
                layers = fetch_again(client, storage, target.ref.repository, layers, spoiled,
                                      work, target.say)
        raise AssertionError("unreachable")
    finally:
        if work is not None:
            with contextlib.suppress(OSError):  # an image may carry a tree 10,000 deep
                remove_tree(work)


def _all_or_raise(arrivals: Arrivals, failure: Exception) -> list[LayerSource]:
    """Every layer, fetched; a fetch that failed meanwhile leaves ``failure`` the error."""
    try:
        return arrivals.all()
    except Exception:
        raise failure from None


def _space_needed(client: RegistryClient, storage: Storage, repository: str, digest: str
                  ) -> tuple[int, int]:
    """Bytes a conversion will write into the folder: the blobs not cached yet, and the
    squashfs, estimated at the compressed size of all layers (zstd's is smaller; lz4's and
    uncompressed ones larger: this is a floor that catches the hopeless cases early), and
    the bytes to fetch."""
    manifest = client.manifest(repository, digest)
    sizes = [(layer["digest"], int(layer.get("size", 0))) for layer in manifest.layers]
    missing = sum(size for blob, size in sizes if not storage.blob(blob).exists())
    return missing + sum(size for _, size in sizes), missing


def _out_of_space(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    return "No space left on device" in str(exc) or "No space left" in str(exc)


class _Counted(io.RawIOBase):
    """A writable stream that tells ``advance`` how many bytes went through."""

    def __init__(self, out: IO[bytes], advance: Callable[[int], None]) -> None:
        super().__init__()
        self._out = out
        self._advance = advance

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._out.write(data)
        self._advance(len(data))
        return written if written is not None else len(data)

    def flush(self) -> None:
        self._out.flush()


def _squash_stream(target: _Target, arrivals: Arrivals, layers: list[LayerSource],
                   rc: dict[str, tuple[str, int]],
                   ready: Callable[[int], LayerSource] | None) -> Conversion:
    """Stream the flattened root into tar2sqfs, each layer read once (``enroot.flatten.streamer``)
    as it arrives (``ready``; None: all in place); layers that pass cannot place are
    merged first and read twice (``enroot.flatten.viewwriter``)."""
    options, repository = target.options, target.ref.repository
    target.say(f"squash with {options.compression} ({options.tool}), one pass over "
               f"{len(layers)} layer(s)")
    advance = target.count(f"squash {repository}", arrivals.blob_bytes or None)
    done: list[tuple[MergedView, int]] = []
    with atomic_path(target.final, mode=0o644) as tmp:
        try:
            squash_stream(lambda out: done.append(write_stream_once(
                layers, rc, out, advance, options.diff_ids, ready)), tmp, options)
        except TwoPassesNeeded as why:
            target.say(f"one pass cannot place {why}: merge {len(layers)} layer(s), then "
                       "squash with two passes")
            whole = arrivals.all() if ready is not None else layers
            view = merge(whole, rc)
            again = target.count(f"squash {repository}", view.file_bytes or None)
            squash_stream(lambda out: done.append(
                (view, write_stream(view, whole, cast(IO[bytes], _Counted(out, again))))),
                tmp, options)
        _sync(tmp)
    view, written = done[-1]
    return target.result(converted=True, fetched_bytes=arrivals.fetching.fetched_bytes,
                         entries=written, layers=view.counts)


def _squash_tree(target: _Target, arrivals: Arrivals, layers: list[LayerSource],
                 view: MergedView, work: Path) -> Conversion:
    """Unpack the merged view into a private tree and mksquashfs it (lzo-enroot, lz4, none)."""
    written = [0]
    target.say(f"squash with {target.options.compression} ({target.options.tool})")
    with atomic_path(target.final, mode=0o644) as tmp:
        squash_tree(lambda tree: written.__setitem__(0, write_tree(view, layers, tree)),
                    tmp, target.options, work)
        _sync(tmp)
    return target.result(converted=True, fetched_bytes=arrivals.fetching.fetched_bytes,
                         entries=written[0], layers=view.counts)


def _sync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())  # the file is complete on disk before it is visible
