"""Cached blobs that no longer match their digest: found after a layer error, evicted and
fetched again (or, when another user owns the bad file, bypassed by a private copy).

A corrupt or truncated cached blob fails a conversion like a broken layer would, so on a
layer error every blob is checked before the image is blamed; the conversion then runs once
more from blobs all in place.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from imgpipe.base.files import file_sha256
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.errors import BlobDigestError
from imgpipe.enroot.fetch.blobs import fetch_blob_cached
from imgpipe.enroot.flatten.layerreader import LayerSource
from imgpipe.registry.client import RegistryClient


def spoiled_blobs(layers: list[LayerSource], exc: Exception) -> set[str]:
    """The layers whose cached bytes no longer match their digest.  A corrupt or truncated
    cached blob fails like a broken layer, so on a layer error every blob is checked
    before the image is blamed."""
    if isinstance(exc, BlobDigestError):
        return {exc.digest}
    return {layer.digest for layer in layers  # a blob still being fetched is checked then
            if layer.path.exists() and f"sha256:{file_sha256(layer.path)}" != layer.digest}


def fetch_again(client: RegistryClient, storage: Storage, repository: str,
                layers: list[LayerSource], spoiled: set[str], work: Path,
                say: Callable[[str], None]) -> list[LayerSource]:
    """Evict the spoiled cache entries and fetch them once more.  An entry another user owns
    (the shared folder is sticky) cannot be removed: this conversion then uses a private copy
    in its work area, and says whose file is bad."""
    fresh = []
    for layer in layers:
        if layer.digest not in spoiled:
            fresh.append(layer)
            continue
        try:
            layer.path.unlink(missing_ok=True)
            path, _ = fetch_blob_cached(client, storage, repository, layer.digest)
            say(f"cached blob {layer.digest[:19]} did not match its digest: evicted and "
                "fetched again")
        except PermissionError:
            owner = layer.path.stat().st_uid
            path = work / layer.digest.replace(":", "-")
            client.fetch_blob(repository, layer.digest, path)
            say(f"cached blob {layer.digest[:19]} (owned by uid {owner}) does not match its "
                "digest and cannot be removed by this user: using a private copy")
        fresh.append(LayerSource(layer.digest, path, layer.diff_id))
    return fresh
