"""nccl-tests output of every vintage, written here with the format strings of the
nccl-tests sources of that vintage (C printf formats, which Python's % formatting shares),
parsed and judged: the right rank count, rows and verdict for each."""

# ruff: noqa: UP031  (the nccl-tests C format strings, kept as they are in its sources)
from __future__ import annotations

import pytest

from imgpipe.recipes.nccl import check, parse, verdict_line

RANKS, HOSTS = 8, 2
FACTOR = 2 * (RANKS - 1) / RANKS  # all_reduce
SIZES = [1 << 20, 1 << 26, 1 << 28, 1 << 30]


def times_for(busbw_gbs: float) -> list[float]:
    """Microseconds each size takes at ``busbw_gbs`` (bus bandwidth) on all_reduce."""
    return [size / (busbw_gbs / FACTOR) / 1e3 for size in SIZES]


def numbers(size: int, time_us: float) -> tuple[float, float]:
    algbw = size / time_us / 1e3
    return algbw, algbw * FACTOR


def time_str(time_us: float) -> str:
    """2.x's timeStr: %7.0f from 10 ms, %7.1f from 100 µs, else %7.2f."""
    if time_us >= 10000.0:
        return "%7.0f" % time_us
    if time_us >= 100.0:
        return "%7.1f" % time_us
    return "%7.2f" % time_us


def devices(line: str) -> str:
    return "".join(line % rank_fields(rank) for rank in range(RANKS))


