"""Pins of published squashfs files: which squashfs digests a job trusts for each image.

One type, ``Pins``: image manifest digest -> the squashfs digests pinned for it.  The recipes
export it as ``IMGPIPE_SQUASHFS_PINS`` (blank-separated ``IMAGE=SQUASHFS`` digest pairs, one
per platform's manifest), imgpipe.lock holds each manifest's, and the importer's fast path
reads it with the standard library alone.  A pin only narrows what a job takes (a fetched
squashfs is named by its own digest, so a pinned lookup finds that file or none): it never
makes a shared entry for other users.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

PINS_ENV = "IMGPIPE_SQUASHFS_PINS"

__all__ = ["PINS_ENV", "Pins"]


def _digest(text: str) -> bool:
    return (text.startswith("sha256:") and len(text) == 71
            and all(c in "0123456789abcdef" for c in text[7:]))


class Pins:
    """Image manifest digest -> the squashfs digests pinned for it (malformed pairs are
    dropped: a pin that is not two sha256 digests pins nothing)."""

    __slots__ = ("_by_image",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        by_image: dict[str, set[str]] = {}
        for image, squashfs in pairs:
            if _digest(image) and _digest(squashfs):
                by_image.setdefault(image, set()).add(squashfs)
        self._by_image = {image: frozenset(found) for image, found in by_image.items()}

    @classmethod
    def parse(cls, text: str) -> Pins:
        """``IMAGE=SQUASHFS`` pairs, blank-separated (``IMGPIPE_SQUASHFS_PINS``'s value)."""
        halves = (pair.partition("=") for pair in text.split())
        return cls((image, squashfs) for image, _, squashfs in halves)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Pins:
        return cls.parse(environ.get(PINS_ENV, ""))

    @classmethod
    def of(cls, pairs: Mapping[str, str]) -> Pins:
        """``{image digest: squashfs digest}``."""
        return cls(pairs.items())

    def for_image(self, image_digest: str) -> frozenset[str]:
        """The squashfs digests pinned for one image manifest."""
        return self._by_image.get(image_digest, frozenset())

    def text(self) -> str:
        """The value of IMGPIPE_SQUASHFS_PINS (sorted: the same pins render the same)."""
        return " ".join(f"{image}={squashfs}" for image in sorted(self._by_image)
                        for squashfs in sorted(self._by_image[image]))

    def __bool__(self) -> bool:
        return bool(self._by_image)
