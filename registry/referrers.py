"""OCI 1.1 referrers: artifacts whose ``subject`` is an image manifest.

Reading asks the referrers API (``GET /v2/<name>/referrers/<digest>``) and, where the
registry has none (registry 2.8 answers 404), reads the fallback OCI defines: an image
index tagged ``sha256-<hex>`` listing the referrers' descriptors.  Writing keeps that
index up to date (registries with the API ignore it): read, add or drop a descriptor,
write, read back — two writers at once lose nothing, the loser of the race writes again.

An artifact manifest is also tagged ``sha256-<hex>.<suffix>`` of its own, so that
``garbage-collect --delete-untagged`` (which in 2.8 deletes the untagged children of an
index) cannot take it while its subject is kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
from imgpipe.registry.mediatypes import OCI_INDEX
from imgpipe.registry.transfer import put_manifest

ATTEMPTS = 5


def referrers_tag(subject: str) -> str:
    """The fallback tag of ``subject``'s referrers index: ``sha256-<hex>``."""
    algorithm, _, hexpart = subject.partition(":")
    return f"{algorithm}-{hexpart}"


def is_referrers_tag(tag: str) -> bool:
    """Tags the schema writes (the index, and imgpipe's artifact tags): not images."""
    head, _, rest = tag.partition("-")
    return head == "sha256" and len(rest) >= 64 and all(c in "0123456789abcdef"
                                                         for c in rest[:64])


def _index(client: RegistryClient, repository: str, subject: str) -> list[dict[str, Any]]:
    response = client.request("GET", f"/v2/{repository}/manifests/{referrers_tag(subject)}",
                              ok={200, 404}, headers={"Accept": OCI_INDEX})
    if response.status_code == 404:
        return []
    try:
        manifests = response.json().get("manifests") or []
    except (ValueError, AttributeError) as exc:
        raise RegistryError(f"{repository}:{referrers_tag(subject)} is not an OCI index") from exc
    return [m for m in manifests if isinstance(m, dict) and isinstance(m.get("digest"), str)]


def referrers(client: RegistryClient, repository: str, subject: str,
              artifact_type: str | None = None) -> list[dict[str, Any]]:
    """Descriptors of the artifacts that name ``subject``, of ``artifact_type`` if given:
    the referrers API where the registry answers it, else the tag schema's index."""
    params = {"artifactType": artifact_type} if artifact_type else None
    response = client.request("GET", f"/v2/{repository}/referrers/{subject}", ok={200, 404},
                              params=params, headers={"Accept": OCI_INDEX})
    found: list[dict[str, Any]] | None = None
    if response.status_code == 200:
        try:
            found = [m for m in response.json().get("manifests") or [] if isinstance(m, dict)]
        except (ValueError, AttributeError):
            found = None
    if found is None:
        found = _index(client, repository, subject)
    return [m for m in found if artifact_type is None or m.get("artifactType") == artifact_type]


def _write_index(client: RegistryClient, repository: str, subject: str,
                 manifests: list[dict[str, Any]]) -> None:
    tag = referrers_tag(subject)
    if not manifests:
        digest = client.manifest_digest(repository, tag)
        if digest is not None:
            client.delete_manifest(repository, digest)
        return
    body = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    put_manifest(client, repository, tag, raw, OCI_INDEX)


def _update(client: RegistryClient, repository: str, subject: str,
            add: Iterable[dict[str, Any]], drop: set[str]) -> None:
    adding = list(add)
    for _ in range(ATTEMPTS):
        current = _index(client, repository, subject)
        kept = [m for m in current if m["digest"] not in drop
                and m["digest"] not in {a["digest"] for a in adding}]
        wanted = kept + adding
        if [m["digest"] for m in current] != [m["digest"] for m in wanted]:
            _write_index(client, repository, subject, wanted)
        now = {m["digest"] for m in _index(client, repository, subject)}
        if {a["digest"] for a in adding} <= now and not (drop & now):
            return
    raise RegistryError(f"the referrers index {repository}:{referrers_tag(subject)} kept "
                        f"changing under {ATTEMPTS} attempts to update it")


def attach(client: RegistryClient, repository: str, subject: str,
           descriptor: dict[str, Any]) -> None:
    """List ``descriptor`` (an artifact manifest's) in ``subject``'s referrers index."""
    _update(client, repository, subject, [descriptor], set())


def detach(client: RegistryClient, repository: str, subject: str, digests: set[str]) -> None:
    """Drop artifacts from ``subject``'s referrers index (the index goes with its last)."""
    _update(client, repository, subject, [], digests)
