"""The broadcast's MPI step once its team is made (``commands.node.broadcast`` makes it): the
header from the batch host to every member, the chain of TCP connections
(``enroot.published.chain``), the batch host's sending of what its fetch checked, each
receiver's forwarding, writing and hashing (``enroot.published.relay``), and the final
tally.  Imported only once MPI has started: every node's task reads these modules, and
before the chain starts each one's CPU delays the batch host's fetch (issue #61)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import time
from pathlib import Path
from typing import Any

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.units import human_bytes
from imgpipe.commands.node.batchfetch import BatchFetch
from imgpipe.commands.node.importer import say
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.published.chain import (
    ENDPOINT,
    SEGMENT,
    TOKEN,
    accept,
    connect,
    forward,
    listen,
    own_address,
    read_endpoint,
    send,
    stamp,
)
from imgpipe.enroot.published.relay import (
    HEADER_MAX,
    SLOT,
    Assembler,
    Header,
    NodeTimes,
    Prefix,
    Receiver,
    RelayError,
    gather_slot,
    read_slot,
    stages_line,
)

STAGES_ENV = "IMGPIPE_BROADCAST_STAGES"  # set: the batch host says every node's stage times
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
NAME = SLOT  # bytes per node in the final gather (relay.gather_slot)
_DONE = 62  # the tag of the "checked" tokens that end the broadcast
_WAIT_NAP = 0.002  # the longest sleep between polls of the header, a token (libnbc's
# Ibcast moves only inside a poll: each of its log2(N) rounds may wait one nap)


def bcast_header(mpi: Any, team: Any, header: Header | None) -> bytes:
    """The header from the root to every member: a length, then that many bytes (empty
    where there is none, or one too long: on every member alike)."""
    data = header.encode() if header is not None else b""
    length = bytearray(struct.pack("<q", len(data)))
    _wait(team.Ibcast([length, mpi.BYTE], root=0), "the batch host's first chunk")
    (count,) = struct.unpack("<q", length)
    if not 0 < count <= HEADER_MAX:
        return b""
    buffer = bytearray(data) if header is not None else bytearray(count)
    _wait(team.Ibcast([buffer, mpi.BYTE], root=0), "the batch host's header")
    return bytes(buffer)


def _wait(request: Any, what: str) -> None:
    """Wait for one MPI request, sleeping between polls (MPI's own wait spins a core):
    from 50 us, doubling up to _WAIT_NAP."""
    nap = 50e-6
    while not request.Test():
        time.sleep(nap)
        nap = min(2 * nap, _WAIT_NAP)


def make_chain(mpi: Any, team: Any, toward: str) -> tuple[socket.socket | None,
                                                       socket.socket | None]:
    """This node's connections in the chain (``enroot.published.chain``): from the node
    before it (None at the batch host), to the node after it (None at the last).  Every
    receiving node listens on its address toward ``toward`` (the registry's host); the batch
    host's random token and every node's address go round by MPI; each node connects to the
    next and takes from the one before only the connection that says the token."""
    rank, size = team.Get_rank(), team.Get_size()
    token = bytearray(secrets.token_bytes(TOKEN) if rank == 0 else TOKEN)
    listener, endpoint = None, bytearray(ENDPOINT)
    if rank > 0:
        listener, endpoint = listen(own_address(toward))
    try:
        _wait(team.Ibcast([token, mpi.BYTE], root=0), "the batch host's token")
        endpoints = bytearray(ENDPOINT * size)
        _wait(team.Iallgather([endpoint, mpi.BYTE], [endpoints, mpi.BYTE]),
              "the other nodes' addresses")
        out = None
        if rank + 1 < size:
            place = (rank + 1) * ENDPOINT
            out = connect(read_endpoint(endpoints[place:place + ENDPOINT]), bytes(token))
        inp = accept(listener, bytes(token)) if listener is not None else None
    finally:
        if listener is not None:
            listener.close()
    return inp, out


def send_from_batch_host(mpi: Any, team: Any, fetch: BatchFetch, pins: frozenset[str], here: str,
          toward: str) -> Path:
    """The batch host: send every segment its fetch checked (or of the entry it held)."""
    times = {"ready": time.time()}  # the team is made: every task's MPI has started
    prefix, started = fetch.prefix, fetch.started
    checked = prefix.started()
    header, source = None, prefix.entry
    if checked is not None:
        header, source = Header(checked.blob, checked.size, checked.chunk_size,
                                checked.digests), checked.partial
    elif source is not None and pins:
        blob = next((pin for pin in sorted(pins) if pin[7:] in source.name), min(pins))
        header = Header(blob, source.stat().st_size)
    fd, following = None, checked is not None
    if source is not None:
        try:
            fd = os.open(source, _READ)
        except FileNotFoundError:  # the fetch ended before it was looked at: its entry
            entry = prefix.ended() if checked is not None else None
            if entry is not None and checked is not None and checked.blob[7:] in entry.name:
                fd, following = os.open(entry, _READ), False
    told = bcast_header(mpi, team, header if fd is not None else None)
    times["header"] = time.time()
    try:
        sent = False
        if told and header is not None and fd is not None:
            _, out = make_chain(mpi, team, toward)
            assert out is not None  # the team has a second member
            with out:
                sent = send_units(out, header, fd, prefix, following, times)
    finally:
        if fd is not None:
            os.close(fd)
    after_the_rest(mpi, team)
    times["all_checked"] = time.time()
    names = bytearray(NAME * team.Get_size())
    team.Gather([bytearray(NAME), mpi.BYTE], [names, mpi.BYTE], root=0)
    times["gathered"] = time.time()
    nodes = [read_slot(names[i:i + NAME]) for i in range(NAME, len(names), NAME)]
    took = sorted(name for ok, name, _ in nodes if ok)
    fetch_here = sorted(name for ok, name, _ in nodes if not ok)
    since = ", fetched since the job's start" if fetch.ahead else ""
    what = f"{header.blob[:19]}… ({human_bytes(header.size)}{since})" if header else "nothing"
    say(f"{here}: broadcast {what}{'' if sent else ', stopped early'} in "
        f"{time.monotonic() - started:.1f} s: "
        f"{len(took)} node(s) took it ({', '.join(took) or 'none'})"
        + (f"; fetching for themselves: {', '.join(fetch_here)}" if fetch_here else ""))
    if os.environ.get(STAGES_ENV):
        prefix.ended()  # the fetch's own end is one of the stages
        times.update(first_chunk=prefix.first_at, fetch=prefix.done_at)
        say(f"{here}: " + stages_line(fetch.began, times, [t for _, _, t in nodes]))
    return fetch.result()


def send_units(out: socket.socket, header: Header, fd: int, prefix: Prefix,
                following: bool, times: dict[str, float] | None = None) -> bool:
    """Send every segment of the file ``fd`` reads (``following``: as the fetch checks it)
    down the chain; False when the fetch stopped first (the receivers were told)."""
    stopped = False

    def fill(buffer: bytearray, index: int) -> bool:
        nonlocal stopped
        offset = index * SEGMENT
        length = min(SEGMENT, header.size - offset)
        ready = not following or prefix.wait(header.blob, offset + length) \
            or _same_file(fd, prefix.entry, header.size)
        if ready and os.preadv(fd, [memoryview(buffer)[:length]], offset) == length:
            stamp(buffer, offset, length, header.size)
            return offset + length >= header.size
        stopped = True
        stamp(buffer, -1, 0, header.size)
        return True

    moved = send(out, fill)
    if times is not None:
        times.update(sent_first=moved.first_at, sent_last=moved.last_at)
    return not stopped


def _same_file(fd: int, entry: Path | None, size: int) -> bool:
    """Whether the fetch ended with ``fd``'s file as its entry, whole (one stream took over
    from the ranges, or the last word came after the last unit was asked for)."""
    if entry is None:
        return False
    with contextlib.suppress(OSError):
        info, mine = os.stat(entry, follow_symlinks=False), os.fstat(fd)
        return (info.st_ino, info.st_dev) == (mine.st_ino, mine.st_dev) \
            and mine.st_size == size
    return False


def receive(mpi: Any, team: Any, cache: Storage, repository: str, pins: frozenset[str],
             toward: str) -> Path | str:
    """A node without the entry: every segment received, forwarded to the next node and
    gathered into units that are written and hashed as they arrive; the entry, or why
    not."""
    here = socket.gethostname()
    times = NodeTimes(ready=time.time())  # the team is made: every task's MPI has started
    receiver: Receiver | None = None
    why = ""
    raw = bcast_header(mpi, team, None)
    try:
        if not raw:
            raise RelayError("the batch host has no copy to send")
        header = Header.decode(raw)
        header.check(pins)
        receiver = Receiver(header, cache.partial_download(header.blob),
                            cache.fetched(repository, header.blob), cache.entry_mode)
    except (RelayError, ImgpipeError, OSError) as exc:
        why = f"nothing this node can take came ({exc})"
    assembler = Assembler(receiver) if receiver is not None else None
    if raw:
        inp, out = make_chain(mpi, team, toward)
        assert inp is not None  # a receiving node has a node before it
        with inp, out or contextlib.nullcontext():
            moved = forward(inp, out, assembler.take if assembler is not None else _passing)
        times.first, times.last = moved.first_at, moved.last_at
    copy: Path | str = why
    if receiver is not None and assembler is not None:
        assembler.flush()
        why = why or assembler.why
        copy = receiver.abandon(why) if why else receiver.finish()
    times.checked = time.time()
    after_the_rest(mpi, team)
    team.Gather([gather_slot(isinstance(copy, Path), here, times), mpi.BYTE], None, root=0)
    return copy


def _passing(message: bytearray) -> None:
    """A node that takes nothing: every message only passes through."""


def after_the_rest(mpi: Any, team: Any) -> None:
    """Wait, asleep, until every node below this one in a binary tree of the team (rank r
    hears 2r and 2r+1; rank 1 is the batch host's only child) has its copy checked, then
    tell the one above: nobody spins in the final gather (MPI's wait) while others still
    check (the sandbox's hosts share two cores), and the word takes log2(N) hops, not N.
    A token nobody waits for (a sender that does not) is one small message left unread:
    its send ends without it."""
    rank, size = team.Get_rank(), team.Get_size()
    below = [1] if rank == 0 else [c for c in (2 * rank, 2 * rank + 1) if c < size]
    tokens = [bytearray(1) for _ in below]
    for child, token in zip(below, tokens, strict=True):
        _wait(team.Irecv([token, mpi.BYTE], source=child, tag=_DONE), "the nodes after it")
    if rank > 0:
        _wait(team.Isend([bytearray(1), mpi.BYTE], dest=rank // 2, tag=_DONE),
              "the node above")
