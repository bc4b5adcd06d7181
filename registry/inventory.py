"""What a registry holds, and removing a tag by its manifest digest (with the artifacts that
name it as their subject: an image's published squashfs goes with the image)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
from imgpipe.registry.mediatypes import INDEX_TYPES, OCI_INDEX
from imgpipe.registry.referrers import is_referrers_tag, referrers, referrers_tag


@dataclass(frozen=True)
class TagInfo:
    tag: str
    digest: str | None


@dataclass(frozen=True)
class Removal:
    """A deleted manifest and every tag that pointed to it."""

    repository: str
    digest: str
    tags: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)  # referrers deleted with it
    skipped: list[str] = field(default_factory=list)  # listed, but not proven its artifacts


def tag_digests(client: RegistryClient, repository: str) -> list[TagInfo]:
    """Each tag of ``repository`` with the digest it points to."""
    return [TagInfo(tag, client.manifest_digest(repository, tag))
            for tag in sorted(client.tags(repository)) if not is_referrers_tag(tag)]


def remove_tag(client: RegistryClient, repository: str, tag: str, force: bool = False
               ) -> Removal:
    """Delete the manifest ``repository:tag`` points to.

    The registry API deletes manifests, not tags, so every other tag pointing to the
    same digest goes too: they are looked up first, and without ``force`` the deletion is
    refused, naming them.
    """
    digest = client.manifest_digest(repository, tag)
    if digest is None:
        raise RegistryError(f"{client.address}/{repository}:{tag} not found",
                            hint=f"list tags with `imgpipe registry tags {repository}`",
                            status=404)
    sharing = sorted({info.tag for info in tag_digests(client, repository)
                      if info.digest == digest} | {tag})
    others = [t for t in sharing if t != tag]
    if others and not force:
        raise SharedManifestError(
            f"{repository}:{tag} shares its manifest {digest[:19]} with "
            f"{', '.join(others)}: the registry deletes manifests, so those tags would go too",
            hint="pass --force to delete all of them")
    client.delete_manifest(repository, digest)
    artifacts = remove_referrers(client, repository, digest)
    return Removal(repository, digest, sharing, artifacts.artifacts, artifacts.skipped)


def names_subject(client: RegistryClient, repository: str, digest: str, subject: str) -> bool:
    """Whether the manifest ``digest`` is an artifact of ``subject``: read (bounded, digest
    checked) and its own ``subject`` compared.  What an index merely lists proves nothing:
    anyone who can push can list any manifest there."""
    try:
        body = json.loads(client.manifest_exactly(repository, digest).raw)
    except (RegistryError, ValueError):
        return False
    return (isinstance(body, dict) and body.get("mediaType") not in INDEX_TYPES
            and isinstance(body.get("subject"), dict)
            and body["subject"].get("digest") == subject)


def remove_referrers(client: RegistryClient, repository: str, subject: str) -> Removal:
    """Delete every artifact proven to name ``subject`` (its manifest read, its subject
    compared) and the referrers index when it is nothing else's; what is listed but not
    proven stays, named in ``skipped``."""
    removed: list[str] = []
    skipped: list[str] = []
    images = {info.digest for info in tag_digests(client, repository)}  # what tags keep
    candidates = [str(d["digest"]) for d in referrers(client, repository, subject)
                  if isinstance(d.get("digest"), str)]
    for tag in client.listed_tags(repository):  # artifact tags the index missed
        if tag.startswith(referrers_tag(subject) + "."):
            digest = client.manifest_digest(repository, tag)
            if digest is not None and digest not in candidates:
                candidates.append(digest)
    for digest in candidates:
        if digest in images or not names_subject(client, repository, digest, subject):
            skipped.append(digest)
            continue
        try:
            client.delete_manifest(repository, digest)
            removed.append(digest)
        except RegistryError as exc:
            if exc.status != 404:
                raise
    index = client.manifest_digest(repository, referrers_tag(subject))
    if index is not None:
        if index in images or not _only_lists_artifacts(client, repository, index):
            skipped.append(index)
        else:
            client.delete_manifest(repository, index)
    return Removal(repository, subject, [], removed, skipped)


def _only_lists_artifacts(client: RegistryClient, repository: str, digest: str) -> bool:
    """Whether the manifest ``digest`` is a referrers index (an OCI index of artifact
    descriptors only), not an image someone tagged under a ``sha256-`` name."""
    try:
        body = json.loads(client.manifest_exactly(repository, digest).raw)
    except (RegistryError, ValueError):
        return False
    manifests = body.get("manifests") if isinstance(body, dict) else None
    return (body.get("mediaType") == OCI_INDEX and isinstance(manifests, list)
            and all(isinstance(m, dict) and m.get("artifactType") for m in manifests))


def subjects_with_referrers(tags: list[str]) -> set[str]:
    """The subject digests a repository's tags show referrers of (the tag schema's index and
    imgpipe's artifact tags: ``sha256-<hex>[.suffix]``)."""
    return {"sha256:" + tag[7:71] for tag in tags if is_referrers_tag(tag)}


def remove_orphaned_artifacts(client: RegistryClient) -> list[Removal]:
    """Artifacts whose subject is gone (deleted by hand, or by another tool), each proven
    to name that subject: deleted, so the registry's collector can free them; those whose
    subject is kept stay, and so does whatever a forged index lists (in ``skipped``)."""
    removals = []
    for repository in client.catalog():
        for subject in sorted(subjects_with_referrers(client.listed_tags(repository))):
            if client.manifest_digest(repository, subject) is not None:
                continue
            removals.append(remove_referrers(client, repository, subject))
    return removals


class SharedManifestError(RegistryError):
    """``registry rm`` of a tag whose manifest other tags share, without --force (exit 2)."""

    exit_code = 2
    code = "shared-manifest"
