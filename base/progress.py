"""Progress for long work, respecting the terminal.

On a terminal: one status line redrawn in place at most once a second, with
finished steps printed above it.  Not on a terminal: plain timestamped lines.
With --json: nothing (the envelope on stdout is the whole answer).
Progress always goes to stderr.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Literal, TextIO

if TYPE_CHECKING:
    from rich.status import Status

Mode = Literal["tty", "plain", "quiet"]


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

    def step(self, text: str) -> None:
        """A milestone: always shown (unless quiet)."""
        if self.mode == "quiet":
            return
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

    def done(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _plain(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} {text}", file=self.stream, flush=True)
