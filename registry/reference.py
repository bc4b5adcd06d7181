"""Image references as a value type.

Accepted forms (``host`` must hold ``.`` or ``:`` or be ``localhost``)::

    host:port/repo/path:tag          docker form
    host:port/repo@sha256:<64 hex>   pinned by digest (a tag may precede it)
    host:port#repo:tag               Enroot's form (docker:// prefix allowed)
    repo:tag                         on the default registry given by the caller
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from imgpipe.registry.errors import ReferenceFormatError

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPO_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST_RE = re.compile(r"^sha256:[a-f0-9]{64}$")
HOST_RE = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9-]+)*(?::[0-9]{1,5})?$"
)

FORMS = "host:port/repo:tag, host:port/repo@sha256:<digest>, host:port#repo:tag or repo:tag"


@dataclass(frozen=True, order=True)
class Reference:
    """One image: registry address, repository, and a tag and/or digest."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str, default_registry: str | None = None) -> Reference:
        """Parse ``text``; raises ReferenceFormatError naming the column and accepted forms."""
        original = text
        if text.startswith("docker://"):
            text = text[len("docker://") :]
        if any(c.isspace() or ord(c) < 32 for c in text) or not text:
            raise _bad(original, "contains white space or control characters", 0)
        registry: str | None
        if "#" in text:
            registry, _, rest = text.partition("#")
            if "@" in registry:  # enroot's USER@REGISTRY# form: the user is not part of the image
                registry = registry.rsplit("@", 1)[1]
        else:
            first, sep, remainder = text.partition("/")
            if sep and ("." in first or ":" in first or first == "localhost"):
                registry, rest = first, remainder
            else:
                registry, rest = None, text
        if registry is None:
            if default_registry is None:
                raise _bad(original, "no registry host (write host:port/repo:tag)", 0)
            registry = default_registry
        elif not HOST_RE.match(registry):
            raise _bad(original, f"bad registry address {registry!r}", original.find(registry))
        digest = None
        if "@" in rest:
            rest, _, digest = rest.partition("@")
            if not DIGEST_RE.match(digest):
                raise _bad(original, "digest must be sha256: and 64 lower-case hex digits",
                           original.find("@") + 1)
        tag = None
        slash = rest.rfind("/")
        colon = rest.rfind(":")
        if colon > slash:
            rest, tag = rest[:colon], rest[colon + 1 :]
            if not TAG_RE.match(tag):
                raise _bad(original, f"bad tag {tag!r}", original.rfind(":") + 1)
        if not REPO_RE.match(rest):
            raise _bad(original, f"bad repository name {rest!r} (lower-case letters, digits, "
                       "and . _ - between them, / between parts)", max(original.find(rest), 0))
        if tag is None and digest is None:
            tag = "latest"
        return cls(registry, rest, tag, digest)

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def canonical(self) -> str:
        """``host:port/repo@digest`` when pinned, else ``host:port/repo:tag``."""
        if self.digest:
            return f"{self.registry}/{self.repository}@{self.digest}"
        return f"{self.registry}/{self.repository}:{self.tag}"

    @property
    def enroot(self) -> str:
        """Enroot's ``host:port#repo:tag`` (or ``@digest``) form."""
        return f"{self.registry}#{self._name_part()}"

    @property
    def filename(self) -> str:
        """Enroot's default output name stem: ``/`` and ``:`` turned into ``+``."""
        last = self.digest.replace(":", "-") if self.digest else self.tag
        return f"{self.repository.replace('/', '+')}+{last}"

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, self.tag, digest)

    def _name_part(self) -> str:
        text = self.repository
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    def __str__(self) -> str:
        return f"{self.registry}/{self._name_part()}"


def _bad(text: str, why: str, column: int) -> ReferenceFormatError:
    return ReferenceFormatError(
        f"invalid image reference {text!r} at column {column + 1}: {why}",
        hint=f"accepted forms: {FORMS}",
    )


DOCKER_HUB_NAMES = ("docker.io", "index.docker.io", "registry-1.docker.io")


def through_mirror(ref: Reference, mirrors: dict[str, str], site: str) -> Reference | None:
    """``ref`` as the site registry ``site`` holds it where ``ref``'s registry is mirrored
    there (``registry.mirrors``: address -> repository prefix, "" for the same names), else
    None.  Docker Hub answers to any of its names."""
    registry = "docker.io" if ref.registry in DOCKER_HUB_NAMES else ref.registry
    prefix = mirrors.get(registry, mirrors.get(ref.registry))
    if prefix is None or ref.registry == site:
        return None
    repository = f"{prefix}/{ref.repository}" if prefix else ref.repository
    return Reference(site, repository, ref.tag, ref.digest)
