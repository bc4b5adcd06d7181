"""The broadcast's chain without a cluster (enroot.published.chain): nodes as threads joined
by real TCP connections on 127.0.0.1, made the way the broadcast makes them (listen, the
token, connect, accept), and what flows through them: every byte to every node in order, a
slow disk that holds the stream back without losing it, a stop, a node that only passes
bytes on, a node whose sender never sends or hangs up, and a stranger who connects first."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest

from imgpipe.enroot.published.chain import (
    ENDPOINT,
    MESSAGE,
    SEGMENT,
    TOKEN,
    Moved,
    StalledError,
    accept,
    connect,
    forward,
    is_last,
    listen,
    own_address,
    read_endpoint,
    segment_count,
    send,
    stamp,
    trailer,
)

TOKEN_BYTES = b"t" * TOKEN


def _filler(data: bytes, stop_at: int | None = None) -> Callable[[bytearray, int], bool]:
    def fill(buffer: bytearray, index: int) -> bool:
        offset = index * SEGMENT
        if stop_at is not None and index == stop_at:
            stamp(buffer, -1, 0, len(data))
            return True
        length = min(SEGMENT, len(data) - offset)
        buffer[:length] = data[offset:offset + length]
        stamp(buffer, offset, length, len(data))
        return offset + length >= len(data)
    return fill


class _Taker:
    """A node's disk: keeps the bytes it takes, in order; ``slow`` sleeps on each message
    (the chain waits for it, nothing is lost)."""

    def __init__(self, slow: bool = False) -> None:
        self.data = bytearray()
        self.messages = 0
        self.slow = slow

    def take(self, message: bytearray) -> None:
        if self.slow:
            time.sleep(0.01)
        offset, length, _ = trailer(message)
        if offset >= 0:
            assert offset == len(self.data)
            self.data += message[:length]
        self.messages += 1


def _run_chain(data: bytes, nodes: int, stop_at: int | None = None,
               takers: list[_Taker] | None = None) -> tuple[Moved, list[Moved]]:
    """A batch host and nodes - 1 receivers, each connected as the broadcast connects them."""
    takers = takers or [_Taker() for _ in range(nodes - 1)]
    made = [listen("127.0.0.1") for _ in range(nodes - 1)]
    endpoints = [read_endpoint(endpoint) for _, endpoint in made]
    results: list[Moved | BaseException | None] = [None] * (nodes - 1)

    def node(place: int) -> None:
        try:
            out = connect(endpoints[place + 1], TOKEN_BYTES, stall_s=20) \
                if place + 1 < len(made) else None
            inp = accept(made[place][0], TOKEN_BYTES, stall_s=20, wait_s=20)
            results[place] = forward(inp, out, takers[place].take)
            inp.close()
            if out is not None:
                out.close()
        except BaseException as exc:  # said by the test
            results[place] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in range(nodes - 1)]
    for thread in threads:
        thread.start()
    with connect(endpoints[0], TOKEN_BYTES, stall_s=20) as out:
        sent = send(out, _filler(data, stop_at))
    for thread in threads:
        thread.join(30)
    for listener, _ in made:
        listener.close()
    assert all(not t.is_alive() for t in threads)
    for result in results:
        assert isinstance(result, Moved), result
    return sent, [r for r in results if isinstance(r, Moved)]


def test_every_node_gets_every_byte_in_order_though_one_disk_is_slow() -> None:
    data = os.urandom(13 * SEGMENT + 1234)  # 14 messages, the last short
    takers = [_Taker(), _Taker(slow=True), _Taker()]
    sent, moved = _run_chain(data, 4, takers=takers)
    assert sent.count == segment_count(len(data)) == 14
    assert [m.count for m in moved] == [14, 14, 14]
    assert all(t.data == data for t in takers)
    assert all(m.first_at <= m.last_at for m in moved)


def test_a_stop_ends_every_node() -> None:
    data = os.urandom(20 * SEGMENT)
    takers = [_Taker(), _Taker()]
    sent, moved = _run_chain(data, 3, stop_at=5, takers=takers)
    assert sent.count == 6 and [m.count for m in moved] == [6, 6]
    assert all(t.data == data[:5 * SEGMENT] for t in takers)


def test_a_node_that_takes_nothing_still_passes_everything_on() -> None:
    data = os.urandom(3 * SEGMENT)
    passing, last = _Taker(), _Taker()
    passing.take = lambda message: None  # type: ignore[method-assign]
    _run_chain(data, 3, takers=[passing, last])
    assert passing.data == b"" and last.data == data


def test_a_one_message_file_and_the_last_message_rules() -> None:
    data = b"x" * 100
    taker = _Taker()
    sent, moved = _run_chain(data, 2, takers=[taker])
    assert sent.count == moved[0].count == 1 and taker.data == data
    assert is_last(-1, 0, 10) and is_last(0, 10, 10) and is_last(0, 0, 10)
    assert is_last(0, SEGMENT + 1, 10 * SEGMENT) and not is_last(0, SEGMENT, 2 * SEGMENT)


def test_a_node_whose_sender_never_sends_or_hangs_up_gives_up() -> None:
    listener, endpoint = listen("127.0.0.1")
    with listener, connect(read_endpoint(endpoint), TOKEN_BYTES) as quiet:
        inp = accept(listener, TOKEN_BYTES, stall_s=0.2)
        with pytest.raises(StalledError, match="nothing came from the node before this one"):
            forward(inp, None, _Taker().take)
        quiet.sendall(bytes(MESSAGE // 2))
        quiet.close()
        with pytest.raises(StalledError, match="hung up mid-stream"):
            forward(inp, None, _Taker().take)
        inp.close()


def test_only_the_connection_that_says_the_token_is_taken() -> None:
    listener, endpoint = listen("127.0.0.1")
    where = read_endpoint(endpoint)
    with listener:
        stranger = socket.create_connection(where)  # first in line, the wrong token
        stranger.sendall(b"x" * TOKEN)
        silent = socket.create_connection(where)  # says nothing at all
        with connect(where, TOKEN_BYTES) as node:
            inp = accept(listener, TOKEN_BYTES, wait_s=15, token_s=0.3)
            node.sendall(b"hello")
            assert inp.recv(5) == b"hello"
            inp.close()
        assert stranger.recv(1) == b""  # closed unread
        stranger.close()
        silent.close()
        with pytest.raises(StalledError, match="did not connect within"):
            accept(listener, TOKEN_BYTES, wait_s=0.2)


def test_endpoints_parse_or_are_refused_and_the_address_is_routable() -> None:
    listener, endpoint = listen("127.0.0.1")
    listener.close()
    assert len(endpoint) == ENDPOINT and read_endpoint(endpoint)[0] == "127.0.0.1"
    for bad in (b"", b"nonsense", b"1.2.3.4 0", b"1.2.3.4 99999", b"host.example 80",
                b"1.2.3.4 80; rm -rf /"):
        with pytest.raises(StalledError):
            read_endpoint(bad.ljust(ENDPOINT, b"\0"))
    assert own_address("127.0.0.1") == socket.gethostbyname(socket.gethostname())
    with pytest.raises(StalledError, match="cannot be reached"):
        connect(("127.0.0.1", 1), TOKEN_BYTES)


def test_messages_have_one_size_and_say_where_they_belong() -> None:
    message = bytearray(MESSAGE)
    stamp(message, 3 * SEGMENT, 17, 3 * SEGMENT + 17)
    assert trailer(message) == (3 * SEGMENT, 17, 3 * SEGMENT + 17)
    assert segment_count(1) == 1 and segment_count(SEGMENT) == 1 \
        and segment_count(SEGMENT + 1) == 2