def rank_fields(rank: int) -> tuple:
    host = f"node{rank // (RANKS // HOSTS)}"
    return rank, host, rank % (RANKS // HOSTS)


def v1(busbw: float, check_on: bool = True) -> str:
    """nccl-tests 1.x: bytes N type op | time (ms) algbw busbw res."""
    out = "# Using devices\n"
    out += "".join("#   Rank %2d on %10s device %2d [0x%02x] %s\n"
                   % (*rank_fields(r), 0x1b + r, "Tesla V100-SXM2-16GB") for r in range(RANKS))
    out += "# %10s  %12s  %6s  %6s        out-of-place                    in-place\n" % (
        "", "", "", "")
    out += "# %10s  %12s  %6s  %6s  %7s  %5s  %5s  %7s  %7s  %5s  %5s  %7s\n" % (
        "bytes", "N", "type", "op", "time", "algbw", "busbw", "res", "time", "algbw", "busbw",
        "res")
    for size, t in zip(SIZES, times_for(busbw), strict=True):
        out += "%12d  %12d  %6s  %6s" % (size, size // 4, "float", "sum")
        for _ in range(2):
            if check_on:
                out += "  %7.3f  %5.2f  %5.2f  %7.0e" % (t / 1e3, *numbers(size, t), 1e-6)
            else:
                out += "  %7.3f  %5.2f  %5.2f  \tN/A" % (t / 1e3, *numbers(size, t))
        out += "\n"
    out += " Out of bounds values : %d %s\n" % (0, "OK")
    out += " Avg bus bandwidth    : %g %s\n" % (busbw * 0.8, "")
    return out


def v2(busbw: float, check_on: bool = True, collective: str = "all_reduce") -> str:
    """nccl-tests 2.0 to 2.12 (DeepOps' validation guide): size count type redop | time
    algbw busbw error, rank lines without a Group."""
    out = ("# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) "
           "warmup iters: 5 iters: 20 validation: %d \n#\n# Using devices\n" % int(check_on))
    out += "".join("#   Rank %2d Pid %6d on %10s device %2d [0x%02x] %s\n"
                   % (r, 4000 + r, *rank_fields(r)[1:], 0x07 + r, "NVIDIA A100-SXM4-80GB")
                   for r in range(RANKS))
    out += "#\n"
    fourth = "root" if collective == "broadcast" else "redop"
    out += ("# %10s  %12s  %8s  %6s            out-of-place                       in-place"
            "          \n" % ("", "", "", ""))
    out += "# %10s  %12s  %8s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n" % (
        "size", "count", "type", fourth, "time", "algbw", "busbw", "error", "time", "algbw",
        "busbw", "error")
    out += "# %10s  %12s  %8s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n" % (
        "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
        "(GB/s)", "")
    for size, t in zip(SIZES, times_for(busbw), strict=True):
        if collective == "broadcast":
            out += "%12d  %12d  %8s  %6i" % (size, size // 4, "float", 0)
        else:
            out += "%12d  %12d  %8s  %6s" % (size, size // 4, "float", "sum")
        for _ in range(2):
            if check_on:
                out += "  %7s  %6.2f  %6.2f  %5.0e" % (time_str(t), *numbers(size, t), 0.0)
            else:
                out += "  %7s  %6.2f  %6.2f  %5s" % (time_str(t), *numbers(size, t), "N/A")
        out += "\n"
    out += "# Out of bounds values : %d %s\n" % (0, "OK")
    out += "# Avg bus bandwidth    : %g %s\n#\n" % (busbw * 0.8, "")
    return out


def v2_13(busbw: float, wrong: int = 0) -> str:
    """nccl-tests 2.13 to 2.18: size count type redop root | time algbw busbw #wrong."""
    out = ("# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) "
           "warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0\n#\n"
           "# Using devices\n")
    out += "".join("#  Rank %2d Group %2d Pid %6d on %10s device %2d [0x%02x] %s\n"
                   % (r, 0, 4000 + r, *rank_fields(r)[1:], 0x18 + r, "NVIDIA H100 80GB HBM3")
                   for r in range(RANKS))
    out += "#\n"
    out += ("# %10s  %12s  %8s  %6s  %6s           out-of-place                       "
            "in-place          \n" % ("", "", "", "", ""))
    out += "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n" % (
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
        "algbw", "busbw", "#wrong")
    for size, t in zip(SIZES, times_for(busbw), strict=True):
        out += "%12d  %12d  %8s  %6s  %6s" % (size, size // 4, "float", "sum", "%6i" % -1)
        for _ in range(2):
            out += "  %7s  %6.2f  %6.2f  %5d" % (time_str(t), *numbers(size, t), wrong)
        out += "\n"
    out += "# Out of bounds values : %d %s\n" % (wrong, "FAILED" if wrong else "OK")
    out += "# Avg bus bandwidth    : %g %s\n#\n" % (busbw * 0.8, "")
    return out


def v2_19(busbw: float, check_on: bool = True) -> str:
    """nccl-tests 2.19 with per-iteration statistics and timestamps: eight columns per
    placement, a timestamp after the row, PCI bus ids in the rank lines."""
    out = "# Collective test starting: all_reduce_perf\n"
    out += ("# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1073741824 step: 4(factor) "
            "warmup iters: 1 iters: 20 agg iters: 1 validation: 1 graph: 0\n#\n"
            "# Using devices\n")
    out += "".join("#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s\n"
                   % (r, 0, 4000 + r, *rank_fields(r)[1:], 0, 0x18 + r, 0, "NVIDIA H200")
                   for r in range(RANKS))
    out += "#\n"
    out += ("# %10s  %12s  %8s  %6s  %6s              out-of-place (+ per-iteration)        "
            "                        in-place (+ per-iteration)\n" % ("", "", "", "", ""))
    names = ("time", "algbw", "busbw", "#wrong", "i_min", "i_max", "i_p99", "i_cv%")
    out += ("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  "
            "%6s  %6s  %7s  %7s  %7s  %7s %*s\n" % ("size", "count", "type", "redop", "root",
                                                   *names, *names, 19, "timestamp"))
    for size, t in zip(SIZES, times_for(busbw), strict=True):
        out += "%12d  %12d  %8s  %6s  %6s" % (size, size // 4, "float", "sum", "%6i" % -1)
        for _ in range(2):
            algbw, bus = numbers(size, t)
            if check_on:
                out += "  %7s  %6s  %6s  %6g" % (time_str(t), "%6.2f" % algbw, "%6.2f" % bus,
                                                  0.0)
            else:
                out += "  %7s  %6s  %6s    N/A" % (time_str(t), "%6.2f" % algbw, "%6.2f" % bus)
            out += "  %7s  %7s  %7s  %7s" % (time_str(t * 0.9), time_str(t * 1.2),
                                             time_str(t * 1.1), "%7.2f" % 3.5)
        out += " 2026-11-24 03:04:05\n"
    out += "# %-20s : %d %s\n" % ("Out of bounds values", 0, "OK")
    out += "# %-20s : %g %s\n#\n# Collective test concluded: all_reduce_perf\n" % (
        "Avg bus bandwidth", busbw * 0.8, "")
    return out


VINTAGES = {
    "1.x": v1, "1.x -c 0": lambda b: v1(b, check_on=False),
    "2.0-2.12": v2, "2.0-2.12 -c 0": lambda b: v2(b, check_on=False),
    "2.13-2.18": v2_13, "2.19 per-iteration": v2_19,
    "2.19 -c 0": lambda b: v2_19(b, check_on=False),
}


@pytest.mark.parametrize("vintage", sorted(VINTAGES))
def test_every_vintage_passes_at_the_expected_bandwidth(vintage: str) -> None:
    [run] = parse(VINTAGES[vintage](240.0))
    assert run.ranks == RANKS
    assert [row.size for row in run.rows] == SIZES
    for row, time_us in zip(run.rows, times_for(240.0), strict=True):  # 1.x printed ms
        placement = row.out_of_place
        assert placement.time_us == pytest.approx(time_us, rel=0.01,
                                                  abs=placement.time_error_us * 1.01)
    [verdict] = check([run], expected_busbw=230.0)
    assert verdict.status == "pass", verdict
    assert verdict.peak_busbw == pytest.approx(240.0, rel=0.01)
    assert verdict_line(verdict, HOSTS).startswith("PASS: all_reduce on 8 rank(s) / 2 node(s)")


@pytest.mark.parametrize("vintage", sorted(VINTAGES))
def test_every_vintage_fails_below_seventy_percent(vintage: str) -> None:
    [verdict] = check(parse(VINTAGES[vintage](100.0)), expected_busbw=230.0)
    assert verdict.status == "fail" and verdict.ranks == RANKS
    assert "below 70% of the expected 230 GB/s" in verdict.reason


def test_wrong_elements_fail_in_the_vintage_that_counts_them() -> None:
    [verdict] = check(parse(v2_13(240.0, wrong=3)), expected_busbw=230.0)
    assert verdict.status == "fail" and "out-of-bounds" in verdict.reason


def test_the_older_error_column_is_a_delta_not_a_count() -> None:
    """2.0-2.12 print the largest difference from the expected values (0e+00, 1e-06…),
    not a number of wrong elements: a small float delta is no failure by itself."""
    [run] = parse(v1(240.0))
    assert run.rows[0].out_of_place.wrong is None
    assert run.rows[0].out_of_place.max_delta == pytest.approx(1e-6)
    assert check([run], expected_busbw=230.0)[0].status == "pass"


def test_broadcast_of_the_older_vintage_reads_its_root_column() -> None:
    [run] = parse(v2(240.0, collective="broadcast"), default_collective="broadcast")
    assert [row.root for row in run.rows] == [0] * len(SIZES)
    assert run.ranks == RANKS
