"""Which requests go to the blob cache (``registry.blob_cache``), and what is said when it fails.

Only ``GET /v2/<name>/blobs/sha256:<hex>`` is routed there; manifests, tags, uploads
and tokens always go to the registry itself, and so does ``HEAD`` of a blob: whether a blob
exists is the registry's to say (a cache still holds blobs the registry has deleted, and a
push that believed it would skip an upload the registry needs).  Callers check every blob's bytes
against its digest, so the cache can make a fetch faster but never change what a job
runs.  A cache that does not answer (refused, silent, 5xx, an answer that is not the
registry's) or that served wrong bytes is said once per process, in one line on stderr,
and bypassed for the rest of the process: the job still starts, from the registry.
"""

from __future__ import annotations

import re
import sys

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

__all__ = ["BLOB_PATH", "BlobCacheRoute"]

BLOB_PATH = re.compile(r"/v2/[^?#]+/blobs/sha256:[0-9a-f]{64}")
# Caches found failing in this process, by URL: said once, then no longer asked.  Per
# process on purpose: every client a command makes would otherwise try a dead cache again.
_REFUSED: set[str] = set()


class BlobCacheRoute:
    """The blob cache at ``url``: its own session, no retries (the registry is the retry)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.session = requests.Session()
        self.session.trust_env = False  # as the registry's: no proxy from the environment
        adapter = HTTPAdapter(max_retries=Retry(total=0, raise_on_status=False),
                              pool_maxsize=16)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def takes(self, method: str, path: str) -> bool:
        """Whether this request goes to the cache (a blob by digest, cache not refused)."""
        return (self.url not in _REFUSED and method == "GET"
                and BLOB_PATH.fullmatch(path) is not None)

    def served(self, response: requests.Response) -> bool:
        """Whether ``response`` (or a redirect before it) came from the cache."""
        return any(r.url.startswith(self.url + "/") for r in (*response.history, response))

    def blame(self, response: requests.Response, what: str) -> bool:
        """When ``response`` came from the cache: refuse it (``what`` it did) and True,
        so that the caller asks the registry itself."""
        if not self.served(response):
            return False
        self.refuse(what)
        return True

    def refuse(self, what: str) -> None:
        """Bypass the cache for the rest of the process; say so once."""
        if self.url not in _REFUSED:
            _REFUSED.add(self.url)
            print(f"imgpipe: the blob cache at {self.url} {what}: fetching from the registry",
                  file=sys.stderr)

    @staticmethod
    def reason(exc: requests.RequestException) -> str:
        """A few words for why a request to the cache failed."""
        if isinstance(exc, requests.exceptions.ConnectTimeout | requests.exceptions.ReadTimeout):
            return "no answer in time"
        if isinstance(exc, requests.exceptions.SSLError):
            return "TLS verification failed"
        if isinstance(exc, requests.exceptions.ConnectionError):
            return "cannot connect"
        return type(exc).__name__
