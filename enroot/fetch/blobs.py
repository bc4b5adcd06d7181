"""Registry blobs into the shared cache: parallel, bounded, verified while streaming.

A blob already in the cache is not fetched again; an interrupted transfer is
retried; a blob whose bytes do not match its digest never enters the cache
(``RegistryClient.fetch_blob`` hashes while streaming and renames only on a
match).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpipe.base.files import read_regular
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.trust import user_name
from imgpipe.enroot.errors import BlobDigestError, ConvertError
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.manifests import Manifest

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
                      on_bytes: Callable[[int], None] | None = None,
                      say: Callable[[str], None] | None = None) -> tuple[Path, int]:
    """The cached path of ``digest``, fetching it if needed; returns (path, bytes fetched)."""
    path = storage.blob(digest)
    try:
        info = path.lstat()
    except FileNotFoundError:
        pass
    else:
        readable = stat.S_ISREG(info.st_mode) and os.access(path, os.R_OK)
        if readable:
            return path, 0  # whoever wrote it, its bytes are hashed wherever they are used
        if stat.S_ISREG(info.st_mode) and say is not None:
            say(f"cached blob {digest[:19]} belongs to {user_name(info.st_uid)} and this user "
                f"cannot read it (mode {stat.S_IMODE(info.st_mode):04o}): using a copy of "
                "its own")
        # A link, FIFO, folder or unreadable file at a blob's name: never read through.
        # Removed where this user may (its own cache); else its own copy goes to its
        # private folder.
        try:
            path.rmdir() if stat.S_ISDIR(info.st_mode) else path.unlink()
        except OSError:
            path = storage.private_blob(digest)
            if path.exists():
                return path, 0
    for attempt in range(1, ATTEMPTS + 1):
        try:
            client.fetch_blob(repository, digest, path, progress=on_bytes)
            return path, path.stat().st_size
        except DigestMismatchError:
            raise
        except PermissionError:
            # Another user's job landed the same blob first: in the cache's sticky folder the
            # rename onto their file is refused.  Theirs is as good (hashed where it is used).
            if path.is_file() and os.access(path, os.R_OK):
                return path, 0
            raise
        except RegistryError:
            if attempt == ATTEMPTS or path.exists():
                if path.exists():
                    return path, 0  # another process finished it meanwhile
                raise
            time.sleep(0.5 * attempt)
    raise AssertionError("unreachable")


def read_config(client: RegistryClient, storage: Storage, repository: str, digest: str
                ) -> tuple[dict[str, Any], int]:
    """The image config (it becomes /etc/rc and /etc/environment), from the cache when there,
    its digest checked on the very bytes parsed; cached bytes that do not match are fetched
    again into this user's private folder.  Returns (config, bytes fetched)."""
    path, fetched = fetch_blob_cached(client, storage, repository, digest)
    try:
        raw = read_regular(path)
    except OSError:
        raw = b""
    if f"sha256:{hashlib.sha256(raw).hexdigest()}" != digest:
        private = storage.private_config(digest)
        client.fetch_blob(repository, digest, private)
        raw = read_regular(private)
        private.unlink(missing_ok=True)
        if f"sha256:{hashlib.sha256(raw).hexdigest()}" != digest:  # changed under our feet
            raise BlobDigestError(digest, f"sha256:{hashlib.sha256(raw).hexdigest()}", private)
        fetched = len(raw)
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ConvertError(f"the image config {digest[:19]} of {repository} is not JSON") from exc
    if not isinstance(config, dict):
        raise ConvertError(f"the image config {digest[:19]} of {repository} is not an object")
    return config, fetched


class FetchStopped(Exception):
    """The conversion ended before this fetch did (it failed, or it was interrupted)."""


class ImageFetch:
    """Manifest and config of ``repository@digest`` at once, its layers into the cache in
    the background over ``connections`` requests, top layer first when ``top_first`` (the
    one pass reads them that way, and starts on each as soon as it has landed).
    :meth:`layer` waits for one, :meth:`wait` for all; :meth:`close` stops what is left."""

    def __init__(self, client: RegistryClient, storage: Storage, repository: str, digest: str,
                 on_bytes: Callable[[int], None] | None = None,
                 connections: int = MAX_CONNECTIONS, top_first: bool = False,
                 say: Callable[[str], None] | None = None) -> None:
        self.repository = repository
        self.manifest = client.manifest(repository, digest)
        self.config, self._config_bytes = read_config(client, storage, repository,
                                                      self.manifest.config_digest)
        self._descriptors = self.manifest.layers
        self._storage = storage
        self._stopped = threading.Event()

        def counted(n: int) -> None:
            if self._stopped.is_set():
                raise FetchStopped(f"the fetch of {repository}@{digest[:19]} was stopped")
            if on_bytes is not None:
                on_bytes(n)

        order = range(len(self._descriptors))
        self._pool = ThreadPoolExecutor(max_workers=max(1, connections),
                                        thread_name_prefix="fetch")
        self._results: dict[int, Future[tuple[Path, int]]] = {}
        for index in (reversed(order) if top_first else order):
            self._results[index] = self._pool.submit(
                fetch_blob_cached, client, storage, repository,
                self._descriptors[index]["digest"], counted, say)

    @property
    def layer_sizes(self) -> list[int]:
        """Each layer's compressed size, as the manifest gives it."""
        return [int(descriptor.get("size", 0)) for descriptor in self._descriptors]

    def _layer(self, index: int, path: Path, fetched: bool) -> Layer:
        descriptor = self._descriptors[index]
        return Layer(descriptor["digest"], descriptor.get("mediaType", ""),
                     descriptor.get("size", 0), path, fetched)

    def planned(self) -> FetchedImage:
        """The image as it will be once fetched: each layer where the cache keeps it."""
        layers = [self._layer(index, self._storage.blob(descriptor["digest"]), False)
                  for index, descriptor in enumerate(self._descriptors)]
        return FetchedImage(self.repository, self.manifest, self.config, layers, 0)

    def layer(self, index: int) -> Layer:
        """Layer ``index`` (manifest order) once it is in the cache; its fetch's error."""
        path, count = self._results[index].result()
        return self._layer(index, path, count > 0)

    def wait(self) -> FetchedImage:
        """Every layer in the cache (the first fetch error raised)."""
        layers = [self.layer(index) for index in range(len(self._descriptors))]
        return FetchedImage(self.repository, self.manifest, self.config, layers,
                            self.fetched_bytes)

    @property
    def fetched_bytes(self) -> int:
        """Bytes fetched so far (config included) by fetches that finished."""
        done = [result.result()[1] for result in self._results.values()
                if result.done() and not result.cancelled() and result.exception() is None]
        return self._config_bytes + sum(done)

    def close(self) -> None:
        """Stop the fetches under way (their partial files removed) and drop the rest."""
        self._stopped.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ImageFetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_image(client: RegistryClient, storage: Storage, repository: str, digest: str,
                on_bytes: Callable[[int], None] | None = None,
                connections: int = MAX_CONNECTIONS,
                say: Callable[[str], None] | None = None) -> FetchedImage:
    """Manifest, config and every layer of ``repository@digest``, all in the cache."""
    with ImageFetch(client, storage, repository, digest, on_bytes, connections,
                    say=say) as fetching:
        return fetching.wait()
