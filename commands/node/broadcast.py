"""One image onto every node of a job in about one node's time (``enroot.distribution:
broadcast``): the importer's ``broadcast URI``, one task per node in one
``srun --mpi=pmix`` step of the recipes' ``stage_image`` (``imgpipe.recipes.staging``).

Every task first looks for its node's entry (``fast_get``): a node that holds one takes no
part and receives nothing.  The batch host's task (rank 0) fetches the pinned squashfs as any
node would, and sends each segment of the file as soon as its ranged fetch has checked it
(registry.ranges tells it, chunk by chunk, in order) down a chain of the other nodes in
their order (``enroot.published.chain``: MPI point-to-point messages, a window of them in
flight on every link, so each node forwards one segment while it receives the next); each
node gathers the segments into units that it writes and hashes on a thread of its own
(``enroot.published.relay``), so no pass over the file is left at the end.  A final gather
tells the batch host which nodes took the copy, which it says in one line (and, with
IMGPIPE_BROADCAST_STAGES set, every node's stage times in a second, machine-readable one); a
node whose copy failed says why in one line and fetches for itself, from the first chunk
that differs.

The bytes travel over MPI's connections, which nobody authenticates: a receiver takes only
bytes that hash to a pin of its own environment and pass the contents check a fetch passes,
and reads fixed-size buffers only (never a pickled object: unpickling runs code).  Every
message has one size (a segment and a trailer), so a node that refuses the stream still
forwards it to its end and the job never hangs on it; every wait sleeps between polls (N
waiting tasks on one machine do not spin its cores), and a node that sees nothing move for
chain.STALL_S seconds ends the step, which the recipes then stage with sbcast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.units import human_bytes
from imgpipe.commands.node.fanout import node_settings, pinned_reference
from imgpipe.commands.node.importer import fast_get, get, say
from imgpipe.commands.shared.wiring import storage
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.published.chain import (
    SEGMENT,
    Pacer,
    StalledError,
    forward,
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
from imgpipe.registry.ranges import Checked

DEBIAN_MPI4PY = Path("/usr/lib/python3/dist-packages/mpi4py")
MPI_HINT = ("apt-get install openmpi-bin python3-mpi4py (and libpmix-dev, which Slurm's "
            "pmix plugin loads), or set enroot.distribution: sbcast")
STAGES_ENV = "IMGPIPE_BROADCAST_STAGES"  # set: the batch host says every node's stage times
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_NAME = SLOT  # bytes per node in the final gather (relay.gather_slot)
_DATA, _DONE = 61, 62  # the tags of the chain's segments and of its "checked" tokens
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
    settings = node_settings()
    ref = pinned_reference(uri, settings)
    manifest = ref.digest or ""
    found = fast_get(uri)
    # The step's first task runs on the batch host and sends (MPI's rank 0 under srun):
    # its fetch starts at once, while the other nodes' tasks still start.
    fetch = _Fetch(uri, found) if os.environ.get("SLURM_PROCID") == "0" else None
    mpi = load_mpi()
    world = mpi.COMM_WORLD
    here = socket.gethostname()
    pins = Pins.from_env().for_image(manifest)
    root = world.Get_rank() == 0
    if root and fetch is None:
        fetch = _Fetch(uri, found)
    if fetch is not None:
        fetch.follow()
        if not root:  # not the sender after all: this node has fetched
            found, fetch = fetch.result(), None
    with contextlib.ExitStack() as held:
        cache = storage(settings)
        # a login registry's image is private; a receiver cannot ask the registry, so where
        # the site has credentials every copy is kept as a private one (0600, own folder)
        cache.private = settings.registry.credentials.source != "none"
        why = None if found is not None or root else _hold(held, cache, manifest, pins)
        taking = root or (found is None and why is None)
        team = world.Split(0 if taking else mpi.UNDEFINED, world.Get_rank())
        if team == mpi.COMM_NULL:
            if found is not None:
                return found
            say(f"{here}: {why}: fetching it")
            held.close()
            return get(uri)
        try:
            if root and fetch is not None:
                if team.Get_size() == 1:  # every other node holds it
                    return fetch.result()
                return _send(mpi, team, fetch, pins, here)
            copy = _receive(mpi, team, cache, ref.repository, pins)
        except StalledError as exc:  # a node gone quiet: the step ends, sbcast stages it
            say(f"{here}: {exc.message}: ending the broadcast")
            world.Abort(1)
            raise
        finally:
            team.Free()
    if isinstance(copy, Path):
        return copy
    say(f"{here}: refused the broadcast copy: {copy}")
    return get(uri)


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
    """Wait for one MPI request, sleeping between polls (MPI's own wait spins a core)."""
    pacer = Pacer(stall_s=math.inf, nap_max=_WAIT_NAP)
    while not request.Test():
        pacer.idle(what)


class _Link:
    """The chain's messages between this node and its neighbours in the team, as MPI
    point-to-point requests (``enroot.published.chain.Link``)."""

    def __init__(self, mpi: Any, team: Any, upstream: int | None, downstream: int | None
                 ) -> None:
        self._mpi, self._team, self._up, self._down = mpi, team, upstream, downstream

    def receive(self, buffer: bytearray) -> object:
        return self._team.Irecv([buffer, self._mpi.BYTE], source=self._up, tag=_DATA)

    def send(self, buffer: bytearray) -> object:
        return self._team.Isend([buffer, self._mpi.BYTE], dest=self._down, tag=_DATA)

    def completed(self, pending: list[object]) -> list[int]:
        return list(self._mpi.Request.Testsome(pending) or ())

    def cancel(self, request: object) -> None:
        request.Cancel()  # type: ignore[attr-defined]
        request.Wait()  # type: ignore[attr-defined]


class _Fetch:
    """The batch host's fetch (nothing when it holds the entry), in a process of its own
    forked before MPI starts: Open MPI's start beside a thread already running (the fetch's)
    crashed the task (SIGSEGV) in the sandbox, and forked first the fetch runs while the
    other nodes' tasks still start.  It tells ``prefix`` what it has checked through a
    pipe, a JSON line per chunk, and its entry last."""

    def __init__(self, uri: str, found: Path | None) -> None:
        self.prefix = Prefix()
        self.failed = False
        self.started = time.monotonic()
        self.began = time.time()
        self._pid, self._pipe = 0, -1
        if found is not None:
            self.prefix.finish(found)
            return
        read, write = os.pipe()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child fetches and never returns into the caller
            code = 1
            try:
                os.close(read)
                code = _fetch_and_tell(uri, write)
            finally:
                os._exit(code)
        os.close(write)
        self._pid, self._pipe = pid, read

    def follow(self) -> None:
        """Hear the fetch (a thread: start it once MPI has started)."""
        if self._pipe >= 0:
            threading.Thread(target=self._hear, name="broadcast-fetch", daemon=True).start()

    def _hear(self) -> None:
        entry, digests = None, ()
        with os.fdopen(self._pipe, "rb") as words:
            for line in words:
                word = json.loads(line)
                if "entry" in word:
                    entry = Path(word["entry"])
                    continue
                digests = tuple(word.get("digests", digests))
                self.prefix(Checked(word["blob"], Path(word["partial"]), word["size"],
                                    word["chunk_size"], digests, word["upto"]))
        _, status = os.waitpid(self._pid, 0)
        self.failed = status != 0 or entry is None
        self.prefix.finish(None if self.failed else entry)

    def result(self) -> Path:
        """The entry, once the fetch is over; ImgpipeError else (the fetch said why)."""
        entry = self.prefix.ended()
        if self.failed or entry is None:
            raise ImgpipeError("the batch host's fetch failed (said above)")
        return entry


def _fetch_and_tell(uri: str, fd: int) -> int:
    """The fetch's process: ``get`` with each checked chunk told on ``fd``; its exit code."""
    with os.fdopen(fd, "wb", buffering=0) as out:
        told = False

        def tell(checked: Checked) -> None:
            nonlocal told
            word: dict[str, object] = {
                "blob": checked.blob, "partial": str(checked.partial), "size": checked.size,
                "chunk_size": checked.chunk_size, "upto": checked.upto}
            if not told:  # the chunk list once (up to 4,096 digests)
                word["digests"], told = list(checked.digests), True
            out.write(json.dumps(word).encode() + b"\n")

        try:
            entry = get(uri, verified=tell)
        except (ImgpipeError, OSError) as exc:
            print(f"imgpipe: error: {exc}", file=sys.stderr, flush=True)
            return 1
        out.write(json.dumps({"entry": str(entry)}).encode() + b"\n")
    return 0


def _send(mpi: Any, team: Any, fetch: _Fetch, pins: frozenset[str], here: str) -> Path:
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
        sent = bool(told) and header is not None and fd is not None and _send_units(
            mpi, team, header, fd, prefix, following, times)
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
    what = f"{header.blob[:19]}… ({human_bytes(header.size)})" if header else "nothing"
    say(f"{here}: broadcast {what}{'' if sent else ', stopped early'} in "
        f"{time.monotonic() - started:.1f} s: "
        f"{len(took)} node(s) took it ({', '.join(took) or 'none'})"
        + (f"; fetching for themselves: {', '.join(fetch_here)}" if fetch_here else ""))
    if os.environ.get(STAGES_ENV):
        prefix.ended()  # the fetch's own end is one of the stages
        times.update(first_chunk=prefix.first_at, fetch=prefix.done_at)
        say(f"{here}: " + stages_line(fetch.began, times, [t for _, _, t in nodes]))
    return fetch.result()


def _send_units(mpi: Any, team: Any, header: Header, fd: int, prefix: Prefix,
                following: bool, times: dict[str, float] | None = None) -> bool:
    """Send every segment of the file ``fd`` reads (``following``: as the fetch checks it)
    down the chain; False when the fetch stopped first (the receivers were told)."""
    stopped = False

    def fill(buffer: bytearray, index: int) -> bool | None:
        nonlocal stopped
        offset = index * SEGMENT
        length = min(SEGMENT, header.size - offset)
        ready: bool | None = True
        if following:
            ready = prefix.poll(header.blob, offset + length, 0)
            if ready is None:
                return None
            ready = ready or _same_file(fd, prefix.entry, header.size)
        if ready and os.preadv(fd, [memoryview(buffer)[:length]], offset) == length:
            stamp(buffer, offset, length, header.size)
            return offset + length >= header.size
        stopped = True
        stamp(buffer, -1, 0, header.size)
        return True

    moved = send(_Link(mpi, team, None, 1), fill, pacer=Pacer(nap=prefix.nap))
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


def _receive(mpi: Any, team: Any, cache: Storage, repository: str, pins: frozenset[str]
             ) -> Path | str:
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
        rank, size = team.Get_rank(), team.Get_size()
        link = _Link(mpi, team, rank - 1, rank + 1 if rank + 1 < size else None)
        moved = forward(link, assembler.take if assembler is not None else _passing,
                        downstream=rank + 1 < size)
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


def _passing(message: bytearray) -> bool:
    """A node that takes nothing: every message only passes through."""
    return True


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
