"""Registry image -> squashfs file on shared storage, once per digest.

A digest that has a squashfs returns at once.  Otherwise the conversion runs
under the digest's lock (so processes on one host or many serialize and all
end with the same file): fetch blobs into the shared cache, merge the layers
(validated), stream the flattened root into the squash tool, write to a name
unique to this host and process, and rename it into place.  A crash leaves
only temporaries, which the next holder of the lock deletes.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.fetch import fetch_image
from imgpipe.enroot.flatten import LayerCounts, LayerSource, merge, write_stream, write_tree
from imgpipe.enroot.rcfiles import rc_files
from imgpipe.enroot.squash import SquashOptions, squash_stream, squash_tree
from imgpipe.enroot.storage import Storage
from imgpipe.pipeline.files import atomic_path
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


def resolve_digest(client: RegistryClient, ref: Reference) -> str:
    """The manifest digest ``ref`` names (index entries resolved to this platform)."""
    try:
        return client.manifest(ref.repository, ref.reference).digest
    except RegistryError as exc:
        if exc.status == 404:
            raise ConvertError(f"{ref} is not in the registry",
                               hint=f"push it first, or list tags: imgpipe registry tags "
                               f"{ref.repository}") from exc
        raise


def convert(client: RegistryClient, storage: Storage, ref: Reference,
            options: SquashOptions | None = None,
            say: Callable[[str], None] = lambda _: None,
            with_enroot: bool = False) -> Conversion:
    """Make sure the squashfs of ``ref`` exists and return where it is.

    Raises ConvertError (or RegistryError, HostileLayerError) on failure; the
    shared directory then holds no new file.
    """
    options = options or SquashOptions()
    started = time.monotonic()
    storage.prepare()
    if ref.digest:  # pinned: no network needed when it was converted before
        existing = storage.find_squashfs(ref.digest)
        if existing is not None:
            return Conversion(str(ref), ref.digest, existing, False,
                              time.monotonic() - started, existing.stat().st_size,
                              options.compression)
    digest = resolve_digest(client, ref)
    final = storage.squashfs(ref.repository, digest)
    if final.exists():
        return Conversion(str(ref), digest, final, False, time.monotonic() - started,
                          final.stat().st_size, options.compression)
    with storage.lock(digest, on_wait=say):
        if final.exists():  # another process converted it while we waited
            return Conversion(str(ref), digest, final, False, time.monotonic() - started,
                              final.stat().st_size, options.compression)
        removed = storage.clean_stale(digest)
        if removed:
            say(f"removed {removed} leftover(s) of an interrupted conversion")
        if with_enroot:
            return _convert_with_enroot(client, ref, digest, final, options, say, started)
        return _convert_locked(client, storage, ref, digest, final, options, say, started)


def _convert_with_enroot(client, ref, digest, final, options, say, started) -> Conversion:
    from imgpipe.enroot.delegate import enroot_import

    say(f"enroot import {ref.repository}@{digest[:19]}")
    with atomic_path(final, mode=0o644) as tmp:
        enroot_import(ref, digest, tmp, options, client.base_url.split("://")[0])
    return Conversion(str(ref), digest, final, True, time.monotonic() - started,
                      final.stat().st_size, options.compression)


def _convert_locked(client, storage, ref, digest, final, options, say,
                    started) -> Conversion:
    fetched_total = [0]

    def count(n: int) -> None:
        fetched_total[0] += n

    say(f"fetch {ref.repository}@{digest[:19]}")
    image = fetch_image(client, storage, ref.repository, digest, on_bytes=count)
    layers = [LayerSource(layer.digest, layer.path) for layer in image.layers]
    say(f"merge {len(layers)} layer(s)")
    view = merge(layers, rc_files(image.config))
    tree_bytes = view.file_bytes if options.tool == "mksquashfs" else 0
    work = storage.work_dir(digest, tree_bytes)
    try:
        return _squash_and_publish(ref, digest, final, options, say, started, image, layers,
                                   view, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _squash_and_publish(ref, digest, final, options, say, started, image, layers, view,
                        work) -> Conversion:
    written = [0]
    say(f"squash with {options.compression} ({options.tool})")
    with atomic_path(final, mode=0o644) as tmp:
        if options.tool == "tar2sqfs":
            squash_stream(lambda out: written.__setitem__(0, write_stream(view, layers, out)),
                          tmp, options)
        else:
            squash_tree(lambda tree: written.__setitem__(0, write_tree(view, layers, tree)),
                        tmp, options, work)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())  # the file is complete on disk before it is visible
    return Conversion(str(ref), digest, final, True, time.monotonic() - started,
                      final.stat().st_size, options.compression, image.fetched_bytes,
                      written[0], view.counts)
