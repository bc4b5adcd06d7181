"""Pins of published squashfs files: which squashfs digests a job trusts for an image.

The recipes export ``IMGPIPE_SQUASHFS_PINS`` as blank-separated ``IMAGE=SQUASHFS`` digest
pairs; the importer's fast path reads them with the standard library alone.  A pin only
narrows what a job takes (a fetched squashfs is named by its own digest, so a pinned
lookup finds that file or none): it never makes a shared entry for other users.
"""

from __future__ import annotations

from collections.abc import Mapping

PINS_ENV = "IMGPIPE_SQUASHFS_PINS"

__all__ = ["PINS_ENV", "pins_in", "pins_text"]


def pins_in(text: str, image_digest: str) -> frozenset[str]:
    """The squashfs digests ``IMAGE=SQUASHFS`` pairs (blank-separated) pin for an image."""
    pins = set()
    for pair in text.split():
        image, _, squashfs = pair.partition("=")
        if (image == image_digest and squashfs.startswith("sha256:") and len(squashfs) == 71
                and all(c in "0123456789abcdef" for c in squashfs[7:])):
            pins.add(squashfs)
    return frozenset(pins)


def pins_text(pairs: Mapping[str, str]) -> str:
    """``{image digest: squashfs digest}`` as the value of IMGPIPE_SQUASHFS_PINS."""
    return " ".join(f"{image}={squashfs}" for image, squashfs in sorted(pairs.items()))
