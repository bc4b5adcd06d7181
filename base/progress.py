"""Progress for long work, respecting the terminal.

On a terminal: one status line redrawn in place at most once a second, with
finished steps printed above it.  Not on a terminal: plain timestamped lines.
With --json: nothing (the envelope on stdout is the whole answer).
Progress always goes to stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TextIO

from imgpipe.base.terminal import safe_line
from imgpipe.base.units import human_bytes

if TYPE_CHECKING:
    from rich.status import Status

Mode = Literal["tty", "plain", "quiet"]
PLAIN_EVERY_S = 5.0  # byte counts in a log: often enough to see it moving, not a flood


def choose_mode(json_output: bool, stream: TextIO | None = None) -> Mode:
    if json_output:
        return "quiet"
    stream = stream or sys.stderr
    return "tty" if stream.isatty() else "plain"


class Progress:
    """Reports steps (kept) and transient details (the latest one shown)."""

    def __init__(self, mode: Mode, stream: TextIO | None = None) -> None:
        self.mode = mode
        self.stream = stream or sys.stderr
        self._console: Any = None
        if mode == "tty":
            from rich.console import Console  # rich is slow to import: terminals only

            self._console = Console(file=self.stream)
        self._status: Status | None = None
        self._last_draw = 0.0
        self._last_count = 0.0  # when a byte counter's line was last shown

    def step(self, text: str) -> None:
        """A milestone: always shown (unless quiet)."""
        if self.mode == "quiet":
            return
        text = safe_line(text)  # the last guard: no control character reaches a screen
        if self._console is not None:
            self._console.print(text, highlight=False, markup=False)
        else:
            self._plain(text)

    def detail(self, text: str) -> None:
        """A passing detail (a build log line): redrawn in place on a terminal."""
        if self.mode == "quiet" or not text.strip():
            return
        if self._console is None:
            self._plain("  " + text)
            return
        now = time.monotonic()
        if self._status is None:
            self._status = self._console.status(text[:150], refresh_per_second=1)
            self._status.start()
        elif now - self._last_draw >= 1.0:
            self._status.update(text[:150])
            self._last_draw = now

    def transfer(self, what: str, total: int | None) -> Callable[[int], None]:
        """A counter for bytes moving (push, fetch, squash): ``advance(n)`` after each chunk.

        Shows ``what: 512.0 MiB of 1.2 GiB (41%) at 98.1 MiB/s``: on a terminal redrawn at
        most once a second, as plain lines at most every ``PLAIN_EVERY_S``, never quietly.
        ``total`` may be an estimate (a squash's output): a count past it raises it by a
        tenth (shown as ``of ~…``) rather than showing more than 100 %, and the line forced
        when the count reaches the total is forced once.  Counters running at once (a
        conversion squashes while it fetches) share that rate.
        """
        started = time.monotonic()
        moved = [0]
        estimate = [total]  # raised when the count passes it: never more than 100 %
        at_end = [False]  # the line at the estimate is forced once, not on every write after

        def advance(count: int) -> None:
            moved[0] += count
            if self.mode == "quiet":
                return
            if estimate[0] and moved[0] > estimate[0]:
                estimate[0] = moved[0] + moved[0] // 10
            now = time.monotonic()
            every = 1.0 if self.mode == "tty" else PLAIN_EVERY_S
            reached = bool(estimate[0]) and moved[0] >= (estimate[0] or 0) and not at_end[0]
            if now - self._last_count < every and not reached:
                return  # counters running at once (fetch and squash) share the rate
            at_end[0] = at_end[0] or reached
            self._last_count = now
            rate = moved[0] / max(now - started, 1e-6)
            raised = "~" if estimate[0] != total else ""
            of = (f" of {raised}{human_bytes(estimate[0])} "
                  f"({100 * moved[0] / estimate[0]:.0f}%)" if estimate[0] else "")
            self.detail(f"{what}: {human_bytes(moved[0])}{of} at {human_bytes(int(rate))}/s")

        return advance

    def done(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _plain(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} {text}", file=self.stream, flush=True)
