"""One image onto every node of a job in about one node's time (``enroot.distribution:
broadcast``): the importer's ``broadcast URI``, one task per node in one
``srun --mpi=pmix`` step of the recipes' ``stage_image`` (``imgpipe.recipes.staging``).

Every task first looks for its node's entry (``fast_get``): a node that holds one takes no
part and receives nothing.  The batch host's task (rank 0) fetches the pinned squashfs as any
node would, and sends each segment of the file as soon as its ranged fetch has checked it
(registry.ranges tells it, chunk by chunk, in order) down a chain of the other nodes in
their order (``enroot.published.chain``: a TCP connection from each node to the next, which
MPI sets up: where each node listens, and the batch host's random token that a connection
must say first); each node sends every message on as it lands and gathers the messages into
units that it writes and hashes on a thread of its own (``enroot.published.relay``), so no
pass over the file is left at the end.  A final gather tells the batch host which nodes took
the copy, which it says in one line (and, with IMGPIPE_BROADCAST_STAGES set, every node's
stage times in a second, machine-readable one); a node whose copy failed says why in one
line and fetches for itself, from the first chunk that differs.

The bytes come from a peer nobody authenticated beyond the token (which crossed MPI's
unencrypted connections): a receiver takes only bytes that hash to a pin of its own
environment and pass the contents check a fetch passes, and reads fixed-size buffers only
(never a pickled object: unpickling runs code).  Every message has one size (a segment and
a trailer), so a node that refuses the stream still forwards it to its end and the job never
hangs on it; a waiting node sleeps in the kernel or between polls of MPI (N waiting tasks on
one machine do not spin its cores), and a node that sees nothing move for chain.STALL_S
seconds, or whose neighbour hangs up, ends the step, which the recipes then stage with
sbcast.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import secrets
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.units import human_bytes
from imgpipe.commands.node.audit import record
from imgpipe.commands.node.batchfetch import BatchFetch
from imgpipe.commands.node.importer import fast_get, get, say
from imgpipe.commands.node.nodesite import node_site
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.published.chain import (
    ENDPOINT,
    SEGMENT,
    TOKEN,
    StalledError,
    accept,
    connect,
    forward,
    listen,
    own_address,
    read_endpoint,
    send,
    stamp,
)
from imgpipe.enroot.published.pins import Pins
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

DEBIAN_MPI4PY = Path("/usr/lib/python3/dist-packages/mpi4py")
MPI_HINT = ("apt-get install openmpi-bin python3-mpi4py (and libpmix-dev, which Slurm's "
            "pmix plugin loads), or set enroot.distribution: sbcast")
STAGES_ENV = "IMGPIPE_BROADCAST_STAGES"  # set: the batch host says every node's stage times
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_NAME = SLOT  # bytes per node in the final gather (relay.gather_slot)
_DONE = 62  # the tag of the "checked" tokens that end the broadcast
_WAIT_NAP = 0.002  # the longest sleep between polls of the header, a token (libnbc's
# Ibcast moves only inside a poll: each of its log2(N) rounds may wait one nap)


def load_mpi() -> Any:
    """mpi4py's ``MPI`` module, MPI initialised: this Python's own mpi4py, else Debian's
    python3-mpi4py (built for Debian's Python, the one node-side venvs are made from; a venv
    made without the system's site packages does not see it).  ImgpipeError if neither."""
    try:
        from mpi4py import MPI
    except ImportError:
        init = DEBIAN_MPI4PY / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            "mpi4py", init, submodule_search_locations=[str(DEBIAN_MPI4PY)])
        if not init.is_file() or spec is None or spec.loader is None:
            raise ImgpipeError("mpi4py is not installed on this node", hint=MPI_HINT) from None
        module = importlib.util.module_from_spec(spec)
        sys.modules["mpi4py"] = module
        try:
            spec.loader.exec_module(module)
            from mpi4py import MPI
        except ImportError as exc:
            del sys.modules["mpi4py"]
            raise ImgpipeError(f"mpi4py does not load here ({exc})", hint=MPI_HINT) from None
    return MPI


