"""imgpipe.registry: the Registry HTTP API v2 client and the head node's registry.

Depends only on imgpipe.pipeline's shared pieces (errors, files, processes).
"""

from imgpipe.registry.auth import Credentials
from imgpipe.registry.client import Manifest, Platform, RegistryClient
from imgpipe.registry.errors import (
    AuthError,
    DigestMismatchError,
    LocalRegistryError,
    ReferenceFormatError,
    RegistryError,
)
from imgpipe.registry.inventory import Removal, TagInfo, remove_tag, tag_digests
from imgpipe.registry.local import LocalRegistry, ServerState
from imgpipe.registry.reference import Reference

__all__ = [
    "AuthError",
    "Credentials",
    "DigestMismatchError",
    "LocalRegistry",
    "LocalRegistryError",
    "Manifest",
    "Platform",
    "Reference",
    "ReferenceFormatError",
    "RegistryClient",
    "RegistryError",
    "Removal",
    "ServerState",
    "TagInfo",
    "remove_tag",
    "tag_digests",
]
