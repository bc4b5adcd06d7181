"""The batch host's fetch in a broadcast (``commands.node.broadcast``): ``get`` in a process
of its own that tells the broadcast each chunk it has checked.

The recipes start it with the job (``ahead URI FOLDER``, in the background of the batch
script, before the broadcast's ``srun``): it fetches while srun starts a task on every node
and their MPI comes up, which costs the chain its start (2 s for 16 tasks on the sandbox's 2
cores; on a real cluster it grows with the node count), and writes its words to
``FOLDER/fetch``, which the step's first task follows (``IMGPIPE_BROADCAST_AHEAD`` names the
folder).  Where no such fetch runs on this host (an older recipe, another node order), the
first task forks the fetch itself, before MPI starts.

Its words are JSON lines: a first one naming the host, the image, the process and when it
began; one per chunk it checked (its blob, partial file, size, chunk size and how far it has
checked; the chunk list once); its entry; and its exit code last.  It holds a lock on the
file while it lives: the follower's sign that more may come."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from imgpipe.base.errors import ImgpipeError
from imgpipe.commands.node.importer import BROADCAST_AHEAD_ENV, _quick, fast_get, get
from imgpipe.registry.chunks import Checked

AHEAD_ENV = BROADCAST_AHEAD_ENV  # the folder of the fetch the job started ahead
WORDS = "fetch"  # the file in that folder the fetch writes its words to
_NAP_S = 0.005  # how long the follower sleeps when the fetch has said nothing new
AHEAD_WAIT_S = 5.0  # how long the first task waits for the words of a fetch started ahead


class BatchFetch:
    """The batch host's fetch (nothing when it holds the entry): the one the job started
    ahead, followed, else one forked here before MPI starts (Open MPI's start beside a
    thread already running crashed the task (SIGSEGV) in the sandbox).  It tells ``prefix``
    what it has checked, and its entry last."""

    def __init__(self, uri: str, found: Path | None) -> None:
        # the step's modules: imported here, by the task that follows, not by the fetch
        # started ahead, whose CPU before its first request is the chain's start (#61)
        from imgpipe.enroot.published.relay import Prefix

        self.prefix = Prefix()
        self.failed = False
        self.started = time.monotonic()
        self.began = time.time()
        self._pid, self._pipe, self._ahead = 0, -1, -1
        self.ahead = False  # the fetch the job started ahead, followed
        if found is not None:
            self.prefix.finish(found)
            return
        ahead = _ahead_words(uri)
        if ahead is not None:
            (self._ahead, first), self.ahead = ahead, True
            self.began = float(first["began"])
            self.started -= max(0.0, time.time() - self.began)
            return
        read, write = os.pipe()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child fetches and never returns into the caller
            code = 1
            try:
                os.close(read)
                with os.fdopen(write, "wb", buffering=0) as out:
                    code = _fetch_and_tell(uri, out)
            finally:
                os._exit(code)
        os.close(write)
        self._pid, self._pipe = pid, read

    def follow(self) -> None:
        """Hear the fetch (a thread: start it once MPI has started)."""
        if self._ahead >= 0:
            threading.Thread(target=self._follow_ahead, name="broadcast-fetch",
                             daemon=True).start()
        elif self._pipe >= 0:
            threading.Thread(target=self._hear, name="broadcast-fetch", daemon=True).start()

    def _hear(self) -> None:
        entry: Path | None = None
        digests: tuple[str, ...] = ()
        with os.fdopen(self._pipe, "rb") as words:
            for line in words:
                entry, digests = self._take(json.loads(line), entry, digests)
        _, status = os.waitpid(self._pid, 0)
        self.failed = status != 0 or entry is None
        self.prefix.finish(None if self.failed else entry)

    def _follow_ahead(self) -> None:
        """Read the ahead fetch's words as it writes them, to its exit line (or to its end
        without one: the process gone, its lock with it).  Anything that goes wrong ends it as
        failed: the sender is never left waiting."""
        entry: Path | None = None
        code = 1
        try:
            entry, code = self._read_ahead()
        except Exception:  # noqa: BLE001 (words that do not parse: the fetch failed)
            code = 1
        finally:
            self.failed = code != 0 or entry is None
            self.prefix.finish(None if self.failed else entry)

    def _read_ahead(self) -> tuple[Path | None, int]:
        entry: Path | None = None
        digests: tuple[str, ...] = ()
        rest = b""
        with os.fdopen(self._ahead, "rb", buffering=0) as words:
            while True:
                block = words.read(1 << 16)
                if not block:
                    if _writing(self._ahead):
                        time.sleep(_NAP_S)
                        continue
                    block = words.read(1 << 16)  # what it wrote just before it ended
                    if not block:
                        return entry, 1
                *lines, rest = (rest + block).split(b"\n")
                for line in lines:
                    word = json.loads(line)
                    if not isinstance(word, dict):
                        return entry, 1
                    if "exit" in word:
                        return entry, int(word["exit"])
                    entry, digests = self._take(word, entry, digests)

    def _take(self, word: dict[str, Any], entry: Path | None, digests: tuple[str, ...]
              ) -> tuple[Path | None, tuple[str, ...]]:
        if "entry" in word:
            return Path(word["entry"]), digests
        digests = tuple(word.get("digests", digests))
        self.prefix(Checked(word["blob"], Path(word["partial"]), word["size"],
                            word["chunk_size"], digests, word["upto"]))
        return entry, digests

    def result(self) -> Path:
        """The entry, once the fetch is over; ImgpipeError else (the fetch said why)."""
        entry = self.prefix.ended()
        if self.failed or entry is None:
            raise ImgpipeError("the batch host's fetch failed (said above)")
        return entry


def fetch_ahead(uri: str, folder: str) -> int:
    """``ahead URI FOLDER``: the batch host's fetch, started with the job; its words go to
    FOLDER/fetch (FOLDER: this user's own, made by ``mktemp -d``).  Its exit code."""
    if not _own_folder(folder):
        print(f"imgpipe: error: {folder} is not a folder of this user's alone (mktemp -d "
              "makes one)", file=sys.stderr)
        return 1
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(os.path.join(folder, WORDS), flags, 0o600), "wb",
                   buffering=0) as out:
        # held while this process lives (a kill lets go of it too): the follower's sign
        # that words may still come
        fcntl.flock(out.fileno(), fcntl.LOCK_EX)
        out.write(json.dumps({"host": socket.gethostname(), "uri": uri, "pid": os.getpid(),
                              "began": time.time()}).encode() + b"\n")
        code = 1
        try:
            _head_start(uri)
            code = _fetch_and_tell(uri, out)
        finally:
            out.write(json.dumps({"exit": code}).encode() + b"\n")
    return code


