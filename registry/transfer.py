"""Writing to a registry (blobs in chunks, manifests) and reading a large blob resumably.

Uploads follow the Registry API's chunked flow: ``POST …/blobs/uploads/`` opens a
session, each ``PATCH`` sends the next CHUNK bytes (a ``Content-Range``), and the
closing ``PUT …?digest=`` makes the registry check the whole blob against its digest.
A blob the registry holds already is not sent again (a HEAD first).

Reading: ``fetch_resumable`` keeps what it received in a partial file of this user
(created exclusively, never through a link); a run broken off goes on from its length
with a ``Range`` request, hashing the kept bytes first; a whole blob that does not hash
to its digest is emptied, and one that does is left for the caller to check and publish.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urljoin

import requests

from imgpipe.base.directio import ALIGN, DirectWriter
from imgpipe.registry.chunkrecord import open_partial
from imgpipe.registry.chunks import READ_CHUNK
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.manifests import sha256_digest

UPLOAD_CHUNK = 64 << 20  # bytes per PATCH: what one request holds in memory


def _location(client: RegistryClient, response: requests.Response) -> str:
    location = response.headers.get("Location")
    if not location:
        raise RegistryError(f"the registry at {client.address} opened an upload without a "
                            "Location header")
    return urljoin(client.base_url + "/", location)


def push_blob(client: RegistryClient, repository: str, path: Path, digest: str,
              progress: Callable[[int], None] | None = None,
              on_read: Callable[[bytes], None] | None = None) -> bool:
    """Upload the file ``path`` as blob ``digest``; False when the registry had it (then
    nothing is read).  ``on_read`` sees every byte read, in order (hashing in this pass)."""
    if client.blob_exists(repository, digest):
        return False
    response = client.request("POST", f"/v2/{repository}/blobs/uploads/", ok={202})
    location = _location(client, response)
    sent = 0
    with open(path, "rb") as source:
        while chunk := source.read(UPLOAD_CHUNK):
            if on_read:
                on_read(chunk)
            response = client.request(
                "PATCH", location, ok={202}, data=chunk,
                headers={"Content-Type": "application/octet-stream",
                         "Content-Range": f"{sent}-{sent + len(chunk) - 1}",
                         "Content-Length": str(len(chunk))})
            location = _location(client, response)
            sent += len(chunk)
            if progress:
                progress(len(chunk))
    separator = "&" if "?" in location else "?"
    client.request("PUT", f"{location}{separator}digest={digest}", ok={201},
                   headers={"Content-Length": "0"})
    return True


def push_bytes(client: RegistryClient, repository: str, data: bytes) -> str:
    """Upload a small blob in one request; returns its digest."""
    digest = sha256_digest(data)
    if not client.blob_exists(repository, digest):
        response = client.request("POST", f"/v2/{repository}/blobs/uploads/", ok={202})
        location = _location(client, response)
        separator = "&" if "?" in location else "?"
        client.request("PUT", f"{location}{separator}digest={digest}", ok={201}, data=data,
                       headers={"Content-Type": "application/octet-stream"})
    return digest


def put_manifest(client: RegistryClient, repository: str, reference: str, raw: bytes,
                 media_type: str) -> str:
    """Store a manifest (or index) under ``reference`` (a tag or its digest); its digest."""
    digest = sha256_digest(raw)
    client.request("PUT", f"/v2/{repository}/manifests/{reference}", ok={201}, data=raw,
                   headers={"Content-Type": media_type})
    return digest


def _received(response: requests.Response, chunks: int = 8) -> Iterator[bytes]:
    """The body's chunks, read by a thread of its own ``chunks`` ahead of the caller: the
    network read overlaps the caller's hashing and writing (measured on a 2.2 GB blob:
    4.2-4.5 s against 6.4-9.2 s in one thread).  A read error is raised here."""
    handoff: queue.Queue[bytes | BaseException | None] = queue.Queue(chunks)

    def read() -> None:
        try:
            for chunk in response.iter_content(READ_CHUNK):
                handoff.put(chunk)
            handoff.put(None)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread)
            handoff.put(exc)

    reader = threading.Thread(target=read, name="blob-reader", daemon=True)
    reader.start()
    try:
        while (item := handoff.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        response.close()  # a reader still blocked in a read ends with the connection
        while reader.is_alive():
            with contextlib.suppress(queue.Empty):
                handoff.get(timeout=0.1)


def _kept_start(partial: Path) -> tuple[int, hashlib._Hash]:
    """The aligned start of this user's partial download (a longer tail is cut off: direct
    writes resume at an ALIGN boundary) and the hash of those bytes."""
    fd, _ = open_partial(partial)
    with os.fdopen(fd, "r+b") as kept_file:
        size = os.fstat(kept_file.fileno()).st_size
        kept = size - size % ALIGN
        kept_file.truncate(kept)
        hasher = hashlib.sha256()
        while block := kept_file.read(READ_CHUNK):
            hasher.update(block)
    return kept, hasher


def fetch_resumable(client: RegistryClient, repository: str, digest: str, partial: Path,
                    progress: Callable[[int], None] | None = None,
                    size: int | None = None) -> int:
    """Stream blob ``digest`` into ``partial`` (resumed when it holds a start) and verify
    it; the caller publishes the file.  Returns the bytes received by this call.  Written
    around the page cache where the file system allows (base.directio)."""
    algorithm, _, expected = digest.partition(":")
    if algorithm != "sha256":
        raise RegistryError(f"unsupported digest algorithm in {digest!r}")
    url_path = f"/v2/{repository}/blobs/{digest}"
    kept, hasher = _kept_start(partial)
    response = client.request("GET", url_path, stream=True, ok={200, 206, 416},
                              headers={"Range": f"bytes={kept}-"} if kept else {})
    if response.status_code == 200 and kept:  # no ranges served: start again
        os.truncate(partial, 0)
        kept, hasher = 0, hashlib.sha256()
    received = 0
    writer = DirectWriter(partial, kept)
    try:
        if response.status_code != 416:
            for chunk in _received(response):
                if size is not None and kept + received + len(chunk) > size:
                    raise RegistryError(f"blob {digest} of {repository} is larger than the "
                                        f"{size} bytes its descriptor declares: refused",
                                        method="GET", url=url_path)
                hasher.update(chunk)
                writer.write(chunk)
                received += len(chunk)
                if progress:
                    progress(len(chunk))
    except requests.RequestException as exc:
        writer.abandon()
        raise RegistryError(f"download of {digest} from {client.address} broke off after "
                            f"{kept + received} bytes (run again to resume)",
                            method="GET", url=url_path) from exc
    except BaseException:
        writer.abandon()
        raise
    finally:
        response.close()
    writer.close()
    if hasher.hexdigest() != expected:
        os.truncate(partial, 0)
        raise DigestMismatchError(
            f"blob {digest} of {repository} failed verification: its bytes hash to "
            f"sha256:{hasher.hexdigest()}", method="GET", url=url_path)
    return received
