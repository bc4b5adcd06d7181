"""imgpipe.registry: the Registry HTTP API v2 client and the head node's registry.

Depends only on imgpipe.pipeline's shared pieces (errors, files, processes).

Names are resolved on first use (PEP 562), so importing one module of the package
(``imgpipe.registry.reference``) does not load the HTTP client or the configuration.
"""

from __future__ import annotations

from imgpipe.base.lazy import lazy_exports

_HOME = {
    "AuthError": "imgpipe.registry.errors",
    "Credentials": "imgpipe.registry.auth",
    "DigestMismatchError": "imgpipe.registry.errors",
    "LocalRegistry": "imgpipe.registry.local",
    "LocalRegistryError": "imgpipe.registry.errors",
    "Manifest": "imgpipe.registry.manifests",
    "Platform": "imgpipe.base.platforms",
    "Reference": "imgpipe.registry.reference",
    "ReferenceFormatError": "imgpipe.registry.errors",
    "RegistryClient": "imgpipe.registry.client",
    "RegistryError": "imgpipe.registry.errors",
    "Removal": "imgpipe.registry.inventory",
    "ServerState": "imgpipe.registry.local",
    "TagInfo": "imgpipe.registry.inventory",
    "remove_tag": "imgpipe.registry.inventory",
    "tag_digests": "imgpipe.registry.inventory",
}

__all__ = sorted(_HOME)


__getattr__ = lazy_exports("imgpipe.registry", _HOME)
