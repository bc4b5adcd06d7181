"""The fast path's registry questions (``imgpipe.commands.node.importer.fast_get``), on the
standard library's ``http.client`` alone: the manifest digest a tag names, by one HEAD, and this
node's entry of an index, by one GET whose bytes must hash to the index's digest.  Anything odd
is None: the full path, with its errors, decides then.
"""

from __future__ import annotations

from typing import Any


def _connect(scheme: str, address: str) -> Any:
    import http.client

    host, _, port = address.rpartition(":")
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    return kind(host, int(port), timeout=5)


def head_digest(scheme: str, address: str, repository: str, tag: str) -> str | None:
    """The manifest digest a tag names, by one HEAD (an index: its entry for this node's
    platform, by one GET more); None for anything odd."""
    import http.client

    from imgpipe.registry.mediatypes import INDEX_TYPES, MANIFEST_ACCEPT

    try:
        connection = _connect(scheme, address)
        connection.request("HEAD", f"/v2/{repository}/manifests/{tag}",
                           headers={"Accept": MANIFEST_ACCEPT})
        response = connection.getresponse()
        connection.close()
    except (OSError, http.client.HTTPException, ValueError):
        return None
    media_type = (response.getheader("Content-Type") or "").split(";")[0].strip()
    digest = str(response.getheader("Docker-Content-Digest") or "")
    if response.status != 200 or not digest:
        return None
    if media_type in INDEX_TYPES:
        return platform_entry(scheme, address, repository, digest)
    return digest


def platform_entry(scheme: str, address: str, repository: str, digest: str) -> str | None:
    """This node's manifest in the index ``digest`` (IMGPIPE_PLATFORM, else uname -m), by
    one GET whose bytes must hash to ``digest`` (so nothing is trusted that the digest does
    not pin); ``digest`` itself when it names a plain manifest; None for anything odd."""
    import hashlib
    import http.client
    import json

    from imgpipe.base.platforms import node_platform
    from imgpipe.registry.mediatypes import INDEX_TYPES, MANIFEST_ACCEPT

    try:
        connection = _connect(scheme, address)
        connection.request("GET", f"/v2/{repository}/manifests/{digest}",
                           headers={"Accept": MANIFEST_ACCEPT})
        response = connection.getresponse()
        body = response.read(4 << 20)
        connection.close()
        if response.status != 200 or f"sha256:{hashlib.sha256(body).hexdigest()}" != digest:
            return None
        served = json.loads(body)
        if served.get("mediaType") not in INDEX_TYPES:
            return digest
        platform = node_platform()
        for entry in served.get("manifests") or []:
            wanted = entry.get("platform") or {}
            child = entry.get("digest")
            if (wanted.get("os"), wanted.get("architecture")) == (
                    platform.os, platform.architecture) and isinstance(child, str) \
                    and child.startswith("sha256:") and len(child) == 71:
                return child
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return None
    return None
