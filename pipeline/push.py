"""Pushing built images and recording exactly which bytes were pushed in imgpipe.lock.

The manifest digest comes from the registry (a HEAD of the pushed tag), never
from the push's progress text; every tag must point to it, and the manifest's
config digest must be the ID of the image that was built.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.engine import BuildClient, Engine
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.platforms import Platform
from imgpipe.base.progress import Progress
from imgpipe.pipeline.builds import BuildRecord
from imgpipe.pipeline.lock import LockEntry, PlatformPin, updating_lock
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
from imgpipe.registry.manifests import Manifest
from imgpipe.registry.platformindex import put_index


@dataclass(frozen=True)
class PushOutcome:
    image: str
    flavor: str
    repository: str
    tags: tuple[str, ...]
    digest: str
    size: int
    seconds: float

    @property
    def pinned(self) -> str:
        return f"{self.repository}@{self.digest}"


def ensure_local(engine: Engine, record: BuildRecord, image_id: str | None = None) -> None:
    image_id = image_id or record.image_id
    if engine.image_id(image_id) is None:
        raise ImgpipeError(
            f"the image built for {record.image}/{record.flavor} ({image_id[:19]}) is no "
            "longer in the Docker engine",
            hint=f"build it again: imgpipe build {record.image} --force",
        )


def push_record(client: BuildClient, registry: RegistryClient, record: BuildRecord,
                lock_file: Path, progress: Progress,
                builders: Mapping[str, str] | None = None) -> PushOutcome:
    """Push every tag of ``record``, verify the digest, and record it in the lock."""
    if record.platforms:
        return _push_index(client, registry, record, lock_file, progress, builders or {})
    docker_engine = Engine(client.docker_host, timeout=3600)
    ensure_local(docker_engine, record)
    repo_path = record.reference(record.tags[0]).repository
    started = time.monotonic()
    progress.step(f"push {record.image}/{record.flavor} -> {record.repository}")
    try:
        for tag in record.tags:
            target = str(record.reference(tag))
            docker_engine.push(target, progress.transfer(f"push {target}", None),
                               progress.detail)
    finally:
        progress.done()
    digests = {tag: registry.manifest_digest(repo_path, tag) for tag in record.tags}
    digest = digests[record.tags[0]]
    if digest is None or any(d != digest for d in digests.values()):
        raise RegistryError(f"after the push, the tags of {record.repository} do not all point "
                            f"to one manifest: {digests}")
    manifest = registry.manifest(repo_path, digest)
    if manifest.config_digest != record.image_id:
        raise RegistryError(
            f"{record.repository}@{digest} holds config {manifest.config_digest}, not the "
            f"image that was built ({record.image_id}); was the tag pushed by someone else?")
    seconds = time.monotonic() - started
    return _record(record, lock_file, digest, manifest, seconds, progress)


def _push_index(client: BuildClient, registry: RegistryClient, record: BuildRecord,
                lock_file: Path, progress: Progress, builders: Mapping[str, str]
                ) -> PushOutcome:
    """An index build: each platform's image under its own tag (from the engine that built
    it), then one OCI index naming them all under every tag of the record."""
    repo_path = record.reference(record.tags[0]).repository
    started = time.monotonic()
    manifests: dict[Platform, Manifest] = {}
    for name, image_id in record.platforms.items():
        docker_engine = Engine(builders.get(name, client.docker_host), timeout=3600)
        ensure_local(docker_engine, record, image_id)
        target = record.platform_tag(name)
        progress.step(f"push {record.image}/{record.flavor} {name} -> {target}")
        try:
            docker_engine.push(target, progress.transfer(f"push {target}", None),
                               progress.detail)
        finally:
            progress.done()
        digest = registry.manifest_digest(repo_path, target.rsplit(":", 1)[1])
        if digest is None:
            raise RegistryError(f"{target} is not in the registry after its push")
        manifest = registry.manifest_exactly(repo_path, digest)
        if manifest.config_digest != image_id:
            raise RegistryError(f"{target} holds config {manifest.config_digest}, not the "
                                f"image built for {name} ({image_id}); was it pushed by "
                                "someone else?")
        manifests[Platform.parse(name)] = manifest
    index = put_index(registry, repo_path, record.tags, manifests)
    pushed = {tag: registry.manifest_digest(repo_path, tag) for tag in record.tags}
    if any(d != index for d in pushed.values()):
        raise RegistryError(f"after the push, the tags of {record.repository} do not all point "
                            f"to the index {index}: {pushed}")
    first = next(iter(manifests.values()))
    pins = {str(p): PlatformPin(digest=m.digest, config_digest=m.config_digest, size=m.size,
                                python_wheels=record.python_wheels.get(str(p), {}))
            for p, m in manifests.items()}
    return _record(record, lock_file, index, first, time.monotonic() - started, progress,
                   pins)


def _record(record: BuildRecord, lock_file: Path, digest: str, manifest: Manifest,
            seconds: float, progress: Progress,
            platforms: dict[str, PlatformPin] | None = None) -> PushOutcome:
    entry = LockEntry(
        repository=record.repository, tags=record.tags, digest=digest,
        config_digest=manifest.config_digest, input_hash=record.input_hash,
        inputs=record.inputs, flavor=record.flavor, base=record.base,
        base_digest=record.base_digest, size=manifest.size, build_args=record.build_args,
        wheels_dir=record.wheels_dir, platforms=platforms or {},
        # a one-manifest build made one platform's wheels
        python_wheels={} if platforms else next(iter(record.python_wheels.values()), {}),
        pushed_at=dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
    )
    with updating_lock(lock_file) as lock:
        lock.images.setdefault(record.image, {})[record.flavor] = entry
    what = f" for {', '.join(platforms)}" if platforms else ""
    progress.step(f"pushed {record.repository}@{digest}{what} ({manifest.size / 1e6:.1f} MB) "
                  f"in {seconds:.1f} s")
    return PushOutcome(record.image, record.flavor, record.repository, tuple(record.tags),
                       digest, manifest.size, seconds)
