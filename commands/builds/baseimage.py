"""`imgpipe base-image`: a Debian + Python base made by debootstrap, for a platform."""

from __future__ import annotations

from imgpipe.base.platforms import Platform
from imgpipe.pipeline.baseimage import DEFAULT_TAG, ensure_base_image

__all__ = ["make_base_image"]


def make_base_image(tag: str | None, platform: Platform | None, suite: str, mirror: str,
                    rebuild: bool) -> tuple[str, bool]:
    """(tag, created): the default tag carries the platform (``-arm64``) when it is not the
    host's, since an engine keeps one platform per tag."""
    default = DEFAULT_TAG if platform is None else f"{DEFAULT_TAG}-{platform.tag_suffix}"
    return ensure_base_image(tag or default, suite, mirror, rebuild=rebuild, platform=platform)
