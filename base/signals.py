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
