"""Registry HTTP API v2 client (https://distribution.github.io/distribution/spec/api/).

Every request states the statuses it accepts; any other raises RegistryError
with method, URL, status and the registry's error code.  Connection errors and
5xx answers are retried with backoff (urllib3's Retry); nothing else is.
Every request has a timeout.  With a blob cache configured (``registry.blob_cache``),
blobs by digest are asked of it first and of the registry when it fails: which requests go
there and how it is asked is ``registry.cacheroute``; every blob's bytes are checked
against its digest here either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import HTTPError, ReadTimeoutError
from urllib3.util.retry import Retry

from imgpipe.base.files import atomic_path
from imgpipe.base.platforms import Platform, host_platform
from imgpipe.registry.auth import Authenticator, Credentials
from imgpipe.registry.cacheroute import BlobCacheRoute
from imgpipe.registry.documents import DOCUMENT_LIMIT, read_capped
from imgpipe.registry.errors import AuthError, DigestMismatchError, RegistryError
from imgpipe.registry.manifests import Manifest, select_platform, sha256_digest
from imgpipe.registry.mediatypes import (  # noqa: F401 (re-exported)
    DOCKER_LIST,
    DOCKER_MANIFEST,
    INDEX_TYPES,
    MANIFEST_ACCEPT,
    OCI_INDEX,
    OCI_MANIFEST,
    REGISTRY_HEADER,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0  # of silence: a stalled registry is given up on, not waited for
CHUNK = 1 << 20
PAGE_SIZE = 100  # registry:2 rejects n above 1000 and answers 100 when n is absent


MANIFEST_LIMIT = 4 << 20  # the OCI distribution spec's suggested limit for a manifest


class RegistryClient:
    """A session with one registry: ``RegistryClient("http://127.0.0.1:5000")``."""

    def __init__(
        self,
        base_url: str,
        credentials: Credentials | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        retries: int = 3,
        allow_http: bool = False,
        blob_cache: str | None = None,
        proxies_from_environment: bool = False,
    ) -> None:
        """``proxies_from_environment``: honour HTTPS_PROXY and the like (a public registry
        the site reaches through its proxy: ``imgpipe mirror``'s source); never for the
        site's own registry."""
        self.base_url = base_url.rstrip("/")
        self.blob_cache = BlobCacheRoute(blob_cache) if blob_cache else None
        self.address = self.base_url.split("://", 1)[-1]
        self.timeout = timeout
        self.verify: bool | str = str(ca_file) if ca_file else True
        self.session = requests.Session()
        # Proxy variables from the environment must not divert registry traffic
        # to a head-node registry through an intercepting proxy.  Nothing else of the
        # environment either: with trust_env, requests would send ~/.netrc's login as Basic
        # over the bearer token a registry issued.
        self.session.trust_env = False
        if proxies_from_environment:  # the proxies alone (HTTPS_PROXY, NO_PROXY) and their CA
            self.session.proxies.update(requests.utils.get_environ_proxies(self.base_url))
            if not ca_file:
                self.verify = os.environ.get("REQUESTS_CA_BUNDLE") or True
        # Refused connections and 5xx answers are retried; a read that timed out is not:
        # a registry silent for the whole read timeout would otherwise cost it 4 times.
        retry = Retry(
            total=retries,
            connect=retries,
            read=0,
            status=retries,
            backoff_factor=0.3,
            status_forcelist=(500, 502, 503, 504),
            allowed_methods=frozenset({"GET", "HEAD", "DELETE", "PUT"}),
            raise_on_status=False,
            respect_retry_after_header=True,
        )
        adapter = HTTPAdapter(max_retries=retry, pool_maxsize=16)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.auth = Authenticator(credentials, self.session, timeout[0] + timeout[1], self.verify,
                                  self.base_url, allow_http)
        self._authorization: str | None = None

    # -- transport -------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        ok: Iterable[int] = (200,),
        headers: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        stream: bool = False,
        data: bytes | None = None,
        limit: int = DOCUMENT_LIMIT,
    ) -> requests.Response:
        """One request, with the auth loop; raises RegistryError unless status is in ``ok``.
        Unless ``stream``, the body is a document: read at once, at most ``limit`` bytes."""
        url = path if path.startswith(("http://", "https://")) else self.base_url + path
        accepted = set(ok)
        if self.blob_cache is not None and self.blob_cache.takes(method, path):
            answer = self.blob_cache.ask(
                method, path, accepted=accepted, headers=headers, params=params,
                stream=stream, limit=limit, timeout=self.timeout, verify=self.verify,
                auth=self.auth, registry=self.address, authorization=self._authorization)
            self._authorization = answer.authorization
            if answer.response is not None:
                if answer.registry_error:  # the registry's own answer, passed through
                    raise self._status_error(method, self.blob_cache.url + path,
                                             answer.response)
                return answer.response
        sent_headers = dict(headers or {})
        # A Location or Link the registry sent may name another host: it gets no credentials.
        ours = _origin(url) == _origin(self.base_url)
        for attempt in range(3):  # anonymous or cached header, then at most two challenges
            if self._authorization and ours:
                sent_headers["Authorization"] = self._authorization
            # Always streamed: a document is then read capped (registry.documents), and a
            # blob by its caller, never a whole body of whatever length the server sends.
            response = self._send(method, url, sent_headers, params, True, data)
            if not stream or response.status_code not in accepted:
                read_capped(response, limit, f"{method} {url}")
            if response.status_code != 401 or 401 in accepted or not ours:
                break
            if attempt == 2:
                break
            response.close()
            self._authorization = self.auth.answer(response, self.address)
        if (response.status_code >= 400 and REGISTRY_HEADER not in response.headers
                and not _registry_errors(response)):
            # A web server's 404 is not "no such image": say what answered.
            raise self._status_error(method, url, response)
        if response.status_code == 401 and 401 not in accepted:
            raise AuthError(
                f"registry {self.address} refused the credentials ({method} {path})",
                hint="check the username and password in your credentials file",
                method=method,
                url=url,
                status=401,
            )
        if response.status_code not in accepted:
            raise self._status_error(method, url, response)
        return response

    def _blame(self, response: requests.Response, what: str) -> bool:
        """True (the cache now bypassed) when ``response`` came from the blob cache."""
        return self.blob_cache is not None and self.blob_cache.blame(response, what)

    def _send(self, method: str, url: str, headers: dict[str, str],
              params: dict[str, str] | None, stream: bool,
              data: bytes | None = None) -> requests.Response:
        try:
            return self.session.request(
                method, url, headers=headers, params=params, stream=stream, data=data,
                timeout=self.timeout, verify=self.verify, allow_redirects=True,
            )
        except requests.exceptions.SSLError as exc:
            raise RegistryError(
                f"TLS verification failed for {self.base_url}",
                hint="set registry.ca_file in imgpipe.yaml to the registry's CA certificate",
                method=method, url=url,
            ) from exc
        except requests.exceptions.ConnectionError as exc:
            reason = getattr(exc.args[0] if exc.args else None, "reason", None)
            if isinstance(reason, ReadTimeoutError):
                raise RegistryError(
                    f"the registry at {self.base_url} did not answer in time: silent for "
                    f"{self.timeout[1]:g} s ({method} {url})",
                    hint="raise registry.read_timeout_s in imgpipe.yaml if it is only slow",
                    method=method, url=url,
                ) from exc
            raise RegistryError(
                f"cannot reach the registry at {self.base_url}",
                hint="start it with `imgpipe registry up`, or fix registry.host/port "
                "in imgpipe.yaml",
                method=method, url=url,
            ) from exc
        except requests.exceptions.Timeout as exc:
            raise RegistryError(
                f"the registry at {self.base_url} did not answer in time ({method} {url})",
                method=method, url=url,
            ) from exc
        except requests.RequestException as exc:
            raise RegistryError(f"{method} {url} failed: {type(exc).__name__}",
                                method=method, url=url) from exc

    @staticmethod
    def _status_error(method: str, url: str, response: requests.Response) -> RegistryError:
        if REGISTRY_HEADER not in response.headers and not _registry_errors(response):
            kind = response.headers.get("Content-Type", "no content type").split(";")[0]
            return RegistryError(
                f"{method} {url}: HTTP {response.status_code} from a server that is not a "
                f"Docker registry ({kind}, no {REGISTRY_HEADER} header)",
                hint="check registry.host and registry.port in imgpipe.yaml",
                method=method, url=url, status=response.status_code, registry_code="NOT_A_REGISTRY")
        code, detail = None, ""
        try:
            errors = response.json().get("errors") or []
            if errors:
                code = errors[0].get("code")
                detail = errors[0].get("message", "")
        except ValueError:
            pass
        hint = None
        if code == "UNSUPPORTED" and method == "DELETE":
            hint = "the registry must run with deletion enabled (REGISTRY_STORAGE_DELETE_ENABLED)"
        text = f"{method} {url}: HTTP {response.status_code}"
        if code:
            text += f" {code}"
        if detail:
            text += f" ({detail})"
        return RegistryError(text, hint, method=method, url=url,
                             status=response.status_code, registry_code=code)

    # -- API -------------------------------------------------------------------------------

    @property
    def used_credentials(self) -> bool:
        """Whether this client logged in to the registry (Basic, or a token asked for with
        credentials): what it read is then a private image's."""
        return self.auth.credentials_sent

    def ping(self) -> None:
        """Check the registry speaks API v2 (and that our credentials work)."""
        response = self.request("GET", "/v2/", ok={200})
        version = response.headers.get("Docker-Distribution-API-Version", "registry/2.0")
        if "registry/2.0" not in version:
            raise RegistryError(f"{self.base_url} is not a Docker registry v2")

    def _paged(self, path: str, key: str, page_size: int) -> list[str]:
        items: list[str] = []
        url: str | None = path
        params: dict[str, Any] | None = {"n": page_size}
        while url:
            response = self.request("GET", url, params=params)
            items.extend(response.json().get(key) or [])
            nxt = response.links.get("next", {}).get("url")
            # The Link target is relative and already carries n and last.
            url = urljoin(response.url, nxt) if nxt else None
            params = None
        return items

    def listed_tags(self, repository: str) -> list[str]:
        """Tags of a repository the catalog lists: none when it holds only blobs (an
        interrupted push, or a repository whose tags were all deleted)."""
        try:
            return self.tags(repository)
        except RegistryError as exc:
            if exc.registry_code == "NAME_UNKNOWN":
                return []
            raise

    def catalog(self, page_size: int = PAGE_SIZE) -> list[str]:
        """Every repository, following the Link header page by page."""
        return self._paged("/v2/_catalog", "repositories", page_size)

    def tags(self, repository: str, page_size: int = PAGE_SIZE) -> list[str]:
        """Every tag of ``repository`` (empty when all were deleted)."""
        response = self.request("GET", f"/v2/{repository}/tags/list", ok={200, 404},
                                params={"n": page_size})
        if response.status_code == 404:
            raise RegistryError(f"repository {repository!r} not found in {self.address}",
                                status=404, registry_code="NAME_UNKNOWN")
        items = list(response.json().get("tags") or [])
        nxt = response.links.get("next", {}).get("url")
        if nxt:
            items += self._paged(urljoin(response.url, nxt), "tags", page_size)
        return items

    def manifest(
        self, repository: str, reference: str, platform: Platform | None = None
    ) -> Manifest:
        """The image manifest for ``reference``, resolving an index to ``platform``."""
        response = self.request("GET", f"/v2/{repository}/manifests/{reference}", ok={200, 404},
                                headers={"Accept": MANIFEST_ACCEPT})
        if response.status_code == 404:
            raise RegistryError(f"{self.address}/{repository}:{reference} not found",
                                hint="list what exists with `imgpipe registry tags "
                                f"{repository}`", status=404, registry_code="MANIFEST_UNKNOWN")
        manifest = self._manifest_from(response, reference)
        if manifest.media_type in INDEX_TYPES:
            entry = select_platform(manifest.body, platform or host_platform())
            return self.manifest(repository, entry["digest"], platform)
        return manifest

    def _manifest_from(self, response: requests.Response, reference: str) -> Manifest:
        raw = response.content
        computed = sha256_digest(raw)
        header = response.headers.get("Docker-Content-Digest")
        if reference.startswith("sha256:") and computed != reference:
            raise DigestMismatchError(f"manifest {reference} has digest {computed}")
        if header and header != computed:
            log.debug("Docker-Content-Digest %s differs from computed %s", header, computed)
        media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        try:
            media_type = json.loads(raw).get("mediaType") or media_type
        except ValueError as exc:
            raise RegistryError(f"manifest {reference} is not JSON") from exc
        # The digest names the bytes served; computing it works when the header is missing.
        return Manifest(computed, media_type, raw)

    def manifest_exactly(self, repository: str, digest: str, limit: int = MANIFEST_LIMIT
                         ) -> Manifest:
        """The manifest or index stored under ``digest``, as it is (an index is not
        resolved), at most ``limit`` bytes read and its digest checked: for reading what
        any pusher may have written (artifacts, referrers)."""
        response = self.request("GET", f"/v2/{repository}/manifests/{digest}", limit=limit,
                                headers={"Accept": MANIFEST_ACCEPT})
        raw = response.content
        if sha256_digest(raw) != digest:
            raise DigestMismatchError(f"manifest {digest} has digest {sha256_digest(raw)}")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise RegistryError(f"manifest {digest} is not JSON") from exc
        media_type = body.get("mediaType") if isinstance(body, dict) else None
        if not isinstance(media_type, str):
            media_type = response.headers.get("Content-Type", "").split(";")[0].strip()
        return Manifest(digest, media_type, raw)

    def manifest_digest(self, repository: str, reference: str) -> str | None:
        """Digest of the manifest ``reference`` points to (HEAD), or None when absent."""
        response = self.request("HEAD", f"/v2/{repository}/manifests/{reference}",
                                ok={200, 404}, headers={"Accept": MANIFEST_ACCEPT})
        if response.status_code == 404:
            return None
        digest = response.headers.get("Docker-Content-Digest")
        if digest:
            return digest
        # Some registries omit the header on HEAD: fall back to hashing the bytes.
        got = self.request("GET", f"/v2/{repository}/manifests/{reference}",
                           headers={"Accept": MANIFEST_ACCEPT})
        return sha256_digest(got.content)

    def delete_manifest(self, repository: str, digest: str) -> None:
        """Delete a manifest by digest (every tag pointing at it goes with it)."""
        self.request("DELETE", f"/v2/{repository}/manifests/{digest}", ok={202})

    def image_config(self, repository: str, digest: str, limit: int = 4 << 20
                     ) -> dict[str, Any]:
        """An image's config blob (small JSON: env, labels, layers' diff_ids), verified
        against ``digest``."""
        algorithm, _, expected = digest.partition(":")
        for attempt in (1, 2):
            response = self.request("GET", f"/v2/{repository}/blobs/{digest}", limit=limit)
            body = response.content
            if algorithm == "sha256" and hashlib.sha256(body).hexdigest() == expected:
                break
            if attempt == 1 and self._blame(
                    response, f"served config {digest[:19]} with bytes that do not match it"):
                continue
            raise DigestMismatchError(f"config {digest} of {repository} failed verification",
                                      method="GET", url=f"/v2/{repository}/blobs/{digest}")
        parsed = json.loads(body)
        if not isinstance(parsed, dict):
            raise RegistryError(f"config {digest} of {repository} is not a JSON object")
        return parsed

    def blob_size(self, repository: str, digest: str) -> int | None:
        """The size the registry itself gives for a blob (HEAD), or None when it has none."""
        response = self.request("HEAD", f"/v2/{repository}/blobs/{digest}", ok={200, 404})
        if response.status_code == 404:
            return None
        try:
            return int(response.headers["Content-Length"])
        except (KeyError, ValueError) as exc:
            raise RegistryError(f"blob {digest[:19]} of {repository}: no size in the "
                                "registry's answer") from exc

    def blob_exists(self, repository: str, digest: str) -> bool:
        response = self.request("HEAD", f"/v2/{repository}/blobs/{digest}", ok={200, 404})
        return response.status_code == 200

    def fetch_blob(
        self,
        repository: str,
        digest: str,
        dest: str | os.PathLike[str],
        progress: Callable[[int], None] | None = None,
    ) -> Path:
        """Stream a blob into ``dest``, hashing as it goes; publish only if the digest matches."""
        if digest.partition(":")[0] != "sha256":
            raise RegistryError(f"unsupported digest algorithm in {digest!r}")
        with atomic_path(dest) as tmp:
            for attempt in (1, 2):  # a second only when the blob cache failed the first
                if self._stream_into(tmp, repository, digest, progress, attempt == 1):
                    break
        return Path(dest)

    def _stream_into(self, tmp: str | os.PathLike[str], repository: str, digest: str,
                     progress: Callable[[int], None] | None, may_retry: bool) -> bool:
        """One GET of a blob into ``tmp``, hashed; True when its bytes match ``digest``,
        False when the blob cache served it wrongly and ``may_retry`` (ask the registry)."""
        expected = digest.partition(":")[2]
        url_path = f"/v2/{repository}/blobs/{digest}"
        response = self.request("GET", url_path, stream=True)
        hasher = hashlib.sha256()
        try:
            # The temporary was made exclusively for this process; never through a link.
            fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "wb", buffering=0) as out:
                # Into one reused buffer: a new 1 MiB object per read cost twice the
                # time (9.4 -> 4.1 s for the 2.3 GB of the 5 GiB image, 4 at once).
                buffer = bytearray(CHUNK)
                view = memoryview(buffer)
                while received := response.raw.readinto(buffer):
                    hasher.update(view[:received])
                    written = 0
                    while written < received:  # a raw file may take part of a write
                        written += out.write(view[written:received]) or 0
                    if progress:
                        progress(received)
        except (requests.RequestException, HTTPError) as exc:
            if may_retry and self._blame(
                    response, f"broke off sending blob {digest[:19]}"):
                return False
            raise RegistryError(f"download of {digest} from {self.address} broke off",
                                method="GET", url=url_path) from exc
        finally:
            response.close()
        if hasher.hexdigest() != expected:
            if may_retry and self._blame(
                    response, f"served blob {digest[:19]} with bytes that do not match it"):
                return False
            raise DigestMismatchError(
                f"blob {digest} of {repository} failed verification: its bytes hash to "
                f"sha256:{hasher.hexdigest()}",
                hint="the registry's storage is corrupt; delete and push the image again",
                method="GET", url=url_path,
            )
        return True


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _registry_errors(response: requests.Response) -> bool:
    """True when the body is the registry API's error document ({"errors": [...]})."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("errors"), list)
