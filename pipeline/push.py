"""Pushing built images and recording exactly which bytes were pushed in imgpipe.lock.

The manifest digest comes from the registry (a HEAD of the pushed tag), never
from the push's progress text; every tag must point to it, and the manifest's
config digest must be the ID of the image that was built.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.engine import BuildClient, Engine
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.progress import Progress
from imgpipe.pipeline.builds import BuildRecord
from imgpipe.pipeline.lock import LockEntry, updating_lock
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError


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


def ensure_local(engine: Engine, record: BuildRecord) -> None:
    if engine.image_id(record.image_id) is None:
        raise ImgpipeError(
            f"the image built for {record.image}/{record.flavor} ({record.image_id[:19]}) is no "
            "longer in the Docker engine",
            hint=f"build it again: imgpipe build {record.image} --force",
        )


def push_record(client: BuildClient, registry: RegistryClient, record: BuildRecord,
                lock_file: Path, progress: Progress) -> PushOutcome:
    """Push every tag of ``record``, verify the digest, and record it in the lock."""
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
    entry = LockEntry(
        repository=record.repository, tags=record.tags, digest=digest,
        config_digest=manifest.config_digest, input_hash=record.input_hash,
        inputs=record.inputs, flavor=record.flavor, base=record.base,
        base_digest=record.base_digest, size=manifest.size, build_args=record.build_args,
        wheels_dir=record.wheels_dir,
        pushed_at=dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat(),
    )
    with updating_lock(lock_file) as lock:
        lock.images.setdefault(record.image, {})[record.flavor] = entry
    progress.step(f"pushed {record.repository}@{digest} ({manifest.size / 1e6:.1f} MB) "
                  f"in {seconds:.1f} s")
    return PushOutcome(record.image, record.flavor, record.repository, tuple(record.tags),
                       digest, manifest.size, seconds)
