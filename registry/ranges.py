"""Reading a large blob as several byte ranges at once, each range checked as it lands.

A blob published with chunk digests (the sha256 of each CHUNK-sized piece, the last one
shorter) is fetched by ``fetch_ranges`` over N connections, one ``Range: bytes=a-b`` GET
per chunk (registry 2.8 answers 206), each written at its offset into this user's partial
file and hashed as it arrives.  A chunk that does not hash to its published digest is
fetched again alone; one that comes back with the same wrong bytes twice means the list,
not the transfer, is wrong: the list is distrusted and the whole digest decides.  The whole
file is always hashed too (pins name that digest), in order, while later chunks still land.

Which chunks are done is kept beside the partial file (``<partial>.chunks``, this user's,
replaced atomically, never read through a link), so a broken-off download goes on with the
missing chunks only.  A server that answers 200 to a range (one that ignores ranges) and
files under two chunks take the single stream of registry.transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

from imgpipe.base.files import atomic_path
from imgpipe.base.terminal import shown
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from imgpipe.registry.transfer import READ_CHUNK, fetch_resumable, open_partial

DEFAULT_CHUNK_SIZE = 64 << 20
MIN_CHUNK_SIZE = 64 << 10
MAX_CHUNK_SIZE = 1 << 30
MAX_CHUNKS = 50_000  # 65 bytes each: a list this long is still far under a manifest's cap
BROKEN_TRIES = 3  # tries of a range whose transfer breaks off, then the run fails (resumable)
CHUNK_TRIES = 3  # fetches of one chunk whose bytes keep failing its digest, then fail
SIDECAR_LIMIT = 1 << 20
_HEX = re.compile(r"[0-9a-f]{64}")


class ChunkHasher:
    """The sha256 of each ``chunk_size`` piece of a stream fed in pieces of any length."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._digests: list[str] = []
        self._current = hashlib.sha256()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk_size - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_size:
                self._digests.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def digests(self) -> list[str]:
        """The digests so far, the last (shorter) chunk's included."""
        return self._digests + ([self._current.hexdigest()] if self._filled else [])


def chunk_digests(path: Path, chunk_size: int) -> list[str]:
    """The sha256 of each ``chunk_size`` piece of the file ``path``, read once."""
    hasher = ChunkHasher(chunk_size)
    with open(path, "rb") as source:
        while block := source.read(READ_CHUNK):
            hasher.update(block)
    return hasher.digests()


def chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


def chunks_problem(size: int, chunk_size: int, digests: Sequence[object]) -> str | None:
    """Why ``digests`` cannot be the chunk digests of a blob of ``size`` bytes (from a
    manifest anyone who can push may write), or None when they can."""
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        return f"chunk size {chunk_size} is outside {MIN_CHUNK_SIZE}-{MAX_CHUNK_SIZE}"
    if len(digests) > MAX_CHUNKS or len(digests) != chunk_count(size, chunk_size):
        return (f"{len(digests)} chunk digests for {size} bytes in chunks of {chunk_size} "
                f"(expected {chunk_count(size, chunk_size)})")
    if not all(isinstance(d, str) and _HEX.fullmatch(d) for d in digests):
        return "a chunk digest is not 64 lowercase hex digits"
    return None


def sidecar_path(partial: Path) -> Path:
    """Where the done chunks of the download into ``partial`` are recorded."""
    return partial.with_name(partial.name + ".chunks")


def _read_sidecar(partial: Path) -> dict[str, object]:
    """The record beside ``partial``: this user's regular file, read without following a
    link; anything else (missing, planted, too long, not JSON) reads as no record."""
    try:
        fd = os.open(sidecar_path(partial), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_size > SIDECAR_LIMIT):
            return {}
        try:
            record = json.loads(handle.read(SIDECAR_LIMIT))
        except ValueError:
            return {}
    return record if isinstance(record, dict) else {}


def _done_in(record: dict[str, object], blob: str, size: int, chunk_size: int) -> set[int]:
    """The done chunks a record lists, when it is the record of this very download."""
    if (record.get("blob"), record.get("size"), record.get("chunk_size")) != (
            blob, size, chunk_size):
        return set()
    listed = record.get("done")
    count = chunk_count(size, chunk_size)
    if not isinstance(listed, list):
        return set()
    return {i for i in listed if isinstance(i, int) and 0 <= i < count}


def _write_sidecar(partial: Path, blob: str, size: int, chunk_size: int,
                   done: set[int]) -> None:
    record = {"blob": blob, "size": size, "chunk_size": chunk_size, "done": sorted(done)}
    with atomic_path(sidecar_path(partial), mode=0o600) as tmp:
        tmp.write_text(json.dumps(record, separators=(",", ":")))