def broadcast(uri: str) -> Path:
    """This node's entry of ``uri`` once the job's broadcast is over: held already,
    received, or fetched by this node (said in one line).  Raises ImgpipeError when MPI
    cannot start here (the recipes then stage with sbcast)."""
    # a crash inside MPI's native code names the Python line it came from in the job's output
    faulthandler.enable()
    site = node_site()  # light: every task reads it before the chain can start
    ref = site.pinned(uri)
    manifest = ref.digest or ""
    found = fast_get(uri, "broadcast")
    # The step's first task runs on the batch host and sends (MPI's rank 0 under srun):
    # its fetch starts at once, while the other nodes' tasks still start.
    fetch = BatchFetch(uri, found) if os.environ.get("SLURM_PROCID") == "0" else None
    mpi = load_mpi()
    world = mpi.COMM_WORLD
    here = socket.gethostname()
    pins = Pins.from_env().for_image(manifest)
    root = world.Get_rank() == 0
    if root and fetch is None:
        fetch = BatchFetch(uri, found)
    if fetch is not None:
        fetch.follow()
        if not root:  # not the sender after all: this node has fetched
            found, fetch = fetch.result(), None
    with contextlib.ExitStack() as held:
        cache = site.cache
        why = None if found is not None or root else _hold(held, cache, manifest, pins)
        taking = root or (found is None and why is None)
        team = world.Split(0 if taking else mpi.UNDEFINED, world.Get_rank())
        if team == mpi.COMM_NULL:
            if found is not None:
                return found
            say(f"{here}: {why}: fetching it")
            held.close()
            return get(uri, event="broadcast")
        try:
            if root and fetch is not None:
                if team.Get_size() == 1:  # every other node holds it
                    return fetch.result()
                return _send(mpi, team, fetch, pins, here, site.host)
            copy = _receive(mpi, team, cache, ref.repository, pins,
                            site.host)
        except StalledError as exc:  # a node gone quiet or gone: the step ends, sbcast stages it
            say(f"{here}: {exc.message}: ending the broadcast")
            world.Abort(1)
            raise
        finally:
            team.Free()
    if isinstance(copy, Path):
        record("broadcast", str(ref), manifest, copy, "received")
        return copy
    say(f"{here}: refused the broadcast copy: {copy}")
    return get(uri, event="broadcast")


def _hold(held: contextlib.ExitStack, cache: Storage, manifest: str, pins: frozenset[str]
          ) -> str | None:
    """Take the digest's lock for the copy (at once or not at all: a node waiting would hold
    up every node after it), or say why this node takes no part."""
    if not pins:
        return f"no squashfs pin of {manifest[:19]}… in this job's environment"
    try:
        cache.prepare()
        held.enter_context(cache.lock(manifest, timeout_s=0))
    except ImgpipeError as exc:
        return f"{manifest[:19]}… cannot be received here ({exc.message})"
    return None


def _bcast_header(mpi: Any, team: Any, header: Header | None) -> bytes:
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


def _chain(mpi: Any, team: Any, toward: str) -> tuple[socket.socket | None,
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


def _send(mpi: Any, team: Any, fetch: BatchFetch, pins: frozenset[str], here: str,
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
    told = _bcast_header(mpi, team, header if fd is not None else None)
    times["header"] = time.time()
    try:
        sent = False
        if told and header is not None and fd is not None:
            _, out = _chain(mpi, team, toward)
            assert out is not None  # the team has a second member
            with out:
                sent = _send_units(out, header, fd, prefix, following, times)
    finally:
        if fd is not None:
            os.close(fd)
    _after_the_rest(mpi, team)
    times["all_checked"] = time.time()
    names = bytearray(_NAME * team.Get_size())
    team.Gather([bytearray(_NAME), mpi.BYTE], [names, mpi.BYTE], root=0)
    times["gathered"] = time.time()
    nodes = [read_slot(names[i:i + _NAME]) for i in range(_NAME, len(names), _NAME)]
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


def _send_units(out: socket.socket, header: Header, fd: int, prefix: Prefix,
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


def _receive(mpi: Any, team: Any, cache: Storage, repository: str, pins: frozenset[str],
             toward: str) -> Path | str:
    """A node without the entry: every segment received, forwarded to the next node and
    gathered into units that are written and hashed as they arrive; the entry, or why
    not."""
    here = socket.gethostname()
    times = NodeTimes(ready=time.time())  # the team is made: every task's MPI has started
    receiver: Receiver | None = None
    why = ""
    raw = _bcast_header(mpi, team, None)
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
        inp, out = _chain(mpi, team, toward)
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
    _after_the_rest(mpi, team)
    team.Gather([gather_slot(isinstance(copy, Path), here, times), mpi.BYTE], None, root=0)
    return copy


def _passing(message: bytearray) -> None:
    """A node that takes nothing: every message only passes through."""


def _after_the_rest(mpi: Any, team: Any) -> None:
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