def _head_start(uri: str) -> None:
    """Ask for the job's pinned squashfs at once (``registry.headstart``), where the site's
    registry is a plain one and this host holds no entry of it: the fetch takes the answer
    when its client is ready, 1.3 s later on a host busy starting the step's tasks."""
    from imgpipe.enroot.published.pins import Pins
    from imgpipe.registry.headstart import begin, plain_site
    from imgpipe.registry.reference import Reference

    try:
        quick = _quick()
        if quick is None or not plain_site(quick):
            return
        ref = Reference.parse(uri, default_registry=quick["address"])
        pins = Pins.from_env().for_image(ref.digest or "")
        if ref.registry != quick["address"] or len(pins) != 1 or fast_get(uri) is not None:
            return
        begin(quick["scheme"], quick["address"], ref.repository, next(iter(pins)))
    except Exception:  # only ever a head start: the fetch, with its errors, decides
        return


def _ahead_words(uri: str) -> tuple[int, dict[str, Any]] | None:
    """The words of the fetch the job started ahead on this host for ``uri``: the file, open
    at its second line, and its first line; None where there is none to follow (no folder
    named, not this user's, another host's or image's fetch, one that failed: a second try
    of the step fetches anew)."""
    folder = os.environ.get(AHEAD_ENV, "")
    if not folder.startswith("/") or not _own_folder(folder):
        return None
    deadline = time.monotonic() + AHEAD_WAIT_S  # it was started first: its first line comes
    while True:
        try:
            fd = os.open(os.path.join(folder, WORDS),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        except OSError:
            return None
        if fd >= 0:
            try:
                info = os.fstat(fd)
                first = _first_line(fd) if stat.S_ISREG(info.st_mode) and \
                    info.st_uid == os.getuid() else None
                if first is not None:
                    if first.get("host") == socket.gethostname() \
                            and first.get("uri") == uri \
                            and isinstance(first.get("began"), float) \
                            and not _failed(fd):
                        return fd, first
                    os.close(fd)
                    return None  # another host's, or not a fetch's words
            except (OSError, ValueError):
                os.close(fd)
                return None
            os.close(fd)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def _own_folder(folder: str) -> bool:
    """Whether ``folder`` is a folder of this user's that nobody else may write to."""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() \
        and not info.st_mode & 0o077


def _first_line(fd: int) -> dict[str, Any] | None:
    """The file's first line as JSON (written at once by the fetch's first write), the fd
    left just past it; None where it is not there yet or not an object."""
    head = os.pread(fd, 4096, 0)
    line, newline, _ = head.partition(b"\n")
    if not newline:
        return None
    os.lseek(fd, len(line) + 1, os.SEEK_SET)
    word = json.loads(line)
    return word if isinstance(word, dict) else None


def _writing(fd: int) -> bool:
    """Whether the ahead fetch still holds its words file's lock (it lives; a zombie or a
    killed process does not hold it).  Probed through our own open file: a shared lock
    taken at once means nobody writes; it is let go of at once."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _failed(fd: int) -> bool:
    """Whether the words written so far end with a failed fetch's exit line."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, 256), max(0, size - 256))
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        word = json.loads(last)
    except ValueError:
        return False
    return isinstance(word, dict) and word.get("exit", 0) != 0


def _fetch_and_tell(uri: str, out: BinaryIO) -> int:
    """The fetch: ``get`` with each checked chunk told on ``out``; its exit code."""
    told = False

    def tell(checked: Checked) -> None:
        nonlocal told
        word: dict[str, object] = {
            "blob": checked.blob, "partial": str(checked.partial), "size": checked.size,
            "chunk_size": checked.chunk_size, "upto": checked.upto}
        if not told:  # the chunk list once (up to 4,096 digests)
            word["digests"], told = list(checked.digests), True
        try:
            out.write(json.dumps(word).encode() + b"\n")
        except BrokenPipeError:  # the task gone (its MPI start crashed, the step was
            os._exit(1)  # killed): no fetch or conversion goes on for nobody

    try:
        entry = get(uri, verified=tell, event="broadcast")
    except (ImgpipeError, OSError) as exc:
        print(f"imgpipe: error: {exc}", file=sys.stderr, flush=True)
        return 1
    out.write(json.dumps({"entry": str(entry)}).encode() + b"\n")
    return 0
