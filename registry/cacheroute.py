"""Which requests go to the blob cache (``registry.blob_cache``), and what is said when it fails.

Only ``GET /v2/<name>/blobs/sha256:<hex>`` is routed there; manifests, tags, uploads
and tokens always go to the registry itself, and so does ``HEAD`` of a blob: whether a blob
exists is the registry's to say (a cache still holds blobs the registry has deleted, and a
push that believed it would skip an upload the registry needs).  Callers check every blob's bytes
against its digest, so the cache can make a fetch faster but never change what a job
runs.  A cache that does not answer (refused, silent, 5xx, an answer that is not the
registry's) or that served wrong bytes is said once per process, in one line on stderr,
and bypassed for the rest of the process: the job still starts, from the registry.

``BlobCacheRoute.ask`` is the cache's side of a request: its own session, the registry's
login sent to it only over https or with ``registry.credentials.allow_http``, the registry's
own errors passed through it told apart from the cache's failures.  The HTTP client
(``registry.client``) asks it first and the registry when it answers None.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from imgpipe.registry.auth import Authenticator
from imgpipe.registry.documents import read_capped
from imgpipe.registry.mediatypes import REGISTRY_HEADER

__all__ = ["BLOB_PATH", "BlobCacheRoute", "CacheAnswer"]

BLOB_PATH = re.compile(r"/v2/[^?#]+/blobs/sha256:[0-9a-f]{64}")
# Caches found failing in this process, by URL: said once, then no longer asked.  Per
# process on purpose: every client a command makes would otherwise try a dead cache again.
_REFUSED: set[str] = set()


@dataclass(frozen=True)
class CacheAnswer:
    """What the blob cache made of one request."""

    response: requests.Response | None  # None: it failed (said once), ask the registry
    authorization: str | None  # the Authorization header, as a challenge on the way left it
    registry_error: bool = False  # the response is the registry's own error: raise it as one


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

    def ask(self, method: str, path: str, *, accepted: set[int],
            headers: Mapping[str, str] | None, params: dict[str, Any] | None, stream: bool,
            limit: int, timeout: tuple[float, float], verify: bool | str,
            auth: Authenticator, registry: str, authorization: str | None) -> CacheAnswer:
        """The cache's answer to a request ``takes`` routed here: the response when its
        status is ``accepted``, the registry's own error passed through it (to be raised as
        the registry's), or no response when the cache failed (said once; the caller asks
        the registry).  A refused login is the registry's to report, not the cache's."""
        url = self.url + path
        may_send = self.url.startswith("https://") or auth.allow_http
        sent_headers = dict(headers or {})
        for attempt in range(3):
            if authorization and may_send:
                sent_headers["Authorization"] = authorization
            try:
                response = self.session.request(
                    method, url, headers=sent_headers, params=params, stream=True,
                    timeout=timeout, verify=verify, allow_redirects=True)
            except requests.RequestException as exc:
                self.refuse(f"does not answer ({self.reason(exc)})")
                return CacheAnswer(None, authorization)
            if response.status_code != 401 or 401 in accepted or not may_send or attempt == 2:
                break
            response.close()
            authorization = auth.answer(response, registry)
        status = response.status_code
        if status in accepted and status < 500:
            if not stream:
                read_capped(response, limit, f"{method} {url}")
            return CacheAnswer(response, authorization)
        if status < 500 and status != 401 and REGISTRY_HEADER in response.headers:
            read_capped(response, limit, f"{method} {url}")  # the registry's own answer
            return CacheAnswer(response, authorization, registry_error=True)
        response.close()
        if status == 401 and may_send:
            return CacheAnswer(None, authorization)  # the registry itself says so, in its words
        if status == 401:
            self.refuse("asks for a login, which goes to it only over https or with "
                        "registry.credentials.allow_http")
        else:
            self.refuse(f"does not answer as the registry (HTTP {status})")
        return CacheAnswer(None, authorization)

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
