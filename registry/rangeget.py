"""One ranged download's requests (``registry.ranges`` runs them): what its connections
share (``Download``), a range fetched, written and hashed (``get_range``, asked again when its
transfer breaks off), a chunk fetched until it matches its published digest (``fetch_chunk``),
and the chunks a broadcast's fetch follows, in order in one stream (``stream_chunks``), taking
over the answer ``registry.headstart`` began where it is the one asked for.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import requests

from imgpipe.base.terminal import shown
from imgpipe.registry.chunkrecord import DoneRecord
from imgpipe.registry.chunks import READ_CHUNK, Verified
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.headstart import BrokenAnswer, take

BROKEN_TRIES = 3  # tries of a range whose transfer breaks off, then the run fails (resumable)
CHUNK_TRIES = 3  # fetches of one chunk whose bytes keep failing its digest, then fail


class NoRanges(Exception):
    """The server answered a range request with the whole blob (200)."""


@dataclass
class Download:
    """What the connections of one ranged download share."""

    client: RegistryClient
    digest: str
    url_path: str
    partial: Path
    fd: int
    size: int
    chunk_size: int
    digests: Sequence[str]
    progress: Callable[[int], None] | None
    say: Callable[[str], None]
    record: DoneRecord
    ready: list[threading.Event] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)
    distrusted: str = ""  # the first chunk whose published digest the registry's bytes lack
    lock: threading.Lock = field(default_factory=threading.Lock)
    verified: Verified | None = None

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(self.size, start + self.chunk_size) - 1

    def advance(self, count: int) -> None:
        if self.progress is not None:
            with self.lock:
                self.progress(count)

    def finished(self, index: int) -> None:
        with self.lock:
            self.record.add(index)
        self.ready[index].set()

    def distrust(self, index: int, expected: str, got: str) -> None:
        with self.lock:
            if self.distrusted:
                return
            start, end = self.bounds(index)
            self.distrusted = (f"chunk {index} (bytes {start}-{end}) came twice as "
                               f"sha256:{got}, not the published sha256:{expected}")
        self.say(f"{self.distrusted}: the published chunk digests are not trusted for "
                 f"the rest of {self.digest[:19]}; the whole digest decides")


class BrokenRangeError(RegistryError):
    """A range whose transfer broke off (a timeout, a reset, a short answer): asked again.
    A stream's says how many of its chunks were done first, and the bytes received."""

    done = 0
    received = 0


def get_range_again(job: Download, start: int, end: int) -> tuple[str, int]:
    """``get_range``, asked again when its transfer breaks off (many nodes through one
    link time out now and then), up to BROKEN_TRIES times, one line each."""
    for attempt in range(1, BROKEN_TRIES + 1):
        try:
            return get_range(job, start, end)
        except BrokenRangeError as exc:
            if attempt == BROKEN_TRIES or job.failed.is_set():
                raise
            why = type(exc.__cause__).__name__ if exc.__cause__ else "a short answer"
            job.say(f"bytes {start}-{end} of {job.digest[:19]} broke off ({why}): "
                    "fetching them again")
            time.sleep(attempt)
    raise AssertionError("unreachable")


def open_range(job: Download, start: int, end: int) -> requests.Response:
    """The answer to GET bytes ``start``-``end``, its status and Content-Range checked
    (NoRanges where the server sends the whole blob)."""
    response = job.client.request("GET", job.url_path, stream=True, ok={200, 206},
                                  headers={"Range": f"bytes={start}-{end}"})
    answered = response.headers.get("Content-Range", "")
    if response.status_code == 200 or not answered.startswith(f"bytes {start}-{end}/"):
        response.close()
        if response.status_code == 200:
            raise NoRanges
        raise RegistryError(f"{job.client.address} answered the range {start}-{end} of "
                            f"{job.digest} with Content-Range {shown(answered, 80)!r}",
                            method="GET", url=job.url_path)
    return response


def get_range(job: Download, start: int, end: int) -> tuple[str, int]:
    """GET bytes ``start``-``end`` into the partial file at ``start``: their sha256 and
    how many arrived."""
    response = open_range(job, start, end)
    hasher, offset = hashlib.sha256(), start
    try:
        for block in response.iter_content(READ_CHUNK):
            if offset + len(block) > end + 1:
                raise RegistryError(f"{job.client.address} sent more than the range "
                                    f"{start}-{end} of {job.digest}: refused",
                                    method="GET", url=job.url_path)
            write_at(job.fd, block, offset)
            hasher.update(block)
            offset += len(block)
            job.advance(len(block))
    except requests.RequestException as exc:
        raise BrokenRangeError(f"download of {job.digest} from {job.client.address} broke off "
                            f"in bytes {start}-{end} (run again to resume: the chunks "
                            "verified so far are kept)", method="GET", url=job.url_path) from exc
    finally:
        response.close()
    if offset != end + 1:
        raise BrokenRangeError(f"download of {job.digest} from {job.client.address} broke off "
                            f"in bytes {start}-{end} after {offset - start} bytes (run again "
                            "to resume)", method="GET", url=job.url_path)
    return hasher.hexdigest(), offset - start


def write_at(fd: int, block: bytes, offset: int) -> None:
    view = memoryview(block)
    while view:
        view = view[os.pwrite(fd, view, offset + len(block) - len(view)):]


