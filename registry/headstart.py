"""A blob's stream begun before the fetch that takes it is ready: the batch host's fetch of a
job's broadcast (``imgpipe-pyxis-importer ahead``) asks for its pinned squashfs at once, on
the standard library's ``http.client``, while it still loads the full client and the
settings.  On a node busy starting the step's tasks those imports took 1.3 s, with the
registry's link idle (issue #61; the fetch's own CPU before its first range was 0.21 s).

``begin`` sends one GET for the whole blob from byte 0 and a thread reads the answer into a
bounded queue (``HELD`` blocks of ``BLOCK`` bytes: what is not read waits in the kernel's
buffers).  ``take`` gives the followed fetch (``registry.ranges``) that answer, once, when it
asks the same registry for exactly those bytes of the same blob: the blocks read so far,
then the rest of the same answer.  Anything else (another range, another blob or registry,
an answer that is not the 206 asked for, nothing within ``ANSWER_WAIT_S``) is no head
start: it is dropped and the fetch asks as it always does.  The bytes are trusted no more
than any stream's: every chunk is checked against the published digests as it lands and
the whole file against the job's pin.

``begin`` is for a registry the node reaches as the importer's plain client does: no login,
no CA of the site's own, no blob cache in between (``plain_site``); anything else asks as
always.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any

BLOCK = 1 << 20  # bytes per read of the answer
HELD = 64  # blocks held in memory before the fetch takes the answer (64 MiB)
ANSWER_WAIT_S = 2.0  # how long ``take`` waits for the answer's status and headers
TIMEOUT_S = 30.0  # the connection's timeout (connecting, then each read)


class BrokenAnswer(Exception):
    """The answer begun ahead broke off (a reset, a timeout, a short answer)."""


class HeadStart:
    """One blob's answer, read ahead on a thread of its own."""

    def __init__(self, scheme: str, address: str, url_path: str) -> None:
        self.origin = f"{scheme}://{address}"
        self.url_path = url_path
        self.size = -1  # the blob's size, from the answer's Content-Range
        self.failed = ""  # why the answer cannot be taken
        self._answered = threading.Event()
        self._blocks: queue.Queue[bytes | BaseException] = queue.Queue(HELD)
        self._stop = threading.Event()
        self._connection: Any = None
        self._thread = threading.Thread(target=self._read, args=(scheme, address),
                                        name="blob-head-start", daemon=True)
        self._thread.start()

    def _read(self, scheme: str, address: str) -> None:
        import http.client

        try:
            host, _, port = address.rpartition(":")
            kind = http.client.HTTPSConnection if scheme == "https" else \
                http.client.HTTPConnection
            self._connection = kind(host, int(port), timeout=TIMEOUT_S)
            self._connection.request("GET", self.url_path, headers={"Range": "bytes=0-"})
            answer = self._connection.getresponse()
            said = answer.getheader("Content-Range") or ""
            if answer.status != 206 or not said.startswith("bytes 0-"):
                self.failed = f"answered {answer.status} {said!r}"
            else:
                last, _, size = said[len("bytes 0-"):].partition("/")
                if int(last) + 1 != int(size):
                    self.failed = f"answered {said!r}"
                self.size = int(size)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            self._answered.set()
        if self.failed:
            self.close()
            return
        try:
            while not self._stop.is_set():
                block = answer.read(BLOCK)
                self._put(block)
                if not block:
                    return
        except (OSError, http.client.HTTPException) as exc:
            self._put(exc)

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._blocks.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def blocks(self) -> Iterator[bytes]:
        """The answer's bytes, in blocks, from byte 0 (BrokenAnswer where it broke off)."""
        while True:
            item = self._blocks.get()
            if isinstance(item, BaseException):
                raise BrokenAnswer(f"{type(item).__name__}: {item}") from item
            if not item:  # the answer's end
                return
            yield item

    def close(self) -> None:
        """Stop reading and hang up (what is left unread stays unread)."""
        self._stop.set()
        connection = self._connection
        if connection is not None:
            try:
                if connection.sock is not None:
                    import socket

                    connection.sock.shutdown(socket.SHUT_RDWR)
                connection.close()
            except OSError:
                pass


_begun: HeadStart | None = None
_lock = threading.Lock()


def plain_site(settings: Mapping[str, Any]) -> bool:
    """Whether the importer's fast reader's ``settings`` name a registry a head start may
    ask: no login, no CA of its own (``plain``), no blob cache, http or https."""
    return bool(settings.get("plain")) and not settings.get("blob_cache") \
        and settings.get("scheme") in ("http", "https")


def begin(scheme: str, address: str, repository: str, blob: str) -> None:
    """Ask for all of ``blob`` now (once per process); a thread reads the answer."""
    global _begun
    with _lock:
        if _begun is None:
            _begun = HeadStart(scheme, address, f"/v2/{repository}/blobs/{blob}")


def take(origin: str, url_path: str, start: int, end: int) -> HeadStart | None:
    """The answer begun ahead, when it is bytes ``start``-``end`` (all of the blob) of
    ``url_path`` at ``origin``: given once, else dropped.  None without one."""
    global _begun
    with _lock:
        begun, _begun = _begun, None
    if begun is None:
        return None
    begun._answered.wait(ANSWER_WAIT_S)
    if (begun._answered.is_set() and not begun.failed and begun.origin == origin
            and begun.url_path == url_path and start == 0 and end + 1 == begun.size):
        return begun
    begun.close()
    return None
