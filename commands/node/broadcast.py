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
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.signals import sigterm_ends_at_once
from imgpipe.commands.node.audit import record
from imgpipe.commands.node.importer import BROADCAST_AHEAD_ENV, fast_get, get, say
from imgpipe.commands.node.nodesite import node_site
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.published.chain import StalledError
from imgpipe.enroot.published.pins import Pins

if TYPE_CHECKING:
    from imgpipe.commands.node.batchfetch import BatchFetch

DEBIAN_MPI4PY = Path("/usr/lib/python3/dist-packages/mpi4py")
MPI_HINT = ("apt-get install openmpi-bin python3-mpi4py (and libpmix-dev, which Slurm's "
            "pmix plugin loads), or set enroot.distribution: sbcast")


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
    first_task = os.environ.get("SLURM_PROCID") == "0"
    # a hit on the batch host is the ahead fetch's line in the site's audit log, not ours too
    found = fast_get(uri, None if first_task and os.environ.get(BROADCAST_AHEAD_ENV)
                     else "broadcast")
    # The step's first task runs on the batch host and sends (MPI's rank 0 under srun):
    # its fetch starts at once, while the other nodes' tasks still start.
    fetch = _batch_fetch(uri, found) if first_task else None
    with sigterm_ends_at_once():  # MPI's start blocks in C: a step that ends kills it there
        mpi = load_mpi()
    world = mpi.COMM_WORLD
    here = socket.gethostname()
    pins = Pins.from_env().for_image(manifest)
    root = world.Get_rank() == 0
    if root and fetch is None:
        fetch = _batch_fetch(uri, found)
    if fetch is not None:
        fetch.follow()
        if not root:  # not the sender after all: this node has fetched
            found, fetch = fetch.result(), None
    with contextlib.ExitStack() as held:
        cache = site.cache
        why = None if found is not None or root else _hold(held, cache, manifest, pins)
        taking = root or (found is None and why is None)
        with sigterm_ends_at_once():  # a collective: blocks in C until every task is in it
            team = world.Split(0 if taking else mpi.UNDEFINED, world.Get_rank())
        from imgpipe.commands.node import chainstep  # once MPI has started (its docstring)

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
                return chainstep.send_from_batch_host(mpi, team, fetch, pins, here,
                                                      site.host)
            copy = chainstep.receive(mpi, team, cache, ref.repository, pins, site.host)
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


def _batch_fetch(uri: str, found: Path | None) -> BatchFetch:
    """The batch host's fetch: imported by its task alone, before MPI starts."""
    from imgpipe.commands.node.batchfetch import BatchFetch

    return BatchFetch(uri, found)
