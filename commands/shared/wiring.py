"""Building subsystem objects from Settings: the one place they are wired together."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.trust import CacheTrust
from imgpipe.enroot.squash.tools import SquashOptions, compression_of
from imgpipe.registry.auth import (
    Credentials,
    credentials_from_docker_config,
    credentials_from_netrc,
)
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.local import LocalRegistry


def registry_credentials(settings: Settings) -> Credentials | None:
    source = settings.registry.credentials
    path = settings.path(source.file) if source.file else None
    if source.source == "docker-config":
        return credentials_from_docker_config(settings.registry.address, path)
    if source.source == "netrc":
        return credentials_from_netrc(settings.registry.address, path)
    return None


def registry_client(settings: Settings, retries: int = 3) -> RegistryClient:
    """The configured registry with its credentials and CA; ``retries=0`` for a question
    whose answer is only nice to have (no backoff when the registry is down)."""
    registry = settings.registry
    ca_file = settings.path(registry.ca_file) if registry.ca_file else None
    return RegistryClient(registry.url, credentials=registry_credentials(settings), ca_file=ca_file,
                          timeout=(registry.connect_timeout_s, registry.read_timeout_s),
                          retries=retries, allow_http=registry.credentials.allow_http,
                          blob_cache=registry.blob_cache)


def storage(settings: Settings, root: Path | None = None) -> Storage:
    """The squashfs folder ``root`` (default: outputs.squashfs_dir) with the site's trust."""
    trust = CacheTrust.of(settings.enroot.cache_owner)
    folder = root or settings.path(settings.outputs.squashfs_dir)
    # Root and the service account take the path as written (a link on it is refused, never
    # followed: enroot.cache.rootpath); a job user acts with its own rights only.
    folder = Path(os.path.abspath(folder)) if trust.is_admin else folder.resolve()
    return Storage(folder, trust, settings.enroot.lock_timeout_s)


def squash_options(settings: Settings, image_choice: str | None = None,
                   override: str | None = None) -> SquashOptions:
    """Compression: the command line's, else the image's, else the site's."""
    enroot = settings.enroot
    compression = override or image_choice or enroot.default_compression
    return SquashOptions(compression_of(compression), enroot.zstd_level, enroot.processors,
                         enroot.verify_diff_ids)


def local_registry(settings: Settings) -> LocalRegistry:
    return LocalRegistry(settings)


def registry_for(settings: Settings) -> Callable[[str], RegistryClient]:
    """A client per registry address: the configured registry with its credentials and CA,
    any other (a base image's) anonymous over https with short timeouts."""
    def make(address: str) -> RegistryClient:
        if address == settings.registry.address:
            return registry_client(settings)
        return RegistryClient(f"https://{address}", retries=0, timeout=(3.0, 10.0))
    return make