def _single_stream(client: RegistryClient, repository: str, digest: str, partial: Path,
                   size: int, progress: Callable[[int], None] | None) -> int:
    """The single stream, after cutting a ranged download's partial file back to its run
    of done chunks from the start (the single stream resumes from a file's length)."""
    record = _read_sidecar(partial)
    if record:
        chunk_size = record.get("chunk_size")
        chunk_size = chunk_size if isinstance(chunk_size, int) and chunk_size > 0 else 1
        done, run = _done_in(record, digest, size, chunk_size), 0
        while run in done:
            run += 1
        with contextlib.suppress(FileNotFoundError):
            fd, _ = open_partial(partial)
            try:
                os.ftruncate(fd, min(run * chunk_size, size))
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
    done: set[int] = field(default_factory=set)
    ready: list[threading.Event] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)
    distrusted: str = ""  # the first chunk whose published digest the registry's bytes lack
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(self.size, start + self.chunk_size) - 1

    def advance(self, count: int) -> None:
        if self.progress is not None:
            with self.lock:
                self.progress(count)

    def finished(self, index: int) -> None:
        with self.lock:
            self.done.add(index)
            _write_sidecar(self.partial, self.digest, self.size, self.chunk_size, self.done)
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
    """A range whose transfer broke off (a timeout, a reset, a short answer): asked again."""


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


def _get_range(job: _Download, start: int, end: int) -> tuple[str, int]:
    """GET bytes ``start``-``end`` into the partial file at ``start``: their sha256 and
    how many arrived."""
    response = job.client.request("GET", job.url_path, stream=True, ok={200, 206},
                                  headers={"Range": f"bytes={start}-{end}"})
    hasher, offset = hashlib.sha256(), start
    try:
        if response.status_code == 200:
            raise _NoRanges
        answered = response.headers.get("Content-Range", "")
        if not answered.startswith(f"bytes {start}-{end}/"):
            raise RegistryError(f"{job.client.address} answered the range {start}-{end} of "
                                f"{job.digest} with Content-Range {shown(answered, 80)!r}",
                                method="GET", url=job.url_path)
        for block in response.iter_content(READ_CHUNK):
            if offset + len(block) > end + 1:
                raise RegistryError(f"{job.client.address} sent more than the range "
                                    f"{start}-{end} of {job.digest}: refused",
                                    method="GET", url=job.url_path)
            view = memoryview(block)
            while view:
                view = view[os.pwrite(job.fd, view, offset + len(block) - len(view)):]
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


def _fetch_chunk(job: _Download, index: int) -> int:
    """Fetch chunk ``index`` until it matches its published digest (if any is trusted);
    the bytes received."""
    if job.failed.is_set():
        return 0
    start, end = job.bounds(index)
    received, seen = 0, set()
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
    return whole


def _kept_chunks(job: _Download, created: bool) -> set[int]:
    """The chunks a partial file holds already: those its record lists, or (a single
    stream's partial file, no record) those within its length, checked against their
    digests where there are any."""
    if created:
        return set()
    done = _done_in(_read_sidecar(job.partial), job.digest, job.size, job.chunk_size)
    if done:
        return done
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
    for index in job.done:
        job.ready[index].set()
    missing = [i for i in range(count) if i not in job.done]
    with ThreadPoolExecutor(connections, thread_name_prefix="blob-range") as pool:
        futures: list[Future[int]] = [pool.submit(_fetch_chunk, job, i) for i in missing]
        try:
            whole = _hash_in_order(job, count)
        except BaseException:
            job.failed.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
    if any(isinstance(e, _NoRanges) for e in errors):
        raise _NoRanges
    if errors:
        raise errors[0]
    assert whole is not None  # no chunk failed
    if whole.hexdigest() != job.digest.partition(":")[2]:
        os.ftruncate(job.fd, 0)
        sidecar_path(job.partial).unlink(missing_ok=True)
        raise DigestMismatchError(
            f"blob {job.digest} failed verification: its bytes hash to "
            f"sha256:{whole.hexdigest()}" + (f" ({job.distrusted})" if job.distrusted else ""),
            method="GET", url=job.url_path)
    return sum(f.result() for f in futures)


def fetch_ranges(client: RegistryClient, repository: str, digest: str, partial: Path,
                 size: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 digests: Sequence[str] = (), connections: int = 4,
                 progress: Callable[[int], None] | None = None,
                 say: Callable[[str], None] = lambda _: None) -> int:
    """Fetch blob ``digest`` (``size`` bytes) into ``partial`` as ranges of ``chunk_size``
    over ``connections`` connections, each checked against ``digests`` (the published
    chunk digests; none: the whole digest alone), and verify the whole file; the caller
    publishes it.  Returns the bytes received by this call.  Raises RegistryError
    (DigestMismatchError for bytes that do not match)."""
    if digest.partition(":")[0] != "sha256":
        raise RegistryError(f"unsupported digest algorithm in {digest!r}")
    if digests and (problem := chunks_problem(size, chunk_size, digests)) is not None:
        say(f"ignored the chunk digests of {digest[:19]}: {problem}; the whole digest decides")
        digests = ()
    if connections <= 1 or size <= chunk_size:
        return _single_stream(client, repository, digest, partial, size, progress)
    fd, created = open_partial(partial)
    try:
        job = _Download(client, digest, f"/v2/{repository}/blobs/{digest}", partial, fd, size,
                        chunk_size, digests, progress, say)
        job.done = _kept_chunks(job, created)
        _write_sidecar(partial, digest, size, chunk_size, job.done)  # before it has holes
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
    sidecar_path(partial).unlink(missing_ok=True)
    return received
