"""`imgpipe registry status|ls|tags|rm|gc`: what the head node's registry holds, and
removing from it only what was proven to belong to what is removed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from imgpipe.base.config import Settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.commands.shared.wiring import local_registry, registry_client
from imgpipe.enroot.published.artifact import find_published
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.inventory import (
    Removal,
    TagInfo,
    remove_orphaned_artifacts,
    remove_tag,
    subjects_with_referrers,
    tag_digests,
)
from imgpipe.registry.local import dir_bytes
from imgpipe.registry.reference import Reference
from imgpipe.registry.referrers import is_referrers_tag

__all__ = ["Collected", "Status", "collect_garbage", "list_registry", "list_tags",
           "registry_status", "remove_image"]


@dataclass
class Status:
    url: str
    mode: str
    data_dir: Any  # Path, or None for a registry imgpipe did not start
    storage_bytes: int | None
    reachable: bool = False
    repositories: int | None = None
    tags: int | None = None
    error: str | None = None


def registry_status(settings: Settings) -> Status:
    """Mode, storage used, and whether it answers (what it holds, when it does)."""
    local = local_registry(settings)
    state = local.state()
    mine = state.mode != "external"
    status = Status(settings.registry.url, state.mode, local.data_dir if mine else None,
                    dir_bytes(local.data_dir) if mine else None)
    try:
        client = registry_client(settings)
        client.ping()
        repositories = client.catalog()
        status.tags = sum(len(client.listed_tags(repo)) for repo in repositories)
    except ImgpipeError as exc:
        status.error = exc.message
        return status
    status.reachable, status.repositories = True, len(repositories)
    return status


def _squashfs_of(client: RegistryClient, repository: str, tags: list[str]
                 ) -> dict[str, list[str]]:
    """tag -> the compressions of the squashfs published beside the manifest it names."""
    subjects = subjects_with_referrers(tags)
    if not subjects:
        return {}
    found: dict[str, list[str]] = {}
    for tag in tags:
        if is_referrers_tag(tag):
            continue
        digest = client.manifest_digest(repository, tag)
        if digest in subjects:
            kinds = sorted({p.compression for p in find_published(client, repository, digest)})
            if kinds:
                found[tag] = kinds
    return found


def list_registry(settings: Settings) -> tuple[str, list[dict[str, Any]]]:
    """The registry's address and every repository: its tags and which have a squashfs
    published beside them."""
    client = registry_client(settings)
    repositories: list[dict[str, Any]] = []
    for repo in client.catalog():
        listed = client.listed_tags(repo)
        repositories.append({"name": repo, "squashfs": _squashfs_of(client, repo, listed),
                             "tags": sorted(t for t in listed if not is_referrers_tag(t))})
    return client.address, repositories


def list_tags(settings: Settings, repository: str) -> tuple[str, list[TagInfo]]:
    ref = Reference.parse(repository, default_registry=settings.registry.address)
    return ref.repository, tag_digests(registry_client(settings), ref.repository)


def remove_image(settings: Settings, image: str, force: bool) -> tuple[Reference, Removal]:
    """Delete the manifest REPO:TAG names (with the artifacts proven to be its own)."""
    ref = Reference.parse(image, default_registry=settings.registry.address)
    if ref.digest:
        raise ImgpipeError("rm takes REPO:TAG", hint="name the tag, not a digest")
    return ref, remove_tag(registry_client(settings), ref.repository, ref.tag or "latest",
                           force)


@dataclass
class Collected:
    before: int
    after: int
    orphans: list[Removal] = field(default_factory=list)


def collect_garbage(settings: Settings, delete_untagged: bool) -> Collected:
    """Artifacts whose image is gone deleted first (proven, one by one), then the
    registry's collector over its data folder, the registry stopped meanwhile."""
    local = local_registry(settings)
    orphans = []
    if local.state().mode in ("container", "binary"):
        orphans = remove_orphaned_artifacts(registry_client(settings))
    before, after = local.garbage_collect(delete_untagged)
    return Collected(before, after, orphans)
