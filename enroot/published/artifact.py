"""A squashfs published beside its image: an OCI artifact whose ``subject`` is the image.

Conversion is deterministic (same manifest digest, same compression and FORMAT: the same
bytes), so a squashfs made once (in CI, by ``imgpipe push --squashfs``) can be fetched by
every cluster and node as one verified blob.  The artifact is an OCI image manifest of
``artifactType`` ARTIFACT_TYPE with the empty config, one layer (the squashfs file) and
annotations saying what it is; it is listed in the image's referrers (registry.referrers).

What a fetch may trust is decided by the caller (enroot.published.policy): this module finds,
publishes, fetches and checks.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from imgpipe.base.terminal import shown
from imgpipe.enroot.cache.storage import FORMAT, Storage
from imgpipe.enroot.errors import NoSpaceError
from imgpipe.enroot.published.contents import publish_partial
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.manifests import Manifest
from imgpipe.registry.mediatypes import OCI_MANIFEST
from imgpipe.registry.ranges import (
    DEFAULT_CHUNK_SIZE,
    ChunkHasher,
    Verified,
    chunk_digests,
    chunks_problem,
    fetch_ranges,
    own_chunk_size,
)
from imgpipe.registry.referrers import attach, referrers, referrers_tag
from imgpipe.registry.transfer import push_blob, push_bytes, put_manifest

ARTIFACT_TYPE = "application/vnd.imgpipe.squashfs.v1"
SQUASHFS_MEDIA_TYPE = "application/vnd.imgpipe.squashfs.v1.squashfs"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_JSON = b"{}"
COMPRESSION = "org.imgpipe.squashfs.compression"
FORMAT_KEY = "org.imgpipe.squashfs.format"
SIZE = "org.imgpipe.squashfs.size"
ENTRIES = "org.imgpipe.squashfs.entries"
CHUNK_SIZE = "org.imgpipe.squashfs.chunk-size"
CHUNKS = "org.imgpipe.squashfs.chunks"  # the sha256 of each chunk (hex), joined by commas
VERSION = "org.imgpipe.version"
CREATED = "org.opencontainers.image.created"
TITLE = "org.opencontainers.image.title"

MAX_REFERRERS = 64  # artifacts read per subject: bounded work whatever a pusher lists
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class PublishedSquashfs:
    """One squashfs artifact of an image manifest."""

    repository: str
    subject: str  # the image manifest's digest
    artifact: str  # the artifact manifest's digest
    blob: str  # the squashfs file's digest: what pins name
    size: int
    compression: str
    format: str
    entries: int = 0
    version: str = ""
    chunk_size: int = 0  # 0: published without chunk digests
    chunks: tuple[str, ...] = ()  # the sha256 (hex) of each chunk_size piece of the blob

    @property
    def tag(self) -> str:
        """The artifact's own tag (so --delete-untagged keeps it while its subject stays)."""
        return f"{referrers_tag(self.subject)}.{self.compression}.sqsh"


def imgpipe_version() -> str:
    try:
        return metadata.version("imgpipe")
    except metadata.PackageNotFoundError:
        return "unknown"


def _from_manifest(repository: str, subject: str, manifest: Manifest
                   ) -> tuple[PublishedSquashfs | None, str]:
    """The artifact a manifest describes (None: not a squashfs artifact of ``subject``) and
    why its chunk digests were ignored, if they were."""
    try:
        body = manifest.body
    except (ValueError, RegistryError):
        return None, ""
    if not isinstance(body, dict) or not isinstance(body.get("layers") or [], list) \
            or not isinstance(body.get("subject") or {}, dict) \
            or not isinstance(body.get("annotations") or {}, dict):
        return None, ""
    layers = body.get("layers") or []
    notes = body.get("annotations") or {}
    if (body.get("artifactType") != ARTIFACT_TYPE or len(layers) != 1
            or (body.get("subject") or {}).get("digest") != subject
            or not isinstance(layers[0], dict)
            or layers[0].get("mediaType") != SQUASHFS_MEDIA_TYPE):
        return None, ""
    try:
        published = PublishedSquashfs(
            repository, subject, manifest.digest, str(layers[0]["digest"]),
            int(layers[0]["size"]), str(notes.get(COMPRESSION, "")),
            str(notes.get(FORMAT_KEY, "")), int(notes.get(ENTRIES, 0)),
            str(notes.get(VERSION, "")))
    except (KeyError, TypeError, ValueError):
        return None, ""
    chunk_size, chunks, problem = _chunks(notes, published.size)
    return replace(published, chunk_size=chunk_size, chunks=chunks), problem


