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
single stream of registry.transfer.  The requests themselves, and the followed stream, are
``registry.rangeget``'s; this module plans, runs and verifies the download.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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
from imgpipe.registry.rangeget import Download, NoRanges, fetch_chunk, stream_chunks
from imgpipe.registry.transfer import fetch_resumable

__all__ = ["Checked", "ChunkHasher", "DEFAULT_CHUNK_SIZE", "MAX_CHUNKS", "MIN_CHUNK_SIZE",
           "Verified", "chunk_count", "chunk_digests", "chunks_problem", "fetch_ranges",
           "own_chunk_size", "sidecar_path"]


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


def _hash_in_order(job: Download, count: int) -> hashlib._Hash | None:
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


def _kept_chunks(job: Download, created: bool) -> set[int]:
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


def _run(job: Download, connections: int) -> int:
    """Fetch every chunk not done over ``connections`` connections, hashing the whole file
    in order meanwhile; the bytes received.  Raises what the first failed chunk raised."""
    count = chunk_count(job.size, job.chunk_size)
    job.ready = [threading.Event() for _ in range(count)]
    for index in job.record.done:
        job.ready[index].set()
    missing = [i for i in range(count) if i not in job.record.done]
    with ThreadPoolExecutor(connections, thread_name_prefix="blob-range") as pool:
        if job.verified is not None:  # followed: the chunks in order, in one stream
            futures: list[Future[int]] = [pool.submit(stream_chunks, job, missing)]
        else:
            futures = [pool.submit(fetch_chunk, job, i) for i in missing]
        try:
            whole = _hash_in_order(job, count)
        except BaseException:
            job.failed.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            job.record.flush()  # every chunk done so far, for a resume
    errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
    if any(isinstance(e, NoRanges) for e in errors):
        raise NoRanges
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
        job = Download(client, digest, f"/v2/{repository}/blobs/{digest}", partial, fd, size,
                        chunk_size, digests, progress, say, record, verified=verified)
        record.done = _kept_chunks(job, created)
        record.save()  # before the file has holes
        _preallocate(fd, size)
        received = _run(job, connections)
    except NoRanges:
        say(f"{client.address} answered 200 to a range request: downloading in one stream")
        os.close(fd)
        return _single_stream(client, repository, digest, partial, size, progress)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    record.remove()
    return received
