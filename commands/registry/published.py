"""Publishing an image's squashfs beside it in the registry, and verifying what is published.

``publish_squashfs`` (``imgpipe push --squashfs``, ``imgpipe ci --squashfs``) converts the
pushed digest in each of enroot.publish_compressions, pushes the file as an artifact of the
manifest, and records its digest in imgpipe.lock: the pin a fetched squashfs must equal.
``verify`` converts here and compares byte for byte with every published one; a match is
recorded as a pin, a mismatch refused naming both digests.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from imgpipe.base.config import Settings
from imgpipe.base.files import file_sha256
from imgpipe.base.platforms import Platform
from imgpipe.base.progress import Progress
from imgpipe.commands.registry.pushed import catalog_image, require_pushed
from imgpipe.commands.shared.wiring import registry_client, squash_options, storage
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.convert import Conversion, convert, convert_privately, resolve_digest
from imgpipe.enroot.errors import VerifyError
from imgpipe.enroot.published.artifact import PublishedSquashfs, find_published, publish
from imgpipe.enroot.published.inodes import entries
from imgpipe.pipeline.catalog import load_catalog, select
from imgpipe.pipeline.lock import lock_path, read_lock, updating_lock
from imgpipe.registry.reference import Reference


@dataclass(frozen=True)
class Published:
    image: str
    flavor: str
    squashfs: PublishedSquashfs
    pushed: bool  # False: the registry had this very file published already


def _record_pin(settings: Settings, name: str, flavor: str, image_digest: str,
                compression: str, squashfs_digest: str) -> None:
    """Pin ``squashfs_digest`` for the manifest ``image_digest`` (a one-manifest build's,
    or one platform's of an index build)."""
    with updating_lock(lock_path(settings.root)) as lock:
        entry = lock.entry(name, flavor)
        holder = entry.holder(image_digest) if entry is not None else None
        if holder is not None:
            holder.squashfs_digests[compression] = squashfs_digest


def publish_squashfs(settings: Settings, name: str, flavor: str, progress: Progress
                     ) -> list[Published]:
    """Convert the pushed ``name``/``flavor`` and publish its squashfs in every compression
    the site asks for (enroot.publish_compressions), pinning each in imgpipe.lock."""
    entry = require_pushed(settings, name, flavor, "to publish its squashfs", progress)
    client, cache = registry_client(settings), storage(settings)
    # each platform's squashfs is published with that platform's manifest as its subject
    manifests: list[tuple[Platform | None, str]] = [
        (Platform.parse(p), pin.digest) for p, pin in entry.platforms.items()]
    manifests = manifests or [(None, entry.digest)]
    done = []
    for platform, digest in manifests:
        ref = entry.reference.with_digest(digest)
        for compression in settings.enroot.publish_compressions:
            blob, conversion = _convert_for_publish(settings, cache, ref, compression,
                                                    platform, progress)
            manifest = client.manifest_exactly(ref.repository, digest)
            progress.step(f"publish squashfs {blob[:19]} ({compression}) beside "
                          f"{ref.repository}@{digest[:19]}"
                          + (f" ({platform})" if platform else ""))
            published, pushed = publish(
                client, ref.repository, manifest, conversion.path, blob, compression,
                len(entries(conversion.path)),
                progress.transfer(f"push squashfs {ref.repository}", conversion.size))
            progress.done()
            _record_pin(settings, name, flavor, digest, compression, blob)
            done.append(Published(name, flavor, published, pushed))
    return done


def _convert_for_publish(settings: Settings, cache: Storage, ref: Reference, compression: str,
                         platform: Platform | None, progress: Progress
                         ) -> tuple[str, Conversion]:
    conversion = convert(registry_client(settings), cache, ref,
                         squash_options(settings, None, compression), say=progress.step,
                         connections=settings.enroot.max_connections, count=progress.transfer,
                         platform=platform)
    progress.done()
    blob = "sha256:" + file_sha256(conversion.path)
    if conversion.published is not None and conversion.published != blob:
        raise VerifyError(f"the cached squashfs of {ref} is not the one fetched")
    return blob, conversion


@dataclass(frozen=True)
class Verified:
    reference: str
    digest: str
    compression: str
    local: str  # the local conversion's sha256
    published: list[str]
    seconds: float


def verify(settings: Settings, target: str, flavor: str, compression: str | None,
           progress: Progress, platform: Platform | None = None) -> Verified:
    """Convert ``target`` here (never from a published file) and compare it byte for byte
    with each squashfs published beside it in that compression; an index is verified for
    ``platform`` (default: this node's)."""
    image = catalog_image(settings, target) if "/" not in target and ":" not in target \
        else None
    if image is not None:
        ref = require_pushed(settings, image.name, flavor, "to verify", progress).reference
        options = squash_options(settings, image.spec.squashfs_compression, compression)
    else:
        ref = Reference.parse(target, default_registry=settings.registry.address)
        options = squash_options(settings, None, compression)
    client, cache = registry_client(settings), storage(settings)
    digest = resolve_digest(client, ref, platform)
    name = f"{ref.repository}@{digest}"
    published = find_published(client, ref.repository, digest, options.compression)
    if not published:
        raise VerifyError(f"{name} has no published squashfs ({options.compression})",
                          hint="publish one: imgpipe push --squashfs")
    cache.prepare()
    work = cache.private_work(f"verify-{digest.split(':')[1][:16]}")  # this user's alone
    try:
        local = convert_privately(client, cache, ref.with_digest(digest), options,
                                  work / "local.sqsh", say=progress.step,
                                  connections=settings.enroot.max_connections,
                                  count=progress.transfer)
        progress.done()
        local_digest = "sha256:" + file_sha256(local.path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for candidate in published:
        if candidate.blob != local_digest:
            raise VerifyError(f"published squashfs {candidate.blob} of {name} differs from "
                              f"a local conversion ({local_digest}): refused",
                              hint="remove it (imgpipe registry rm) and publish again with "
                              "imgpipe push --squashfs")
    if image is not None:
        _record_pin(settings, image.name, flavor, digest, options.compression, local_digest)
    return Verified(str(ref), digest, options.compression, local_digest,
                    [p.blob for p in published], local.seconds)


def publish_all(settings: Settings, images: tuple[str, ...], flavor: str | None,
                pushed: list[tuple[str, str]], progress: Progress) -> list[Published]:
    """Publish the squashfs of every (image, flavor) just pushed or recorded; with none,
    of what the lock pins for ``images`` (default: all) in ``flavor`` (publishing again is a
    no-op)."""
    keys = list(pushed)
    if not keys:
        wanted = flavor or settings.default_flavor
        lock = read_lock(lock_path(settings.root))
        keys = [(image.name, wanted) for image in select(load_catalog(settings), list(images))
                if lock.entry(image.name, wanted) is not None]
    return [p for name, one in keys for p in publish_squashfs(settings, name, one, progress)]
