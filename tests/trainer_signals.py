"""What a test that runs the trainer's ``pretrain.main`` in its own process must give back."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def handlers_kept() -> Iterator[None]:
    """pretrain.main takes SIGTERM, SIGUSR1 and SIGUSR2 for itself: give them back."""
    kept = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for number, handler in kept.items():
            signal.signal(number, handler)
        faulthandler.unregister(signal.SIGUSR2)