def _chunks(notes: dict[str, object], size: int) -> tuple[int, tuple[str, ...], str]:
    """The chunk size and digests the annotations publish, checked (anyone who can push
    writes them); (0, (), why) when they are unusable, (0, (), "") when there are none."""
    if CHUNK_SIZE not in notes and CHUNKS not in notes:
        return 0, (), ""
    raw_size, raw_chunks = notes.get(CHUNK_SIZE), notes.get(CHUNKS)
    if not isinstance(raw_size, str) or not raw_size.isdigit() or len(raw_size) > 12 \
            or not isinstance(raw_chunks, str):
        return 0, (), "its chunk annotations are not a size and a list"
    chunks = tuple(raw_chunks.split(",")) if raw_chunks else ()
    problem = chunks_problem(size, int(raw_size), chunks)
    return (0, (), problem) if problem else (int(raw_size), chunks, "")


def find_published(client: RegistryClient, repository: str, subject: str,
                   compression: str | None = None,
                   say: Callable[[str], None] | None = None) -> list[PublishedSquashfs]:
    """The squashfs artifacts of ``subject`` (of this FORMAT, and ``compression`` if given),
    newest listed last.  Anyone who can push can list anything under a subject: at most
    MAX_REFERRERS descriptors are read, each manifest bounded and digest-checked, and one
    that is not a squashfs artifact of this subject is skipped with one line to ``say``,
    never failing the caller."""
    found: list[PublishedSquashfs] = []
    try:
        listed = referrers(client, repository, subject, ARTIFACT_TYPE)
    except RegistryError as exc:
        _skipped(say, f"the referrers of {repository}@{subject[:19]}: {exc.message}")
        return found
    if len(listed) > MAX_REFERRERS:
        _skipped(say, f"{len(listed) - MAX_REFERRERS} referrer(s) of {repository}@"
                 f"{subject[:19]} past the first {MAX_REFERRERS}")
    for descriptor in listed[:MAX_REFERRERS]:
        digest = descriptor.get("digest")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            _skipped(say, f"a referrer of {repository}@{subject[:19]} without a valid digest")
            continue
        try:
            manifest = client.manifest_exactly(repository, digest)
        except RegistryError as exc:
            if exc.status != 404:  # 404: listed, but deleted since
                _skipped(say, f"referrer {digest[:19]} of {repository}: {exc.message}")
            continue
        published, problem = _from_manifest(repository, subject, manifest)
        if published is None:
            _skipped(say, f"referrer {digest[:19]} of {repository}: not a squashfs "
                     f"artifact of {subject[:19]}")
            continue
        if published.format != FORMAT:
            continue
        if compression is None or published.compression == compression:
            if problem and say is not None:
                say(f"ignored the chunk digests of referrer {digest[:19]} of {repository}: "
                    f"{shown(problem, 200)}; its download is verified by the whole digest")
            found.append(published)
    return found


def _skipped(say: Callable[[str], None] | None, what: str) -> None:
    if say is not None:
        say(f"skipped {shown(what, 400)}")