def stream_chunks(job: Download, missing: list[int]) -> int:
    """Followed (a job's broadcast sends each chunk once it is checked): the ``missing``
    chunks in order, each run of them in one stream, each chunk checked as its last byte
    lands (one chunk's time behind the registry).  One stream, not the connections sharing
    each chunk's parts: those all paused between parts at once, the link idle for a
    request's round trip per chunk (5 % of a 200 Mbit/s link beside the broadcast's first
    hop, issue #61).  A chunk that does not match is fetched again alone, in one line, and
    the stream goes on; one that breaks off is asked again from its start.  The bytes
    received."""
    received, at, broken = 0, 0, 0
    while at < len(missing) and not job.failed.is_set():
        run = 1
        while at + run < len(missing) and missing[at + run] == missing[at] + run:
            run += 1
        try:
            done, count = _stream_run(job, missing[at:at + run])
            broken = 0
        except BrokenRangeError as exc:
            if job.failed.is_set():  # a chunk fetched again alone failed for good
                raise
            done, count = exc.done, exc.received
            broken = 0 if done else broken + 1
            if broken == BROKEN_TRIES:
                job.failed.set()
                raise
            cause = exc.__cause__
            cause = cause.__cause__ if isinstance(cause, BrokenAnswer) else cause
            why = type(cause).__name__ if cause else "a short answer"
            job.say(f"bytes {job.bounds(missing[at + done])[0]}-"
                    f"{job.bounds(missing[at + run - 1])[1]} of {job.digest[:19]} broke off "
                    f"({why}): fetching them again")
            time.sleep(broken)
        except BaseException:
            job.failed.set()
            raise
        received, at = received + count, at + done
    return received


def _stream_run(job: Download, chunks: list[int]) -> tuple[int, int]:
    """One GET of the consecutive ``chunks``, each written, checked and finished as it
    lands: how many were done, and the bytes received (a BrokenRangeError says both)."""
    first, last = job.bounds(chunks[0])[0], job.bounds(chunks[-1])[1]
    begun = take(job.client.base_url, job.url_path, first, last)  # asked for ahead
    if begun is not None:
        blocks, close = begun.blocks(), begun.close
    else:
        response = open_range(job, first, last)
        blocks, close = response.iter_content(1 << 20), response.close
    done, received, offset = 0, 0, first
    hasher = hashlib.sha256()
    try:
        for block in blocks:
            while block:
                if done == len(chunks):
                    raise RegistryError(f"{job.client.address} sent more than the range "
                                        f"{first}-{last} of {job.digest}: refused",
                                        method="GET", url=job.url_path)
                end = job.bounds(chunks[done])[1] + 1
                piece, block = block[:end - offset], block[end - offset:]
                write_at(job.fd, piece, offset)
                hasher.update(piece)
                offset += len(piece)
                received += len(piece)
                job.advance(len(piece))
                if offset == end:
                    _check_streamed(job, chunks[done], hasher.hexdigest())
                    done, hasher = done + 1, hashlib.sha256()
    except (requests.RequestException, BrokenAnswer) as exc:
        raise _broken(job, first, last, done, received) from exc
    finally:
        close()
    if done < len(chunks):
        raise _broken(job, first, last, done, received)
    return done, received


def _check_streamed(job: Download, index: int, got: str) -> None:
    """A streamed chunk: finished where it matches its digest, else fetched again alone."""
    expected = job.digests[index] if job.digests and not job.distrusted else None
    if expected is None or got == expected:
        job.finished(index)
        return
    start, end = job.bounds(index)
    job.say(f"chunk {index} (bytes {start}-{end}) of {job.digest[:19]} hashed to "
            f"sha256:{got}, not the published sha256:{expected}: fetching it again")
    fetch_chunk(job, index, {got})


def _broken(job: Download, first: int, last: int, done: int, received: int
            ) -> BrokenRangeError:
    error = BrokenRangeError(f"download of {job.digest} from {job.client.address} broke off "
                             f"in bytes {first}-{last} (run again to resume: the chunks "
                             "verified so far are kept)", method="GET", url=job.url_path)
    error.done, error.received = done, received
    return error


def fetch_chunk(job: Download, index: int, seen: set[str] | None = None) -> int:
    """Fetch chunk ``index`` until it matches its published digest (if any is trusted);
    the bytes received.  ``seen``: wrong digests it came with already."""
    if job.failed.is_set():
        return 0
    start, end = job.bounds(index)
    received, seen = 0, seen or set()
    try:
        for attempt in range(1, CHUNK_TRIES + 1):
            got, count = get_range_again(job, start, end)
            received += count
            expected = job.digests[index] if job.digests and not job.distrusted else None
            if expected is None or got == expected:
                break
            if got in seen:  # the same bytes again: the list, not the transfer, is wrong
                job.distrust(index, expected, got)
                break
            if attempt == CHUNK_TRIES:
                raise DigestMismatchError(
                    f"chunk {index} (bytes {start}-{end}) of blob {job.digest} hashed to "
                    f"sha256:{got}, not the published sha256:{expected}, {CHUNK_TRIES} "
                    "times", method="GET", url=job.url_path)
            seen.add(got)
            job.say(f"chunk {index} (bytes {start}-{end}) of {job.digest[:19]} hashed to "
                    f"sha256:{got}, not the published sha256:{expected}: fetching it again")
    except BaseException:
        job.failed.set()
        raise
    job.finished(index)
    return received
