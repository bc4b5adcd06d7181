"""One image onto every node of a job in about one node's time (``enroot.distribution:
broadcast``): the importer's ``broadcast URI``, one task per node in one
``srun --mpi=pmix`` step of the recipes' ``stage_image`` (``imgpipe.recipes.staging``).

Every task first looks for its node's entry (``fast_get``): a node that holds one takes no
part and receives nothing.  The batch host's task (rank 0) fetches the pinned squashfs as any
node would, and sends each unit of the file as soon as its ranged fetch has checked it
(registry.ranges tells it, chunk by chunk, in order); MPI's pipelined broadcast has every
node forward a unit while it receives the next, and each node writes and hashes it on a
thread of its own (``enroot.published.relay``), so no pass over the file is left at the end.
A final gather tells the batch host which nodes took the copy, which it says in one line; a
node whose copy failed says why in one line and fetches for itself, from the first chunk
that differs.

The bytes travel over MPI's connections, which nobody authenticates: a receiver takes only
bytes that hash to a pin of its own environment and pass the contents check a fetch passes,
and reads fixed-size buffers only (never a pickled object: unpickling runs code).  Every
message has one size (UNIT and a trailer), so a receiver that refuses the stream still takes
part to its end and the job never hangs on it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
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
from imgpipe.enroot.published.pins import Pins
from imgpipe.enroot.published.relay import (
    HEADER_MAX,
    UNIT,
    Header,
    Prefix,
    Receiver,
    RelayError,
)
from imgpipe.registry.ranges import Checked

DEBIAN_MPI4PY = Path("/usr/lib/python3/dist-packages/mpi4py")
MPI_HINT = ("apt-get install openmpi-bin python3-mpi4py (and libpmix-dev, which Slurm's "
            "pmix plugin loads), or set enroot.distribution: sbcast")
TRAILER = struct.Struct("<qqq")  # each unit ends with: its offset (-1: stop), length, size
_MESSAGE = UNIT + TRAILER.size
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_NAME = 64  # bytes per node in the final gather: "1" (took it) or "0", then its name


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
    """The header from the root to every member: a length, then that many bytes."""
    data = header.encode() if header is not None else b""
    length = bytearray(struct.pack("<q", len(data)))
    team.Bcast([length, mpi.BYTE], root=0)
    (count,) = struct.unpack("<q", length)
    if not 0 < count <= HEADER_MAX:
        return b""
    buffer = bytearray(data) if header is not None else bytearray(count)
    team.Bcast([buffer, mpi.BYTE], root=0)
    return bytes(buffer)


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
    """The batch host: send every unit its fetch checked (or the entry it held)."""
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
    _bcast_header(mpi, team, header if fd is not None else None)
    try:
        sent = header is not None and fd is not None and _send_units(
            mpi, team, header, fd, prefix, following)
    finally:
        if fd is not None:
            os.close(fd)
    names = bytearray(_NAME * team.Get_size())
    team.Gather([bytearray(_NAME), mpi.BYTE], [names, mpi.BYTE], root=0)
    nodes = [names[i:i + _NAME].rstrip(b"\0").decode(errors="replace")
             for i in range(_NAME, len(names), _NAME)]
    took = sorted(n[1:] for n in nodes if n.startswith("1"))
    fetch_here = sorted(n[1:] for n in nodes if not n.startswith("1"))
    what = f"{header.blob[:19]}… ({human_bytes(header.size)})" if header else "nothing"
    say(f"{here}: broadcast {what}{'' if sent else ', stopped early'} in "
        f"{time.monotonic() - started:.1f} s: "
        f"{len(took)} node(s) took it ({', '.join(took) or 'none'})"
        + (f"; fetching for themselves: {', '.join(fetch_here)}" if fetch_here else ""))
    return fetch.result()


def _send_units(mpi: Any, team: Any, header: Header, fd: int, prefix: Prefix,
                following: bool) -> bool:
    """Send every unit of the file ``fd`` reads (``following``: as the fetch checks it);
    False when the fetch stopped first (the receivers were told)."""
    buffer = bytearray(_MESSAGE)
    for index in range(header.units()):
        offset, length = index * UNIT, header.unit_length(index)
        ready = not following or prefix.wait(header.blob, offset + length) \
            or _same_file(fd, prefix.entry, header.size)
        if ready and os.preadv(fd, [memoryview(buffer)[:length]], offset) == length:
            TRAILER.pack_into(buffer, UNIT, offset, length, header.size)
        else:
            ready = False
            TRAILER.pack_into(buffer, UNIT, -1, 0, header.size)
        team.Bcast([buffer, mpi.BYTE], root=0)
        if not ready:
            return False
    return True


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
    """A node without the entry: every unit into its own partial download, written and
    hashed as it arrives; the entry, or why not."""
    here = socket.gethostname()
    receiver: Receiver | None = None
    why = ""
    raw = _bcast_header(mpi, team, None)
    try:
        if not raw:
            raise RelayError("the batch host has no copy to send")
        header = Header.decode(raw)
        header.check(pins)
        receiver = Receiver(header, cache.partial_download(header.blob),
                            cache.fetched(repository, header.blob), cache.entry_mode,
                            spare=TRAILER.size)
    except (RelayError, ImgpipeError, OSError) as exc:
        why = f"nothing this node can take came ({exc})"
    buffer = receiver.buffer() if receiver is not None else bytearray(_MESSAGE)
    while raw:
        team.Bcast([buffer, mpi.BYTE], root=0)
        offset, length, size = TRAILER.unpack_from(buffer, UNIT)
        last = offset < 0 or offset + length >= size or not 0 < length <= UNIT
        if receiver is not None and not why:
            if offset != receiver.queued or length != receiver.header.unit_length(
                    offset // UNIT) or size != receiver.header.size:
                why = "the batch host stopped sending" if offset < 0 else \
                    f"a unit at byte {offset} of {size} came out of order"
            else:
                receiver.put(buffer, length)
                buffer = receiver.buffer()
        if last:
            break
    copy: Path | str = why
    if receiver is not None:
        copy = receiver.abandon(why) if why else receiver.finish()
    name = (b"1" if isinstance(copy, Path) else b"0") + here.encode()[:_NAME - 1]
    team.Gather([bytearray(name.ljust(_NAME, b"\0")), mpi.BYTE], None, root=0)
    return copy


