"""A manifest as the registry serves it: its digest (of the bytes served), its media type,
its body, and the entry of an index for a platform (BuildKit's attestation entries,
``unknown/unknown``, skipped)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from imgpipe.base.platforms import Platform
from imgpipe.registry.errors import RegistryError

__all__ = ["Manifest", "select_platform", "sha256_digest"]


@dataclass(frozen=True)
class Manifest:
    """One image manifest as served: its digest depends on the media type served."""

    digest: str
    media_type: str
    raw: bytes

    @property
    def body(self) -> dict[str, Any]:
        parsed = json.loads(self.raw)
        if not isinstance(parsed, dict):
            raise RegistryError("a manifest that is not a JSON object")
        return parsed

    @property
    def config_digest(self) -> str:
        return str(self.body["config"]["digest"])

    @property
    def layers(self) -> list[dict[str, Any]]:
        return list(self.body.get("layers", []))

    @property
    def size(self) -> int:
        """Bytes of config and layers (what the image takes in the registry)."""
        body = self.body
        return int(body.get("config", {}).get("size", 0)) + sum(int(x.get("size", 0))
                                                               for x in self.layers)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def select_platform(index: dict[str, Any], platform: Platform) -> dict[str, Any]:
    """The index entry for ``platform``; attestation (unknown/unknown) entries are skipped."""
    candidates = []
    for entry in index.get("manifests", []):
        plat = entry.get("platform") or {}
        if plat.get("os") == "unknown" or plat.get("architecture") == "unknown":
            continue
        if plat.get("os") == platform.os and plat.get("architecture") == platform.architecture:
            candidates.append(entry)
    if platform.variant:
        exact = [e for e in candidates if e["platform"].get("variant") == platform.variant]
        candidates = exact or candidates
    if not candidates:
        offered = sorted(
            f"{(e.get('platform') or {}).get('os')}/{(e.get('platform') or {}).get('architecture')}"
            for e in index.get("manifests", [])
        )
        raise RegistryError(
            f"no image for {platform.os}/{platform.architecture} in the index "
            f"(it offers {', '.join(offered) or 'nothing'})"
        )
    chosen: dict[str, Any] = candidates[0]
    return chosen
