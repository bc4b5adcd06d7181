"""One image copied from a registry into another by digest (``imgpipe mirror``): the manifest
or index the source serves, every manifest an index lists (every platform, attestations too),
and every blob they name, stored in the destination under the same digests, so a pin taken
from the source holds in the mirror and the other way round.

Checked on every byte: a manifest must hash to the digest that names it (the one asked for,
or its index's entry), a blob is downloaded into this user's partial file (``work``), hashed
as it lands, and uploaded only when it matches (the registry checks it again on the closing
PUT).  Resumable: a blob or manifest the destination has already (HEAD) is not copied again,
a blob cut off mid-way goes on from its partial file, and the tag is written last, so a copy
broken off leaves no tag that points at bytes the mirror lacks.  A layer with ``urls`` (a
foreign, non-distributable layer) is not the registry's to copy: it is counted, not fetched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock
from typing import Any

from imgpipe.registry.client import MANIFEST_LIMIT, RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.manifests import Manifest, sha256_digest
from imgpipe.registry.mediatypes import INDEX_TYPES, MANIFEST_ACCEPT
from imgpipe.registry.transfer import fetch_resumable, push_blob, put_manifest

BLOBS_AT_ONCE = 3  # blobs copied at once: a large layer and the small ones beside it
MAX_DEPTH = 2  # an index of indexes is allowed one level down, no further

Say = Callable[[str], None]
Transfer = Callable[[str, int | None], Callable[[int], None]]


@dataclass
class Copied:
    """What one copy did: the top manifest's digest and type, the platforms it holds, and
    what was sent (``*_copied``) or found in the destination already (``*_present``)."""

    digest: str
    media_type: str
    platforms: list[str] = field(default_factory=list)
    manifests_copied: int = 0
    manifests_present: int = 0
    blobs_copied: int = 0
    blobs_present: int = 0
    bytes_copied: int = 0
    foreign_layers: int = 0
    seen: set[str] = field(default_factory=set, repr=False)  # blobs handled by this copy


@dataclass(frozen=True)
class Side:
    """One end of the copy: a registry and a repository in it."""

    client: RegistryClient
    repository: str


def copy_image(source: Side, reference: str, dest: Side, tag: str | None, work: Path,
               say: Say = lambda _: None, transfer: Transfer | None = None) -> Copied:
    """Copy ``reference`` (a tag or digest of ``source``) into ``dest`` under the same
    digests, tagged ``tag`` when given; blobs pass through partial files in ``work``.
    Raises RegistryError (DigestMismatchError for bytes that do not match their digest)."""
    top = _top_manifest(source, reference)
    copied = Copied(top.digest, top.media_type)
    _copy_manifest(source, dest, top, work, copied, say, transfer, 0)
    if tag is not None:
        put_manifest(dest.client, dest.repository, tag, top.raw, top.media_type)
        there = dest.client.manifest_digest(dest.repository, tag)
        if there != top.digest:
            raise DigestMismatchError(
                f"{dest.client.address}/{dest.repository}:{tag} names {there} after the copy, "
                f"not the source's {top.digest}")
    return copied


def _top_manifest(source: Side, reference: str) -> Manifest:
    """The manifest or index ``reference`` names, as served, its digest checked when the
    reference is one."""
    if reference.startswith("sha256:"):
        return source.client.manifest_exactly(source.repository, reference)
    path = f"/v2/{source.repository}/manifests/{reference}"
    response = source.client.request("GET", path, ok={200, 404}, limit=MANIFEST_LIMIT,
                                     headers={"Accept": MANIFEST_ACCEPT})
    if response.status_code == 404:
        raise RegistryError(f"{source.client.address}/{source.repository}:{reference} not "
                            "found", status=404, registry_code="MANIFEST_UNKNOWN")
    raw = response.content
    return Manifest(sha256_digest(raw), _media_type(raw, response.headers.get(
        "Content-Type", "")), raw)


def _media_type(raw: bytes, header: str) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        raise RegistryError("the source served a manifest that is not JSON") from None
    media_type = body.get("mediaType") if isinstance(body, dict) else None
    return media_type if isinstance(media_type, str) else header.split(";")[0].strip()


def _copy_manifest(source: Side, dest: Side, manifest: Manifest, work: Path, copied: Copied,
                   say: Say, transfer: Transfer | None, depth: int, label: str = "blobs"
                   ) -> None:
    """Everything ``manifest`` names, then the manifest itself by its digest."""
    if dest.client.manifest_digest(dest.repository, manifest.digest) == manifest.digest:
        copied.manifests_present += 1
        if manifest.media_type in INDEX_TYPES:  # still say what it holds
            copied.platforms += [_platform(e) for e in _entries(manifest)]
        return
    body = manifest.body
    if manifest.media_type in INDEX_TYPES:
        if depth >= MAX_DEPTH:
            raise RegistryError(f"manifest {manifest.digest[:19]} nests indexes deeper than "
                                f"{MAX_DEPTH}: refused")
        for entry in _entries(manifest):
            child = source.client.manifest_exactly(source.repository, str(entry["digest"]))
            if len(child.raw) != int(entry.get("size", len(child.raw))):
                raise DigestMismatchError(f"manifest {child.digest[:19]} is {len(child.raw)} "
                                          f"bytes, its index says {entry.get('size')}")
            platform = _platform(entry)
            copied.platforms.append(platform)
            say(f"{platform}: {child.digest}")
            _copy_manifest(source, dest, child, work, copied, say, transfer, depth + 1,
                           platform)
    else:
        blobs = [body.get("config") or {}] + list(body.get("layers") or [])
        _copy_blobs(source, dest, [b for b in blobs if isinstance(b, dict)], work, copied,
                    transfer, label)
    put_manifest(dest.client, dest.repository, manifest.digest, manifest.raw,
                 manifest.media_type)
    copied.manifests_copied += 1


def _entries(manifest: Manifest) -> list[dict[str, Any]]:
    entries = manifest.body.get("manifests")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(
            e.get("digest"), str) for e in entries):
        raise RegistryError(f"index {manifest.digest[:19]} lists its manifests in no form "
                            "a registry takes")
    return entries


def _platform(entry: dict[str, Any]) -> str:
    platform = entry.get("platform") or {}
    parts = [str(platform.get("os", "?")), str(platform.get("architecture", "?"))]
    if platform.get("variant"):
        parts.append(str(platform["variant"]))
    return "/".join(parts)


def _copy_blobs(source: Side, dest: Side, descriptors: list[dict[str, Any]], work: Path,
                copied: Copied, transfer: Transfer | None, label: str) -> None:
    """The blobs ``descriptors`` name that the destination lacks, BLOBS_AT_ONCE at a time,
    counted on one line (``label``)."""
    wanted: dict[str, int] = {}
    for descriptor in descriptors:
        digest, size = descriptor.get("digest"), descriptor.get("size")
        if not isinstance(digest, str) or not isinstance(size, int) or size < 0:
            raise RegistryError(f"a blob descriptor without a digest or size ({descriptor!r:.80})")
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64 or not hexdigest.isalnum():
            raise RegistryError(f"blob digest {digest[:80]!r} is not a sha256 digest")
        if descriptor.get("urls"):
            copied.foreign_layers += 1
        elif digest not in copied.seen:  # a layer two platforms share is copied once
            copied.seen.add(digest)
            wanted[digest] = size
    missing = {d: s for d, s in wanted.items() if not dest.client.blob_exists(dest.repository, d)}
    copied.blobs_present += len(wanted) - len(missing)
    if not missing:
        return
    count = transfer(label, sum(missing.values())) if transfer is not None else None
    tally = Lock()

    def advance(moved: int) -> None:
        if count is not None:
            with tally:
                count(moved)

    def one(digest: str, size: int) -> None:
        _copy_blob(source, dest, digest, size, work, advance)
        with tally:
            copied.blobs_copied += 1
            copied.bytes_copied += size

    with ThreadPoolExecutor(BLOBS_AT_ONCE, thread_name_prefix="mirror-blob") as pool:
        for future in [pool.submit(one, d, s) for d, s in missing.items()]:
            future.result()


def _copy_blob(source: Side, dest: Side, digest: str, size: int, work: Path,
               advance: Callable[[int], None]) -> None:
    """One blob: downloaded and checked into a partial file (kept when cut off: the next
    run goes on from it), uploaded, the partial removed."""
    partial = work / f"{digest[7:]}.partial"
    try:
        fetch_resumable(source.client, source.repository, digest, partial, advance, size)
    except RegistryError as exc:
        if exc.status != 404:
            raise
        raise RegistryError(f"{source.client.address}/{source.repository} has no blob {digest} "
                            "(its manifest names it): the copy stopped there",
                            hint="run the same command again once the source serves it; what "
                            "was copied is kept", status=404) from None
    got = os.stat(partial).st_size
    if got != size:
        raise DigestMismatchError(f"blob {digest[:19]} is {got} bytes, its manifest says {size}")
    push_blob(dest.client, dest.repository, partial, digest)
    partial.unlink(missing_ok=True)
