"""Byte counts on long transfers: plain lines at most every few seconds, a redrawn line on a
terminal at most once a second, nothing with --json; every count names size and rate."""

from __future__ import annotations

import io

import pytest

from imgpipe.base import progress as progress_module
from imgpipe.base.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    made = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", made)
    return made


def test_plain_lines_show_bytes_share_and_rate_at_most_every_five_seconds(clock) -> None:
    out = io.StringIO()
    advance = Progress("plain", out).transfer("push imgpipe/bert:1", 100 << 20)
    for _ in range(20):  # 20 MiB over 20 s: one chunk a second
        clock.now += 1.0
        advance(1 << 20)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines  # at 1, 6, 11 and 16 s
    assert lines[0].endswith("push imgpipe/bert:1: 1.0 MiB of 100.0 MiB (1%) at 1.0 MiB/s")
    assert lines[-1].endswith("push imgpipe/bert:1: 16.0 MiB of 100.0 MiB (16%) at 1.0 MiB/s")


def test_the_end_of_a_known_total_is_always_shown(clock) -> None:
    out = io.StringIO()
    advance = Progress("plain", out).transfer("fetch imgpipe/bert", 3 << 20)
    advance(1 << 20)
    clock.now += 0.5
    advance(1 << 20)  # too soon: not shown
    clock.now += 0.5
    advance(1 << 20)  # the last byte: shown however soon
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "3.0 MiB of 3.0 MiB (100%)" in lines[-1]


def test_json_output_is_left_alone(clock) -> None:
    out = io.StringIO()
    advance = Progress("quiet", out).transfer("squash", None)
    clock.now += 10
    advance(1 << 30)
    assert out.getvalue() == ""


def test_an_unknown_total_shows_bytes_and_rate(clock) -> None:
    out = io.StringIO()
    advance = Progress("plain", out).transfer("push x:1", None)
    clock.now += 2
    advance(4 << 20)
    assert out.getvalue().splitlines()[0].endswith("push x:1: 4.0 MiB at 2.0 MiB/s")


def test_a_count_past_its_estimate_raises_it_and_keeps_the_rate_limit(clock) -> None:
    """A squash's estimate (9.1 GiB) that the output passes (9.3 GiB) printed a line on every
    write, counting to 103 %: 29,569 lines in six seconds.  Now the estimate is raised, no
    share passes 100 %, and lines keep to one every 5 s in a log."""
    out = io.StringIO()
    advance = Progress("plain", out).transfer("squash", 100 << 20)
    for _ in range(60_000):  # 300 MiB in 5 KiB writes over 12 s
        clock.now += 0.0002
        advance(5 << 10)
    lines = out.getvalue().splitlines()
    assert 2 <= len(lines) <= 4, lines[:5]  # the first, at 100 %, then one every 5 s
    shares = [int(line.rsplit("(", 1)[1].split("%")[0]) for line in lines]
    assert max(shares) <= 100
    assert "of ~" in lines[-1]


def test_a_terminal_count_past_its_estimate_redraws_at_most_once_a_second(clock) -> None:
    out = io.StringIO()
    shown: list[str] = []
    progress = Progress("plain", out)
    progress.detail = shown.append  # type: ignore[method-assign]
    progress.mode = "tty"
    advance = progress.transfer("squash", 1 << 20)
    for _ in range(10_000):  # 4 MiB over 4 s
        clock.now += 0.0004
        advance(420)
    assert len(shown) <= 6, shown[:8]
