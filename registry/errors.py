"""Errors of the registry subsystem (the whole tree is drawn in imgpipe.base.errors)."""

from __future__ import annotations

from imgpipe.base.errors import ImgpipeError


class RegistryError(ImgpipeError):
    """A registry request failed; keeps method, URL, HTTP status and the registry's code."""

    code = "registry"

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        method: str | None = None,
        url: str | None = None,
        status: int | None = None,
        registry_code: str | None = None,
    ) -> None:
        super().__init__(message, hint)
        self.method = method
        self.url = url
        self.status = status
        self.registry_code = registry_code


class AuthError(RegistryError):
    """Credentials were missing, refused, or the token endpoint failed."""

    code = "auth"


class DigestMismatchError(RegistryError):
    """Downloaded bytes do not hash to the digest that names them."""

    code = "digest-mismatch"


class ReferenceFormatError(RegistryError):
    """An image reference that cannot be parsed."""

    exit_code = 2
    code = "reference"


class LocalRegistryError(RegistryError):
    """Starting, stopping or collecting garbage in the head node's registry failed."""

    code = "local-registry"
