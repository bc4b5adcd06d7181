"""What a registry holds, and removing a tag by its manifest digest (with the artifacts that
name it as their subject: an image's published squashfs goes with the image)."""

from __future__ import annotations

from dataclasses import dataclass, field

from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError
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
    return Removal(repository, digest, sharing, remove_referrers(client, repository, digest))


def remove_referrers(client: RegistryClient, repository: str, subject: str) -> list[str]:
    """Delete every artifact naming ``subject`` and its referrers index; their digests."""
    removed = []
    for descriptor in referrers(client, repository, subject):
        try:
            client.delete_manifest(repository, descriptor["digest"])
            removed.append(str(descriptor["digest"]))
        except RegistryError as exc:
            if exc.status != 404:
                raise
    index = client.manifest_digest(repository, referrers_tag(subject))
    if index is not None:
        client.delete_manifest(repository, index)
    return removed


def subjects_with_referrers(tags: list[str]) -> set[str]:
    """The subject digests a repository's tags show referrers of (the tag schema's index and
    imgpipe's artifact tags: ``sha256-<hex>[.suffix]``)."""
    return {"sha256:" + tag[7:71] for tag in tags if is_referrers_tag(tag)}


def remove_orphaned_artifacts(client: RegistryClient) -> list[Removal]:
    """Artifacts whose subject is gone (deleted by hand, or by another tool): deleted, so
    the registry's collector can free them; those whose subject is kept stay."""
    removals = []
    for repository in client.catalog():
        for subject in sorted(subjects_with_referrers(client.listed_tags(repository))):
            if client.manifest_digest(repository, subject) is not None:
                continue
            gone = remove_referrers(client, repository, subject)
            for tag in client.listed_tags(repository):  # artifact tags the index missed
                if tag.startswith(referrers_tag(subject)):
                    digest = client.manifest_digest(repository, tag)
                    if digest is not None:
                        client.delete_manifest(repository, digest)
                        gone.append(digest)
            removals.append(Removal(repository, subject, [], gone))
    return removals


class SharedManifestError(RegistryError):
    """``registry rm`` of a tag whose manifest other tags share, without --force (exit 2)."""

    exit_code = 2
    code = "shared-manifest"
