"""What a registry holds, and removing a tag by its manifest digest."""

from __future__ import annotations

from dataclasses import dataclass, field

from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import RegistryError


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


def tag_digests(client: RegistryClient, repository: str) -> list[TagInfo]:
    """Each tag of ``repository`` with the digest it points to."""
    return [TagInfo(tag, client.manifest_digest(repository, tag))
            for tag in sorted(client.tags(repository))]


def remove_tag(client: RegistryClient, repository: str, tag: str) -> Removal:
    """Delete the manifest ``repository:tag`` points to.

    The registry API deletes manifests, not tags, so every other tag pointing
    to the same digest goes too; they are looked up first and reported.
    """
    digest = client.manifest_digest(repository, tag)
    if digest is None:
        raise RegistryError(f"{client.address}/{repository}:{tag} not found",
                            hint=f"list tags with `imgpipe registry tags {repository}`",
                            status=404)
    sharing = [info.tag for info in tag_digests(client, repository) if info.digest == digest]
    client.delete_manifest(repository, digest)
    return Removal(repository, digest, sorted(set(sharing) | {tag}))
