"""Registry blobs into the shared cache: parallel, bounded, verified while streaming.

A blob already in the cache is not fetched again; an interrupted transfer is
retried; a blob whose bytes do not match its digest never enters the cache
(``RegistryClient.fetch_blob`` hashes while streaming and renames only on a
match).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpipe.enroot.storage import Storage
from imgpipe.registry.client import Manifest, RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError

MAX_CONNECTIONS = 4
ATTEMPTS = 3


@dataclass(frozen=True)
class Layer:
    digest: str
    media_type: str
    size: int
    path: Path
    fetched: bool = False  # by this call (its bytes hashed on the way), not found cached


@dataclass(frozen=True)
class FetchedImage:
    repository: str
    manifest: Manifest
    config: dict[str, Any]
    layers: list[Layer]
    fetched_bytes: int


def fetch_blob_cached(client: RegistryClient, storage: Storage, repository: str, digest: str,
                      on_bytes: Callable[[int], None] | None = None) -> tuple[Path, int]:
    """The cached path of ``digest``, fetching it if needed; returns (path, bytes fetched)."""
    path = storage.blob(digest)
    if path.exists():
        return path, 0
    for attempt in range(1, ATTEMPTS + 1):
        try:
            client.fetch_blob(repository, digest, path, progress=on_bytes)
            return path, path.stat().st_size
        except DigestMismatchError:
            raise
        except RegistryError:
            if attempt == ATTEMPTS or path.exists():
                if path.exists():
                    return path, 0  # another process finished it meanwhile
                raise
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")


def fetch_image(client: RegistryClient, storage: Storage, repository: str, digest: str,
                on_bytes: Callable[[int], None] | None = None,
                connections: int = MAX_CONNECTIONS) -> FetchedImage:
    """Manifest, config and every layer of ``repository@digest``, all in the cache."""
    manifest = client.manifest(repository, digest)
    config_path, config_bytes = fetch_blob_cached(client, storage, repository,
                                                  manifest.config_digest)
    config = json.loads(config_path.read_text())
    descriptors = manifest.layers
    with ThreadPoolExecutor(max_workers=max(1, connections)) as pool:
        results = list(pool.map(
            lambda d: fetch_blob_cached(client, storage, repository, d["digest"], on_bytes),
            descriptors))
    layers = [Layer(d["digest"], d.get("mediaType", ""), d.get("size", 0), path, count > 0)
              for d, (path, count) in zip(descriptors, results, strict=True)]
    fetched = config_bytes + sum(n for _, n in results)
    return FetchedImage(repository, manifest, config, layers, fetched)
