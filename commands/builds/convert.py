"""Converting an image of the catalog (pinned by imgpipe.lock) or any reference, and
recording the squashfs file and its checksum in the lock."""

from __future__ import annotations

from imgpipe.base.config import Settings
from imgpipe.base.files import file_sha256
from imgpipe.base.platforms import Platform, node_platform
from imgpipe.base.progress import Progress
from imgpipe.base.units import parse_size
from imgpipe.commands.registry.pushed import require_pushed
from imgpipe.commands.shared.wiring import registry_client, squash_options, storage
from imgpipe.enroot.cache.uses import prune
from imgpipe.enroot.convert import Conversion, convert
from imgpipe.enroot.published.policy import PublishedPolicy
from imgpipe.pipeline.catalog import load_catalog
from imgpipe.pipeline.lock import LockEntry, PlatformPin, lock_path, updating_lock
from imgpipe.registry.reference import Reference

__all__ = ["Conversion", "convert_and_record", "convert_each_platform"]


def convert_and_record(settings: Settings, target: str, flavor: str, compression: str | None,
                       with_enroot: bool, progress: Progress, no_published: bool = False,
                       platform: Platform | None = None) -> Conversion:
    """Convert an image of the catalog (its pushed digest: imgpipe.lock, else the registry)
    or any reference; a published squashfs that imgpipe.lock (or IMGPIPE_SQUASHFS_PINS)
    pins is fetched instead, unless ``no_published`` or enroot.published is false."""
    is_name = "/" not in target and ":" not in target and "@" not in target
    catalog = (load_catalog(settings)
               if is_name and settings.path(settings.images_dir).is_dir() else {})
    image = catalog.get(target)
    lock_file = lock_path(settings.root)
    pins: frozenset[str] = frozenset()
    if image is not None:
        entry = require_pushed(settings, image.name, flavor, "to convert", progress)
        holder: LockEntry | PlatformPin = entry
        if entry.platforms:
            holder = entry.platform_pin(platform or node_platform())
        ref = entry.reference.with_digest(holder.digest)
        options = squash_options(settings, image.spec.squashfs_compression, compression)
        pin = holder.squashfs_digests.get(options.compression)
        pins = frozenset([pin] if pin else [])
    else:
        ref = Reference.parse(target, default_registry=settings.registry.address)
        options = squash_options(settings, None, compression)
    published = PublishedPolicy(settings.enroot.published and not no_published, pins,
                                settings.enroot.published_unpinned,
                                settings.enroot.range_connections)
    conversion = convert(registry_client(settings), storage(settings), ref, options,
                         say=progress.step, with_enroot=with_enroot,
                         connections=settings.enroot.max_connections, count=progress.transfer,
                         published=published, platform=platform)
    progress.done()
    if conversion.converted and settings.enroot.cache_max_size:
        pruned = prune(storage(settings), max_size=parse_size(settings.enroot.cache_max_size))
        if pruned.removed:
            progress.step(f"pruned {len(pruned.removed)} cache entries "
                          f"({pruned.freed} bytes) to stay under enroot.cache_max_size")
    if image is not None:
        checksum = "sha256:" + file_sha256(conversion.path)
        with updating_lock(lock_file) as lock:
            current = lock.entry(image.name, flavor)
            found = current.holder(conversion.digest) if current is not None else None
            if found is not None:
                found.squashfs = str(conversion.path)
                found.squashfs_sha256 = checksum
    return conversion


def convert_each_platform(settings: Settings, name: str, flavor: str, progress: Progress
                          ) -> list[Conversion]:
    """The squashfs of every platform an image of the catalog was built for (one for a
    one-manifest build): a head node converts for all its partitions, running nothing of
    the targets."""
    entry = require_pushed(settings, name, flavor, "to convert", progress)
    platforms: list[Platform | None] = [Platform.parse(p) for p in entry.platforms]
    return [convert_and_record(settings, name, flavor, None, False, progress,
                               platform=platform) for platform in platforms or [None]]
