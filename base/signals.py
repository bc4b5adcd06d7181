"""SIGTERM as an exception that unwinds like Ctrl-C.

Its own module, importing only ``signal``: the Pyxis importer installs it on every ``get``,
whose answer is most of a job's start, before it knows whether it will convert.
"""

from __future__ import annotations

import signal


class Terminated(BaseException):
    """SIGTERM reached imgpipe: unwinds like Ctrl-C, so temporaries are removed and
    children killed on the way out (a BaseException: no ``except Exception`` stops it)."""


def raise_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` (the CLI installs this; tests do not)."""
    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


class sigterm_ends_at_once:  # noqa: N801 (used as a function: ``with sigterm_ends_at_once():``)
    """SIGTERM's default action (the process ends there and then) inside the block: for C
    calls that block without coming back to Python, such as MPI's start or a collective
    waiting on a peer that died.  The handler above runs only once such a call returns,
    which it never does then: a broadcast step that lost a task waited for Slurm's
    KillWait (30 s) and SIGKILL before its second try could start (issue #61).  A class,
    not contextlib's decorator: this module imports ``signal`` alone."""

    def __enter__(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)
