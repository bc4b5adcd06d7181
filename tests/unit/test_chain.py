"""The broadcast's chain without a cluster (enroot.published.chain): nodes as threads, each
link a fake with MPI's rules (receives matched in the order they were posted, a send done
only once a receive took it, a buffer read when it is taken, so a buffer reused too early
shows), and what flows through it: every byte to every node in order, a window that wraps,
a slow disk that holds the stream back without losing it, a stop, a node that only passes
bytes on, a node that waits forever, and the pacer's naps."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable

import pytest

from imgpipe.enroot.published.chain import (
    MESSAGE,
    NAP_MAX,
    NAP_MIN,
    SEGMENT,
    Moved,
    Pacer,
    StalledError,
    forward,
    is_last,
    segment_count,
    send,
    stamp,
    trailer,
)


class _Request:
    def __init__(self, buffer: bytearray | None = None) -> None:
        self.buffer, self.done, self.cancelled = buffer, False, False


class _Pipe:
    """One direction between two nodes: sends and posted receives, matched in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sends: deque[tuple[bytearray, _Request]] = deque()
        self.receives: deque[_Request] = deque()
        self.delivered = 0

    def match(self) -> None:
        with self.lock:
            while self.sends and self.receives:
                data, sent = self.sends.popleft()
                taken = self.receives.popleft()
                assert taken.buffer is not None and len(data) == len(taken.buffer) == MESSAGE
                taken.buffer[:] = data  # read now: a buffer the sender reused shows here
                taken.done = sent.done = True
                self.delivered += 1


class _Link:
    def __init__(self, up: _Pipe | None, down: _Pipe | None) -> None:
        self.up, self.down = up, down

    def receive(self, buffer: bytearray) -> object:
        assert self.up is not None
        request = _Request(buffer)
        with self.up.lock:
            self.up.receives.append(request)
        self.up.match()
        return request

    def send(self, buffer: bytearray) -> object:
        assert self.down is not None
        request = _Request()
        with self.down.lock:
            self.down.sends.append((buffer, request))
        self.down.match()
        return request

    def completed(self, pending: list[object]) -> list[int]:
        for pipe in (self.up, self.down):
            if pipe is not None:
                pipe.match()
        return [i for i, request in enumerate(pending) if isinstance(request, _Request)
                and request.done]

    def cancel(self, request: object) -> None:
        assert self.up is not None and isinstance(request, _Request)
        with self.up.lock:
            assert request in self.up.receives, "only an unmatched receive is withdrawn"
            self.up.receives.remove(request)
        request.cancelled = True


def _filler(data: bytes, stop_at: int | None = None) -> Callable[[bytearray, int], bool | None]:
    def fill(buffer: bytearray, index: int) -> bool | None:
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
    """A node's disk: keeps the bytes it takes, in order; ``slow`` refuses every other
    offer at first (no unit buffer free)."""

    def __init__(self, slow: bool = False) -> None:
        self.data = bytearray()
        self.messages = 0
        self.slow, self._refused = slow, 0

    def take(self, message: bytearray) -> bool:
        if self.slow and self._refused < 50:
            self._refused += 1
            return False
        offset, length, size = trailer(message)
        if offset >= 0:
            assert offset == len(self.data)
            self.data += message[:length]
        self.messages += 1
        return True


def _run_chain(data: bytes, nodes: int, window: int, stop_at: int | None = None,
               takers: list[_Taker] | None = None) -> tuple[Moved, list[Moved], list[_Pipe]]:
    pipes = [_Pipe() for _ in range(nodes - 1)]
    takers = takers or [_Taker() for _ in range(nodes - 1)]
    results: list[Moved | BaseException | None] = [None] * (nodes - 1)

    def node(place: int) -> None:
        link = _Link(pipes[place], pipes[place + 1] if place + 1 < len(pipes) else None)
        try:
            results[place] = forward(link, takers[place].take, place + 1 < len(pipes),
                                     window=window, pacer=Pacer(stall_s=20))
        except BaseException as exc:  # said by the test
            results[place] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in range(nodes - 1)]
    for thread in threads:
        thread.start()
    sent = send(_Link(None, pipes[0]), _filler(data, stop_at), window=window,
                pacer=Pacer(stall_s=20))
    for thread in threads:
        thread.join(30)
    assert all(not t.is_alive() for t in threads)
    for result in results:
        assert isinstance(result, Moved), result
    return sent, [r for r in results if isinstance(r, Moved)], pipes


