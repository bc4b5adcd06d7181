"""How a relayed squashfs travels between the nodes of one job (``enroot.distribution:
broadcast``): a chain along the nodes in order, the file cut into segments of SEGMENT bytes
that every node forwards to the next as each one lands, over any point-to-point link that
posts sends and receives and says which are done (``commands.node.broadcast``: MPI's
``Isend`` and ``Irecv``).

Why not one blocking ``Bcast`` per 8 MiB unit, as issue #56 did: Open MPI's pipeline
broadcast (coll/base ``bcast_intra_generic``, a chain of 4 MiB segments) posts a unit's
receives only inside its call, so a node that forwards the unit's last segment has no
receive posted for the next unit; its parent's next send (a rendezvous above TCP's 64 KiB
eager limit) waits for the receive and then for an acknowledgement that leaves through the
node's own busy link.  Each node alternated receiving and sending, a collective at a time.
Here every node keeps WINDOW receives posted ahead and WINDOW sends in flight, so its link in
and its link out are busy at once, and a segment costs each hop SEGMENT bytes of delay
(the model: time ≈ one node's + hops × that), not a unit's.

Every message has one size (SEGMENT bytes and a TRAILER: where they belong, how long, the
whole file's size; offset -1 says the sender stops), so a node that takes nothing (it holds
no pin, it refused a byte) still forwards every message to the end, and nobody waits for a
message that never comes.  Waits poll the link and sleep between polls (``Pacer``: from
NAP_MIN doubling to NAP_MAX), so N waiting nodes on one machine do not spin its cores; a node
that sees nothing move for ``stall_s`` gives up (``StalledError``) rather than hold the job.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from imgpipe.base.errors import ImgpipeError

SEGMENT = 256 << 10  # bytes per message: what each hop adds to the time (1 ms at 2 Gbit/s)
TRAILER = struct.Struct("<qqq")  # each message ends with: its offset (-1: stop), length, size
MESSAGE = SEGMENT + TRAILER.size
WINDOW = 32  # messages in flight on each link (8 MiB): more than a link's queue holds
NAP_MIN, NAP_MAX = 50e-6, 1e-3  # seconds between polls of a link where nothing moved
STALL_S = 600.0  # a receiving node gives up after this long without a message moving


class StalledError(ImgpipeError):
    """Nothing moved on a node's links for longer than it waits."""


class Link(Protocol):
    """One node's connections in the chain: from the node before it, to the node after."""

    def receive(self, buffer: bytearray) -> object:
        """A receive of the next message into ``buffer``, posted (not waited for)."""

    def send(self, buffer: bytearray) -> object:
        """A send of ``buffer`` to the next node, posted (not waited for)."""

    def completed(self, pending: list[object]) -> list[int]:
        """Move what can move; the indices in ``pending`` of what is done."""

    def cancel(self, request: object) -> None:
        """Withdraw a posted receive that no message will fill, and wait for it."""


def stamp(message: bytearray | memoryview, offset: int, length: int, size: int) -> None:
    TRAILER.pack_into(message, SEGMENT, offset, length, size)


def trailer(message: bytearray | memoryview) -> tuple[int, int, int]:
    """A message's (offset, length, size)."""
    offset, length, size = TRAILER.unpack_from(message, SEGMENT)
    return offset, length, size


def is_last(offset: int, length: int, size: int) -> bool:
    """Whether a message ends the stream: a stop, a length no message has, or the end."""
    return offset < 0 or not 0 < length <= SEGMENT or offset + length >= size


