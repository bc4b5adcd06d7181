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
    return Removal(repository, digest, sharing)


class SharedManifestError(RegistryError):
    """``registry rm`` of a tag whose manifest other tags share, without --force (exit 2)."""

    exit_code = 2
    code = "shared-manifest"