def test_every_node_gets_every_byte_in_order_through_a_window_that_wraps() -> None:
    data = os.urandom(13 * SEGMENT + 1234)  # 14 messages, the last short: the window of 4
    takers = [_Taker(), _Taker(slow=True), _Taker()]  # wraps three times; one disk is slow
    sent, moved, pipes = _run_chain(data, 4, window=4, takers=takers)
    assert sent.count == segment_count(len(data)) == 14
    assert [m.count for m in moved] == [14, 14, 14]
    assert all(t.data == data for t in takers)
    assert all(not p.sends and not p.receives for p in pipes)  # nothing left posted
    assert all(m.first_at <= m.last_at for m in moved)


def test_a_stop_ends_every_node_and_withdraws_the_receives_posted_past_it() -> None:
    data = os.urandom(20 * SEGMENT)
    takers = [_Taker(), _Taker()]
    sent, moved, pipes = _run_chain(data, 3, window=8, stop_at=5, takers=takers)
    assert sent.count == 6 and [m.count for m in moved] == [6, 6]
    assert all(t.data == data[:5 * SEGMENT] for t in takers)
    assert all(not p.sends and not p.receives for p in pipes)


def test_a_node_that_takes_nothing_still_passes_everything_on() -> None:
    data = os.urandom(3 * SEGMENT)
    passing, last = _Taker(), _Taker()
    passing.take = lambda message: True  # type: ignore[method-assign]
    _run_chain(data, 3, window=2, takers=[passing, last])
    assert passing.data == b"" and last.data == data


def test_a_one_message_file_and_the_last_message_rules() -> None:
    data = b"x" * 100
    taker = _Taker()
    sent, moved, _ = _run_chain(data, 2, window=32, takers=[taker])
    assert sent.count == moved[0].count == 1 and taker.data == data
    assert is_last(-1, 0, 10) and is_last(0, 10, 10) and is_last(0, 0, 10)
    assert is_last(0, SEGMENT + 1, 10 * SEGMENT) and not is_last(0, SEGMENT, 2 * SEGMENT)


def test_a_node_whose_sender_never_sends_gives_up_instead_of_waiting_forever() -> None:
    link = _Link(_Pipe(), None)
    with pytest.raises(StalledError, match="waiting for the node before this one"):
        forward(link, _Taker().take, False, window=2, pacer=Pacer(stall_s=0.05))


def test_the_pacer_naps_longer_while_nothing_moves_and_starts_over_when_something_does(
        ) -> None:
    naps: list[float] = []
    now = [0.0]
    pacer = Pacer(stall_s=10, nap=naps.append, clock=lambda: now[0])
    for _ in range(8):
        pacer.idle("x")
    assert naps[0] == NAP_MIN and naps[1] == 2 * NAP_MIN and naps[-1] == NAP_MAX
    pacer.moved()
    pacer.idle("x")
    assert naps[-1] == NAP_MIN
    now[0] = 11.0
    with pytest.raises(StalledError, match="nothing moved for 10 s waiting for x"):
        pacer.idle("x")
    # the sender waiting for its own fetch (nothing in flight) never stalls
    sender = Pacer(stall_s=0.0, nap=naps.append, clock=lambda: now[0])
    now[0] = 100.0
    sender.idle("the batch host's fetch", stall=False)


def test_messages_have_one_size_and_say_where_they_belong() -> None:
    message = bytearray(MESSAGE)
    stamp(message, 3 * SEGMENT, 17, 3 * SEGMENT + 17)
    assert trailer(message) == (3 * SEGMENT, 17, 3 * SEGMENT + 17)
    assert segment_count(1) == 1 and segment_count(SEGMENT) == 1 \
        and segment_count(SEGMENT + 1) == 2