def segment_count(size: int) -> int:
    return -(-size // SEGMENT)


class Pacer:
    """The waits of a node whose links have nothing to do: a nap that doubles from NAP_MIN
    to ``nap_max`` and starts over once something moves; past ``stall_s`` without a move,
    StalledError naming ``what`` it waited for."""

    def __init__(self, stall_s: float = STALL_S, nap_max: float = NAP_MAX,
                 nap: Callable[[float], object] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s, self.nap_max, self._nap, self._clock = stall_s, nap_max, nap, clock
        self._delay = NAP_MIN
        self._since = clock()
        self.naps = 0

    def moved(self) -> None:
        self._delay, self._since = NAP_MIN, self._clock()

    def idle(self, what: str, stall: bool = True) -> None:
        """Nap; ``stall``: False where the wait is for something with its own deadlines
        (the batch host's fetch), which never counts as a stall."""
        if not stall:
            self._since = self._clock()
        elif self._clock() - self._since > self.stall_s:
            raise StalledError(f"nothing moved for {self.stall_s:.0f} s waiting for {what}")
        self._nap(self._delay)
        self.naps += 1
        self._delay = min(self._delay * 2, self.nap_max)


@dataclass
class Moved:
    """What one node's part of the stream did: messages, and when the first and last came
    (or went, at the sender), in seconds since the epoch."""

    count: int = 0
    first_at: float = 0.0
    last_at: float = 0.0

    def mark(self) -> None:
        now = time.time()
        self.first_at = self.first_at or now
        self.last_at = now
        self.count += 1


def send(link: Link, fill: Callable[[bytearray, int], bool | None],
         window: int = WINDOW, pacer: Pacer | None = None) -> Moved:
    """The first node: ``fill(buffer, index)`` writes message ``index`` (its bytes and
    trailer) and says whether it is the last (None: not ready yet, asked again after a nap);
    each is sent as soon as it is filled, up to ``window`` in flight."""
    pacer = pacer or Pacer()
    free = [bytearray(MESSAGE) for _ in range(window)]
    sending: list[tuple[object, bytearray]] = []
    moved, ended = Moved(), False
    while not ended or sending:
        progress = False
        if sending:
            done = set(link.completed([request for request, _ in sending]))
            if done:
                free.extend(buffer for i, (_, buffer) in enumerate(sending) if i in done)
                sending = [item for i, item in enumerate(sending) if i not in done]
                progress = True
        while not ended and free:
            last = fill(free[-1], moved.count)
            if last is None:
                break
            buffer = free.pop()
            sending.append((link.send(buffer), buffer))
            moved.mark()
            ended, progress = last, True
        if progress:
            pacer.moved()
        elif sending:
            pacer.idle("the next node to take a message")
        else:
            pacer.idle("the batch host's fetch", stall=False)
    return moved


@dataclass
class _Slot:
    buffer: bytearray
    receiving: object
    received: bool = False
    sending: object | None = None  # a send posted and not yet done


@dataclass
class _Ring:
    """The messages a forwarding node holds, by their index in the stream."""

    free: list[bytearray]
    slots: dict[int, _Slot] = field(default_factory=dict)
    low: int = 0  # the first index still held
    posted: int = 0  # receives posted: indices below it
    forwarded: int = 0  # received and sent on (or seen, at the last node)
    taken: int = 0  # handed to ``take``
    end: int | None = None  # the index of the last message, once it came


def forward(link: Link, take: Callable[[bytearray], bool], downstream: bool,
            window: int = WINDOW, pacer: Pacer | None = None) -> Moved:
    """A node after the first: receive every message, send each on to the next node as it
    lands (``downstream``), and hand it to ``take`` in order (False: not now, asked again;
    the receives still run up to ``window`` ahead).  Returns once the last message is sent
    on and taken; raises StalledError where nothing moves for the pacer's ``stall_s``."""
    pacer = pacer or Pacer()
    ring, moved = _Ring([bytearray(MESSAGE) for _ in range(2 * window)]), Moved()
    while ring.end is None or ring.low <= ring.end:
        while ring.end is None and ring.free and ring.posted - ring.taken < window:
            buffer = ring.free.pop()
            ring.slots[ring.posted] = _Slot(buffer, link.receive(buffer))
            ring.posted += 1
        progress = _progress(link, ring)
        while ring.end is None and ring.forwarded < ring.posted \
                and ring.slots[ring.forwarded].received:
            slot = ring.slots[ring.forwarded]
            if downstream:
                slot.sending = link.send(slot.buffer)
            moved.mark()
            if is_last(*trailer(slot.buffer)):
                ring.end = ring.forwarded
                _withdraw(link, ring)
            ring.forwarded += 1
            progress = True
        while ring.taken < ring.forwarded and take(ring.slots[ring.taken].buffer):
            ring.taken += 1
            progress = True
        while ring.low < ring.taken and ring.slots[ring.low].sending is None:
            ring.free.append(ring.slots.pop(ring.low).buffer)
            ring.low += 1
        if progress:
            pacer.moved()
        else:
            pacer.idle("this node's disk" if ring.taken < ring.forwarded
                       else "the node before this one" if ring.forwarded < ring.posted
                       else "the node after this one")
    return moved


def _progress(link: Link, ring: _Ring) -> bool:
    """Ask the link what is done among the posted receives and sends; whether any was."""
    held = [ring.slots[i] for i in range(ring.low, ring.posted)]
    waiting = [(slot, False) for slot in held if not slot.received] + \
        [(slot, True) for slot in held if slot.sending is not None]
    if not waiting:
        return False
    done = link.completed([slot.sending if sent else slot.receiving for slot, sent in waiting])
    for index in done:
        slot, sent = waiting[index]
        if sent:
            slot.sending = None
        else:
            slot.received = True
    return bool(done)


def _withdraw(link: Link, ring: _Ring) -> None:
    """The receives posted past the last message: withdrawn, their buffers free."""
    assert ring.end is not None
    for index in range(ring.end + 1, ring.posted):
        slot = ring.slots.pop(index)
        if not slot.received:
            link.cancel(slot.receiving)
        ring.free.append(slot.buffer)
    ring.posted = ring.end + 1
