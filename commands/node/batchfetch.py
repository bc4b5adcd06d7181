"""The batch host's fetch in a broadcast (``commands.node.broadcast``): ``get`` in a process
of its own, forked before MPI starts, that tells the broadcast each chunk it has checked."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from imgpipe.base.errors import ImgpipeError
from imgpipe.commands.node.importer import get
from imgpipe.enroot.published.relay import Prefix
from imgpipe.registry.chunks import Checked


class BatchFetch:
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
