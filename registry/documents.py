"""Registry documents (manifests, indexes, referrers answers, configs, tag lists, tokens,
error bodies) read streamed and capped.

Anyone who can push, and anything in front of the registry, chooses what such an answer
holds and how long it is.  ``requests`` reads a whole body into memory unless told to stream
(a 100 MB referrers index once cost 4.5 s and 486 MB per ``get``), so every document is
read from the stream, at most ``limit`` bytes, and one that is longer is refused with one
line: no document imgpipe reads is near the 4 MiB the distribution spec suggests for a
manifest.
"""

from __future__ import annotations

import requests
from urllib3.exceptions import HTTPError

from imgpipe.registry.errors import RegistryError

DOCUMENT_LIMIT = 4 << 20


def read_capped(response: requests.Response, limit: int = DOCUMENT_LIMIT,
                what: str | None = None) -> bytes:
    """The body of a streamed ``response``, at most ``limit`` bytes (RegistryError when
    longer); afterwards ``response.content`` and ``response.json()`` read those bytes."""
    if getattr(response, "_content_consumed", False) or response.raw is None:  # in memory
        raw = response.content
    else:
        try:
            raw = response.raw.read(limit + 1, decode_content=True) or b""
        except (HTTPError, OSError, requests.RequestException) as exc:
            raise RegistryError(f"{what or response.url}: the answer broke off "
                                f"({type(exc).__name__})", url=response.url) from exc
        finally:
            response.close()
        response._content = raw  # what .content and .json() read from now on
        setattr(response, "_content_consumed", True)  # noqa: B010 (no typed attribute)
    if len(raw) > limit:
        raise RegistryError(f"{what or response.url}: the answer is over {limit} bytes, "
                            "more than any registry document needs: skipped",
                            url=response.url, status=response.status_code)
    return raw
