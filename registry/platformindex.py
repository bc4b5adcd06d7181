"""One tag, one OCI index, one manifest per platform.

The engine's built-in BuildKit keeps one platform per tag, so each platform is pushed
under a tag of its own and the index that names them all is written here, through the
registry API.  Reading an index skips BuildKit's attestation entries (``unknown/unknown``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from imgpipe.base.errors import ConfigError
from imgpipe.base.platforms import Platform
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
from imgpipe.registry.manifests import Manifest
from imgpipe.registry.mediatypes import INDEX_TYPES, OCI_INDEX
from imgpipe.registry.transfer import put_manifest

__all__ = ["index_bytes", "platform_digests", "put_index"]


def index_bytes(manifests: Mapping[Platform, Manifest]) -> bytes:
    """The OCI index of ``manifests`` (platform order: as given)."""
    return json.dumps({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": manifest.media_type, "digest": manifest.digest,
                       "size": len(manifest.raw), "platform": platform.oci()}
                      for platform, manifest in manifests.items()],
    }, indent=2).encode()


def put_index(client: RegistryClient, repository: str, tags: list[str],
              manifests: Mapping[Platform, Manifest]) -> str:
    """Write the index under every tag; its digest (the same for every tag)."""
    raw = index_bytes(manifests)
    digests = {put_manifest(client, repository, tag, raw, OCI_INDEX) for tag in tags}
    if len(digests) != 1:  # pragma: no cover - one body, one digest
        raise RegistryError(f"the index of {repository} got several digests: {digests}")
    return digests.pop()


def platform_digests(client: RegistryClient, repository: str, digest: str
                     ) -> dict[Platform, str]:
    """Platform -> manifest digest of the index stored under ``digest`` (attestations
    skipped); an image manifest is its own one entry, of no named platform (empty)."""
    served = client.manifest_exactly(repository, digest)
    if served.media_type not in INDEX_TYPES:
        return {}
    found: dict[Platform, str] = {}
    for entry in served.body.get("manifests") or []:
        platform = entry.get("platform") or {}
        if not isinstance(platform, dict) or "unknown" in (platform.get("os"),
                                                           platform.get("architecture")):
            continue
        text = "/".join(str(platform.get(k) or "") for k in ("os", "architecture", "variant"))
        try:
            key = Platform.parse(text.rstrip("/"))
        except ConfigError:  # a foreign entry is skipped, never fatal
            continue
        found.setdefault(key, str(entry.get("digest")))
    return found
