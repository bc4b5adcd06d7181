"""How a relayed squashfs travels between the nodes of one job (``enroot.distribution:
broadcast``): a chain of TCP connections along the nodes in order, the file cut into
messages of SEGMENT bytes that every node sends on to the next as each one lands
(``commands.node.broadcast`` makes the chain: MPI tells each node where the next one listens).

Why TCP streams and not MPI's messages (issue #61, measured on the sandbox with every link
shaped to 200 Mbit/s): one blocking ``Bcast`` per 8 MiB unit had each node alternate
receiving and sending (1.93x one node's time at 8 hosts); a window of ``Isend``/``Irecv``
requests fixed that on paper but every waiting node polled its requests (MPI moves only
inside a call), so 8-16 nodes on two shared cores spent the cores polling (2.01x at 8 hosts,
a hop 0.4 s).  A node here blocks in the kernel: ``recv_into`` the next message, ``sendall``
it on (the socket's buffers keep the next node's link busy while this one receives), hand it
to ``take``.  A waiting node costs no CPU, and the kernel's own window does the pipelining.

Every message has one size (SEGMENT bytes and a TRAILER: where they belong, how long, the
whole file's size; offset -1 says the sender stops), so a node that takes nothing (it holds
no pin, it refused a byte) still forwards every message to the end, and nobody waits for a
message that never comes.  A connection is taken only from whoever first sends the job's
token (a secret the batch host's MPI rank gave every node); the bytes themselves are still
checked against the pins by every receiver.  A node that sees nothing move for ``STALL_S``,
or whose neighbour hangs up, gives up (``StalledError``) rather than hold the job.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from imgpipe.enroot.errors import ConvertError

SEGMENT = 256 << 10  # bytes per message: what each hop adds to the time (10 ms at 200 Mbit/s)
TRAILER = struct.Struct("<qqq")  # each message ends with: its offset (-1: stop), length, size
MESSAGE = SEGMENT + TRAILER.size
STALL_S = 600.0  # a node gives up after this long without a byte moving
CONNECT_S = 60.0  # how long a node waits for its neighbours to connect
TOKEN_S = 2.0  # how long a connection may take to say the token (the node's own says it at once)
TOKEN = 32  # bytes of the job's secret each connection starts with
ENDPOINT = 64  # bytes per node in the exchange of where each one listens: "address port"


class StalledError(ConvertError):
    """Nothing moved on a node's connections for longer than it waits, or one broke."""


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


def send(out: socket.socket, fill: Callable[[bytearray, int], bool]) -> Moved:
    """The first node: ``fill(buffer, index)`` writes message ``index`` (its bytes and
    trailer; it may wait for them) and says whether it is the last; each is sent on ``out``
    as soon as it is filled."""
    buffer, moved = bytearray(MESSAGE), Moved()
    while True:
        last = fill(buffer, moved.count)
        _send_all(out, buffer, "the next node to take a message")
        moved.mark()
        if last:
            return moved


def forward(inp: socket.socket, out: socket.socket | None,
            take: Callable[[bytearray], object]) -> Moved:
    """A node after the first: receive every message from ``inp``, send each on to ``out``
    (None: the last node) as it lands, then hand it to ``take`` (which copies what it keeps:
    the buffer is reused).  Returns once the last message is sent on and taken."""
    buffer, moved = bytearray(MESSAGE), Moved()
    view = memoryview(buffer)
    while True:
        _receive_exactly(inp, view)
        if out is not None:
            _send_all(out, buffer, "the node after this one")
        moved.mark()
        take(buffer)
        if is_last(*trailer(buffer)):
            return moved


def _receive_exactly(inp: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            count = inp.recv_into(view[got:])
        except TimeoutError:
            raise StalledError(f"nothing came from the node before this one for "
                               f"{inp.gettimeout() or 0:.0f} s") from None
        except OSError as exc:
            raise StalledError(f"the node before this one broke the chain ({exc})") from None
        if count == 0:
            raise StalledError("the node before this one hung up mid-stream")
        got += count


def _send_all(out: socket.socket, buffer: bytearray, what: str) -> None:
    try:
        out.sendall(buffer)
    except TimeoutError:
        raise StalledError(f"nothing moved for {out.gettimeout() or 0:.0f} s waiting for "
                           f"{what}") from None
    except OSError as exc:
        raise StalledError(f"{what} broke the chain ({exc})") from None


def own_address(toward: str, port: int = 9) -> str:
    """This host's address on the route to ``toward`` (the registry's host: every node
    reaches it), as the kernel would pick it; no packet is sent.  The host name's own
    address where that route is the loopback one (a registry on this very host)."""
    with contextlib.suppress(OSError):
        family, kind, proto, _, where = socket.getaddrinfo(toward, port,
                                                           type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)
            address = str(probe.getsockname()[0])
            if not address.startswith("127.") and address != "::1":
                return address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise StalledError(f"this host's address toward {toward} cannot be found ({exc})"
                           ) from None


def listen(address: str) -> tuple[socket.socket, bytearray]:
    """A listening socket on ``address`` (any free port) and the ENDPOINT bytes that tell
    the node before this one where it is."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(8)
    endpoint = f"{address} {listener.getsockname()[1]}".encode()
    return listener, bytearray(endpoint.ljust(ENDPOINT, b"\0"))


def read_endpoint(raw: bytes | bytearray) -> tuple[str, int]:
    """An ENDPOINT slot's (address, port); StalledError where it does not parse (the
    bytes came from an unauthenticated peer)."""
    try:
        address, port = bytes(raw).rstrip(b"\0").decode("ascii").rsplit(" ", 1)
        socket.inet_pton(socket.AF_INET6 if ":" in address else socket.AF_INET, address)
        number = int(port)
    except (ValueError, OSError):
        raise StalledError(f"the next node's address does not parse ({bytes(raw)[:32]!r})"
                           ) from None
    if not 0 < number < 65536:
        raise StalledError(f"the next node's port {number} is no port")
    return address, number


def connect(endpoint: tuple[str, int], token: bytes, stall_s: float = STALL_S
            ) -> socket.socket:
    """The connection to the next node, the job's token sent first."""
    try:
        out = socket.create_connection(endpoint, timeout=CONNECT_S)
        out.sendall(token)
    except OSError as exc:
        raise StalledError(f"the next node at {endpoint[0]}:{endpoint[1]} cannot be reached "
                           f"({exc})") from None
    out.settimeout(stall_s)
    return out


def accept(listener: socket.socket, token: bytes, stall_s: float = STALL_S,
           wait_s: float = CONNECT_S, token_s: float = TOKEN_S) -> socket.socket:
    """The connection from the node before this one: the first that sends the job's token
    within ``wait_s``; any other (a wrong token, nothing within ``token_s``) is closed
    unread past its first TOKEN bytes."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            inp, _ = listener.accept()
        except TimeoutError:
            break
        inp.settimeout(min(left, token_s))
        said = bytearray(TOKEN)
        try:
            _receive_exactly(inp, memoryview(said))
        except StalledError:
            inp.close()
            continue
        if hmac.compare_digest(bytes(said), token):
            inp.settimeout(stall_s)
            return inp
        inp.close()
    raise StalledError(f"the node before this one did not connect within {wait_s:.0f} s")
