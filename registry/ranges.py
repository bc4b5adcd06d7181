"""Reading a large blob as several byte ranges at once, each range checked as it lands.

A blob published with chunk digests (the sha256 of each CHUNK-sized piece, the last one
shorter) is fetched by ``fetch_ranges`` over N connections, one ``Range: bytes=a-b`` GET
per chunk (registry 2.8 answers 206), each written at its offset into this user's partial
file and hashed as it arrives.  A chunk that does not hash to its published digest is
fetched again alone; one that comes back with the same wrong bytes twice means the list,
not the transfer, is wrong: the list is distrusted and the whole digest decides.  The whole
file is always hashed too (pins name that digest), in order, while later chunks still land.

A chunk list is written by whoever pushed its artifact, so it is bounded where it could do
harm: chunks of at least MIN_CHUNK_SIZE, at most MAX_CHUNKS of them.  A list outside the
bounds is ignored in one line and the fetch goes by its own chunk size, checked by the whole
digest alone (``plan_chunks``).

Followed chunk by chunk (``verified``: a job's broadcast), the chunks come in order in one
stream, each checked as its last byte lands: the first after one chunk's time (c/L), not the
k chunks' time (k·c/L) of k connections fetching a chunk each.

Which chunks are done is kept beside the partial file (registry.chunkrecord), so a broken-off
download goes on with the missing chunks only, when it goes on under the same plan.  A server
that answers 200 to a range (one that ignores ranges) and files under two chunks take the
single stream of registry.transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

from imgpipe.base.terminal import shown
from imgpipe.registry.chunkrecord import (
    DoneRecord,
    done_in,
    done_prefix,
    list_identity,
    open_partial,
    read_record,
    sidecar_path,
)
from imgpipe.registry.chunks import (  # the chunk names callers know from here too
    DEFAULT_CHUNK_SIZE,
    MAX_CHUNKS,
    MIN_CHUNK_SIZE,
    READ_CHUNK,
    Checked,
    ChunkHasher,
    Verified,
    chunk_count,
    chunk_digests,
    chunks_problem,
    own_chunk_size,
    plan_chunks,
)
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.headstart import BrokenAnswer, take
from imgpipe.registry.transfer import fetch_resumable

__all__ = ["Checked", "ChunkHasher", "DEFAULT_CHUNK_SIZE", "MAX_CHUNKS", "MIN_CHUNK_SIZE",
           "Verified", "chunk_count", "chunk_digests", "chunks_problem", "fetch_ranges",
           "own_chunk_size", "sidecar_path"]

BROKEN_TRIES = 3  # tries of a range whose transfer breaks off, then the run fails (resumable)
CHUNK_TRIES = 3  # fetches of one chunk whose bytes keep failing its digest, then fail


def _single_stream(client: RegistryClient, repository: str, digest: str, partial: Path,
                   size: int, progress: Callable[[int], None] | None) -> int:
    """The single stream, after cutting a ranged download's partial file back to its run
    of done chunks from the start (the single stream resumes from a file's length)."""
    record = read_record(partial)
    if record:
        with contextlib.suppress(FileNotFoundError):
            fd, _ = open_partial(partial)
            try:
                os.ftruncate(fd, done_prefix(record, digest, size))
            finally:
                os.close(fd)
        sidecar_path(partial).unlink(missing_ok=True)
    return fetch_resumable(client, repository, digest, partial, progress, size)


class _NoRanges(Exception):
    """The server answered a range request with the whole blob (200)."""


@dataclass
class _Download:
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


def _get_range_again(job: _Download, start: int, end: int) -> tuple[str, int]:
    """``_get_range``, asked again when its transfer breaks off (many nodes through one
    link time out now and then), up to BROKEN_TRIES times, one line each."""
    for attempt in range(1, BROKEN_TRIES + 1):
        try:
            return _get_range(job, start, end)
        except BrokenRangeError as exc:
            if attempt == BROKEN_TRIES or job.failed.is_set():
                raise
            why = type(exc.__cause__).__name__ if exc.__cause__ else "a short answer"
            job.say(f"bytes {start}-{end} of {job.digest[:19]} broke off ({why}): "
                    "fetching them again")
            time.sleep(attempt)
    raise AssertionError("unreachable")


def _open_range(job: _Download, start: int, end: int) -> requests.Response:
    """The answer to GET bytes ``start``-``end``, its status and Content-Range checked
    (_NoRanges where the server sends the whole blob)."""
    response = job.client.request("GET", job.url_path, stream=True, ok={200, 206},
                                  headers={"Range": f"bytes={start}-{end}"})
    answered = response.headers.get("Content-Range", "")
    if response.status_code == 200 or not answered.startswith(f"bytes {start}-{end}/"):
        response.close()
        if response.status_code == 200:
            raise _NoRanges
        raise RegistryError(f"{job.client.address} answered the range {start}-{end} of "
                            f"{job.digest} with Content-Range {shown(answered, 80)!r}",
                            method="GET", url=job.url_path)
    return response


def _get_range(job: _Download, start: int, end: int) -> tuple[str, int]:
    """GET bytes ``start``-``end`` into the partial file at ``start``: their sha256 and
    how many arrived."""
    response = _open_range(job, start, end)
    hasher, offset = hashlib.sha256(), start
    try:
        for block in response.iter_content(READ_CHUNK):
            if offset + len(block) > end + 1:
                raise RegistryError(f"{job.client.address} sent more than the range "
                                    f"{start}-{end} of {job.digest}: refused",
                                    method="GET", url=job.url_path)
            _write_at(job.fd, block, offset)
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


def _write_at(fd: int, block: bytes, offset: int) -> None:
    view = memoryview(block)
    while view:
        view = view[os.pwrite(fd, view, offset + len(block) - len(view)):]


def _stream_chunks(job: _Download, missing: list[int]) -> int:
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


def _stream_run(job: _Download, chunks: list[int]) -> tuple[int, int]:
    """One GET of the consecutive ``chunks``, each written, checked and finished as it
    lands: how many were done, and the bytes received (a BrokenRangeError says both)."""
    first, last = job.bounds(chunks[0])[0], job.bounds(chunks[-1])[1]
    begun = take(job.client.base_url, job.url_path, first, last)  # asked for ahead
    if begun is not None:
        blocks, close = begun.blocks(), begun.close
    else:
        response = _open_range(job, first, last)
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
                _write_at(job.fd, piece, offset)
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


def _check_streamed(job: _Download, index: int, got: str) -> None:
    """A streamed chunk: finished where it matches its digest, else fetched again alone."""
    expected = job.digests[index] if job.digests and not job.distrusted else None
    if expected is None or got == expected:
        job.finished(index)
        return
    start, end = job.bounds(index)
    job.say(f"chunk {index} (bytes {start}-{end}) of {job.digest[:19]} hashed to "
            f"sha256:{got}, not the published sha256:{expected}: fetching it again")
    _fetch_chunk(job, index, {got})


def _broken(job: _Download, first: int, last: int, done: int, received: int
            ) -> BrokenRangeError:
    error = BrokenRangeError(f"download of {job.digest} from {job.client.address} broke off "
                             f"in bytes {first}-{last} (run again to resume: the chunks "
                             "verified so far are kept)", method="GET", url=job.url_path)
    error.done, error.received = done, received
    return error


def _fetch_chunk(job: _Download, index: int, seen: set[str] | None = None) -> int:
    """Fetch chunk ``index`` until it matches its published digest (if any is trusted);
    the bytes received.  ``seen``: wrong digests it came with already."""
    if job.failed.is_set():
        return 0
    start, end = job.bounds(index)
    received, seen = 0, seen or set()
    try:
        for attempt in range(1, CHUNK_TRIES + 1):
            got, count = _get_range_again(job, start, end)
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


def _hash_in_order(job: _Download, count: int) -> hashlib._Hash | None:
    """The whole file's sha256, read back chunk by chunk as each is done (while later ones
    still land); None when a connection failed first."""
    whole = hashlib.sha256()
    for index in range(count):
        while not job.ready[index].wait(0.2):
            if job.failed.is_set():
                return None
        start, end = job.bounds(index)
        offset = start
        while offset <= end:
            block = os.pread(job.fd, min(READ_CHUNK, end + 1 - offset), offset)
            if not block:
                raise RegistryError(f"{job.partial} ended at {offset} bytes while being "
                                    "written: another process changed it")
            whole.update(block)
            offset += len(block)
        if job.verified is not None:
            job.verified(Checked(job.digest, job.partial, job.size, job.chunk_size,
                                 tuple(job.digests) if not job.distrusted else (), end + 1))
    return whole


def _kept_chunks(job: _Download, created: bool) -> set[int]:
    """The chunks a partial file holds already: those its record lists when it was made
    under this plan (one of another plan starts the file over, in one line), or (a single
    stream's partial file, no record) those within its length, checked against their
    digests where there are any."""
    if created:
        return set()
    record = read_record(job.partial)
    if record:
        done = done_in(record, job.digest, job.size, job.chunk_size, job.record.identity)
        if done is not None:
            return done
        was = record.get("chunk_size")
        why = (f"chunks of {shown(str(was), 20)} bytes, now {job.chunk_size}"
               if was != job.chunk_size else "another chunk list, size or blob")
        job.say(f"the record of a broken-off download of {job.digest[:19]} was made under "
                f"another chunking ({why}): starting over")
        os.ftruncate(job.fd, 0)
        return set()
    length = os.fstat(job.fd).st_size
    kept = set()
    for index in range(min(length, job.size) // job.chunk_size):
        start, end = job.bounds(index)
        if job.digests:
            piece = hashlib.sha256(os.pread(job.fd, end + 1 - start, start)).hexdigest()
            if piece != job.digests[index]:
                break
        kept.add(index)
    return kept


def _preallocate(fd: int, size: int) -> None:
    os.ftruncate(fd, min(os.fstat(fd).st_size, size))
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: not on this file system
            raise
        os.ftruncate(fd, size)


def _run(job: _Download, connections: int) -> int:
    """Fetch every chunk not done over ``connections`` connections, hashing the whole file
    in order meanwhile; the bytes received.  Raises what the first failed chunk raised."""
    count = chunk_count(job.size, job.chunk_size)
    job.ready = [threading.Event() for _ in range(count)]
    for index in job.record.done:
        job.ready[index].set()
    missing = [i for i in range(count) if i not in job.record.done]
    with ThreadPoolExecutor(connections, thread_name_prefix="blob-range") as pool:
        if job.verified is not None:  # followed: the chunks in order, in one stream
            futures: list[Future[int]] = [pool.submit(_stream_chunks, job, missing)]
        else:
            futures = [pool.submit(_fetch_chunk, job, i) for i in missing]
        try:
            whole = _hash_in_order(job, count)
        except BaseException:
            job.failed.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            job.record.flush()  # every chunk done so far, for a resume
    errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
    if any(isinstance(e, _NoRanges) for e in errors):
        raise _NoRanges
    if errors:
        raise errors[0]
    assert whole is not None  # no chunk failed
    if whole.hexdigest() != job.digest.partition(":")[2]:
        os.ftruncate(job.fd, 0)
        job.record.remove()
        raise DigestMismatchError(
            f"blob {job.digest} failed verification: its bytes hash to "
            f"sha256:{whole.hexdigest()}" + (f" ({job.distrusted})" if job.distrusted else ""),
            method="GET", url=job.url_path)
    return sum(f.result() for f in futures)


def fetch_ranges(client: RegistryClient, repository: str, digest: str, partial: Path,
                 size: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 digests: Sequence[str] = (), connections: int = 4,
                 progress: Callable[[int], None] | None = None,
                 say: Callable[[str], None] = lambda _: None,
                 verified: Verified | None = None) -> int:
    """Fetch blob ``digest`` (``size`` bytes) into ``partial`` as ranges of ``chunk_size``
    (0: DEFAULT_CHUNK_SIZE) over ``connections`` connections, each checked against
    ``digests`` (the published chunk digests, taken within bounds: ``plan_chunks``; none:
    the whole digest alone), and verify the whole file; the caller publishes it.
    ``verified`` hears each chunk in order once it is checked (not in one stream).  Returns
    the bytes received by this call.  Raises RegistryError (DigestMismatchError for bytes
    that do not match)."""
    if digest.partition(":")[0] != "sha256":
        raise RegistryError(f"unsupported digest algorithm in {digest!r}")
    chunk_size, digests = plan_chunks(digest, size, chunk_size, digests, say)
    if connections <= 1 or size <= chunk_size:
        return _single_stream(client, repository, digest, partial, size, progress)
    fd, created = open_partial(partial)
    try:
        record = DoneRecord(partial, digest, size, chunk_size, list_identity(digests), set())
        job = _Download(client, digest, f"/v2/{repository}/blobs/{digest}", partial, fd, size,
                        chunk_size, digests, progress, say, record, verified=verified)
        record.done = _kept_chunks(job, created)
        record.save()  # before the file has holes
        _preallocate(fd, size)
        received = _run(job, connections)
    except _NoRanges:
        say(f"{client.address} answered 200 to a range request: downloading in one stream")
        os.close(fd)
        return _single_stream(client, repository, digest, partial, size, progress)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    record.remove()
    return received