def publish(client: RegistryClient, repository: str, subject: Manifest, squashfs: Path,
            blob: str, compression: str, entries: int,
            progress: Callable[[int], None] | None = None,
            chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[PublishedSquashfs, bool]:
    """Push ``squashfs`` (whose digest is ``blob``) as an artifact of ``subject``, with the
    sha256 of each ``chunk_size`` piece (what a ranged fetch checks each range against);
    returns it and whether anything was pushed (False: the same file was published
    already).  A file of over MAX_CHUNKS chunks gets larger chunks (registry.ranges)."""
    for existing in find_published(client, repository, subject.digest, compression):
        if existing.blob == blob:
            return existing, False
    size = squashfs.stat().st_size
    chunk_size = own_chunk_size(size, chunk_size)
    hasher = ChunkHasher(chunk_size)  # fed by the upload's own reads
    if push_blob(client, repository, squashfs, blob, progress, hasher.update):
        chunks = hasher.digests()
    else:  # the registry had the blob: nothing was read yet
        chunks = chunk_digests(squashfs, chunk_size)
    empty = push_bytes(client, repository, EMPTY_JSON)
    annotations = {COMPRESSION: compression, FORMAT_KEY: FORMAT, SIZE: str(size),
                   ENTRIES: str(entries), VERSION: imgpipe_version(),
                   CREATED: dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()}
    body = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": empty, "size": len(EMPTY_JSON),
                   "data": "e30="},
        "layers": [{"mediaType": SQUASHFS_MEDIA_TYPE, "digest": blob, "size": size,
                    "annotations": {TITLE: squashfs.name}}],
        "subject": {"mediaType": subject.media_type, "digest": subject.digest,
                    "size": len(subject.raw)},
        # the chunk list stays out of the referrers index, where every artifact is listed
        "annotations": {**annotations, CHUNK_SIZE: str(chunk_size), CHUNKS: ",".join(chunks)},
    }
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    published = PublishedSquashfs(repository, subject.digest, "", blob, size, compression,
                                  FORMAT, entries, annotations[VERSION], chunk_size,
                                  tuple(chunks))
    digest = put_manifest(client, repository, published.tag, raw, OCI_MANIFEST)
    attach(client, repository, subject.digest,
           {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(raw),
            "artifactType": ARTIFACT_TYPE, "annotations": annotations})
    return replace(published, artifact=digest), True


def partial_path(storage: Storage, blob: str) -> Path:
    """Where this user's download of ``blob`` collects: in the user's private folder (no
    other user can name or plant it there), kept for a resume, swept after a day."""
    return storage.partial_download(blob)


def fetch(client: RegistryClient, storage: Storage, published: PublishedSquashfs, final: Path,
          allowed_setuid: set[str] | None,
          progress: Callable[[int], None] | None = None, connections: int = 4,
          say: Callable[[str], None] = lambda _: None,
          verified: Verified | None = None) -> tuple[int, int]:
    """Fetch the artifact's squashfs into the cache under ``final`` (call with the digest's
    lock held): as ``connections`` ranges at once, each checked against the published chunk
    digests (registry.ranges), resumed from this user's partial download, digest verified,
    contents checked, published atomically.  Returns (bytes received, entries)."""
    partial = partial_path(storage, published.blob)
    free = shutil.disk_usage(storage.root).free
    if free < published.size:
        raise NoSpaceError(storage.root, published.size, free)
    # fetch_ranges bounds the list, in one line (a pinned blob's size is the registry's
    # own: the list may not fit it)
    chunk_size, chunks = published.chunk_size, published.chunks
    if not chunks and connections > 1 and published.size > DEFAULT_CHUNK_SIZE:
        say(f"published squashfs {published.blob[:19]} has no usable chunk digests: "
            "its ranges are checked by the whole digest alone, so a bad range means the whole "
            "download is redone")
    try:
        received = fetch_ranges(client, published.repository, published.blob, partial,
                                published.size, chunk_size, chunks, connections, progress, say,
                                verified)
    except DigestMismatchError:
        route = client.blob_cache
        if route is None or not route.takes("GET", f"/v2/{published.repository}/blobs/"
                                                   f"{published.blob}"):
            raise
        # the blob cache served bytes that are not the blob: the registry itself, once
        route.refuse(f"served bytes of {published.blob[:19]} that do not hash to it")
        received = fetch_ranges(client, published.repository, published.blob, partial,
                                published.size, chunk_size, chunks, connections, progress, say,
                                verified)
    return received, publish_partial(partial, final, allowed_setuid)
