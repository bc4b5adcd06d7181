"""Converting an image of the catalog (pinned by imgpipe.lock) or any reference, and
recording the squashfs file and its checksum in the lock."""

from __future__ import annotations

from imgpipe.base.config import Settings
from imgpipe.base.files import file_sha256
from imgpipe.base.progress import Progress
from imgpipe.base.units import parse_size
from imgpipe.commands.pushed import require_pushed
from imgpipe.commands.wiring import registry_client, squash_options, storage
from imgpipe.enroot.convert import Conversion, convert
from imgpipe.enroot.prebuilt import Prebuilt
from imgpipe.enroot.usage import prune
from imgpipe.pipeline.catalog import load_catalog
from imgpipe.pipeline.lock import lock_path, updating_lock
from imgpipe.registry.reference import Reference


def convert_and_record(settings: Settings, target: str, flavor: str, compression: str | None,
                       with_enroot: bool, progress: Progress, no_prebuilt: bool = False
                       ) -> Conversion:
    """Convert an image of the catalog (its pushed digest: imgpipe.lock, else the registry)
    or any reference; a published squashfs that imgpipe.lock (or IMGPIPE_SQUASHFS_PINS)
    pins is fetched instead, unless ``no_prebuilt`` or enroot.prebuilt is false."""
    is_name = "/" not in target and ":" not in target and "@" not in target
    catalog = (load_catalog(settings)
               if is_name and settings.path(settings.images_dir).is_dir() else {})
    image = catalog.get(target)
    lock_file = lock_path(settings.root)
    pins: frozenset[str] = frozenset()
    if image is not None:
        entry = require_pushed(settings, image.name, flavor, "to convert", progress)
        ref = entry.reference
        options = squash_options(settings, image.spec.squashfs_compression, compression)
        pin = entry.squashfs_digests.get(options.compression)
        pins = frozenset([pin] if pin else [])
    else:
        ref = Reference.parse(target, default_registry=settings.registry.address)
        options = squash_options(settings, None, compression)
    prebuilt = Prebuilt(settings.enroot.prebuilt and not no_prebuilt, pins,
                        settings.enroot.prebuilt_unpinned)
    conversion = convert(registry_client(settings), storage(settings), ref, options,
                         say=progress.step, with_enroot=with_enroot,
                         connections=settings.enroot.max_connections, count=progress.transfer,
                         prebuilt=prebuilt)
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
            if current is not None and current.digest == conversion.digest:
                current.squashfs = str(conversion.path)
                current.squashfs_sha256 = checksum
    return conversion
