"""nccl-tests output: parsing, recomputing bandwidths, and judging them against a profile.

Rows: ``size count type redop root | time algbw busbw #wrong`` out of place, then
the same in place; time in µs, bandwidth in GB/s (1e9 bytes).  ``algbw = size /
time`` and ``busbw = algbw × factor``, with all_reduce's factor 2(n−1)/n,
reduce_scatter / all_gather / alltoall (n−1)/n, broadcast / reduce / sendrecv 1
(n ranks).  Lines may carry srun's ``-l`` prefix (``12: ``); a log may hold
several runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

SRUN_PREFIX = re.compile(r"^\s*\d+:\s?")
ROW = re.compile(
    r"^\s*(?P<size>\d+)\s+(?P<count>\d+)\s+(?P<type>\w+)\s+(?P<redop>\w+)\s+(?P<root>-?\d+)"
    r"\s+(?P<t1>[\d.]+)\s+(?P<a1>[\d.]+)\s+(?P<b1>[\d.]+)\s+(?P<w1>\S+)"
    r"\s+(?P<t2>[\d.]+)\s+(?P<a2>[\d.]+)\s+(?P<b2>[\d.]+)\s+(?P<w2>\S+)\s*$")
RANK_LINE = re.compile(r"^#\s+Rank\s+(\d+)\s+Group")
OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)\s*(OK|FAILED)")
AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([\d.]+)")
START = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
SETTINGS = re.compile(r"^#\s*(nThread\s+.*)$")
SETTING_KEYS = {"nThread": r"nThread\s+(\S+)", "nGpus": r"nGpus\s+(\S+)",
                "minBytes": r"minBytes\s+(\S+)", "maxBytes": r"maxBytes\s+(\S+)",
                "step": r"step:\s*(\S+)", "warmup_iters": r"warmup iters:\s*(\S+)",
                "iters": r"(?<!warmup )(?<!agg )iters:\s*(\S+)",
                "agg_iters": r"agg iters:\s*(\S+)", "validation": r"validation:\s*(\S+)",
                "graph": r"graph:\s*(\S+)"}
FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
    "hypercube": lambda n: (n - 1) / n,
}


@dataclass(frozen=True)
class Placement:
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None  # None when printed as N/A (-c 0)


@dataclass
class Row:
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    out_of_place: Placement
    in_place: Placement
    mismatches: list[str] = field(default_factory=list)


@dataclass
class Run:
    collective: str
    ranks: int
    settings: dict[str, str]
    rows: list[Row]
    out_of_bounds: int | None = None
    oob_ok: bool | None = None
    avg_busbw: float | None = None

    @property
    def factor(self) -> float:
        return FACTORS.get(self.collective, FACTORS["all_reduce"])(max(self.ranks, 1))

    def large_rows(self) -> list[Row]:
        """The rows within a factor 8 of the largest size: where a fabric shows its rate."""
        if not self.rows:
            return []
        largest = max(row.size for row in self.rows)
        return [row for row in self.rows if row.size * 8 >= largest]

    @property
    def peak_busbw(self) -> float:
        return max((row.out_of_place.busbw for row in self.large_rows()), default=0.0)


def _collective(name: str) -> str:
    name = name.rsplit("/", 1)[-1]
    return name.removesuffix("_perf").removesuffix("_mpi")


def _placement(time: str, algbw: str, busbw: str, wrong: str) -> Placement:
    return Placement(float(time), float(algbw), float(busbw),
                     None if wrong == "N/A" else int(wrong))


def _settings(text: str) -> dict[str, str]:
    found = {}
    for key, pattern in SETTING_KEYS.items():
        if match := re.search(pattern, text):
            found[key] = match.group(1)
    return found


def parse(text: str, default_collective: str = "all_reduce") -> list[Run]:
    """Every run in a log, in order."""
    runs: list[Run] = []
    current: Run | None = None
    pending_name = default_collective
    for raw in text.splitlines():
        line = SRUN_PREFIX.sub("", raw, count=1) if SRUN_PREFIX.match(raw) else raw
        if match := START.match(line):
            pending_name = _collective(match.group(1))
            current = None
            continue
        if match := SETTINGS.match(line):
            current = Run(pending_name, 0, _settings(match.group(1)), [])
            runs.append(current)
            continue
        if current is None:
            if ROW.match(line):  # rows without a header: still a run
                current = Run(pending_name, 0, {}, [])
                runs.append(current)
            else:
                continue
        if RANK_LINE.match(line):
            current.ranks += 1
        elif match := ROW.match(line):
            g = match.groupdict()
            current.rows.append(Row(int(g["size"]), int(g["count"]), g["type"], g["redop"],
                                    int(g["root"]), _placement(g["t1"], g["a1"], g["b1"], g["w1"]),
                                    _placement(g["t2"], g["a2"], g["b2"], g["w2"])))
        elif match := OOB.match(line):
            current.out_of_bounds = int(match.group(1))
            current.oob_ok = match.group(2) == "OK"
        elif match := AVG.match(line):
            current.avg_busbw = float(match.group(1))
            pending_name = default_collective
            current = None
    for run in runs:
        _recompute(run)
    return runs


def _recompute(run: Run) -> None:
    """Flag rows whose printed bandwidths disagree with size and time (2-decimal printing)."""
    for row in run.rows:
        for label, placement in (("out-of-place", row.out_of_place),
                                 ("in-place", row.in_place)):
            if placement.time_us <= 0:
                continue
            algbw = row.size / placement.time_us / 1e3
            busbw = algbw * run.factor
            for what, printed, computed in (("algbw", placement.algbw, algbw),
                                            ("busbw", placement.busbw, busbw)):
                if abs(printed - computed) > 0.011 + 0.01 * computed:
                    row.mismatches.append(f"{label} {what} printed {printed:g}, "
                                          f"recomputed {computed:.3f}")


@dataclass(frozen=True)
class Verdict:
    status: str  # pass | warn | fail
    reason: str
    collective: str
    ranks: int
    out_of_bounds: int
    avg_busbw: float
    peak_busbw: float
    expected_busbw: float
    mismatched_rows: int


def check(runs: list[Run], expected_busbw: float, warn_fraction: float = 0.9,
          fail_fraction: float = 0.7) -> list[Verdict]:
    """pass / warn / fail for each run, with the numbers and a one-line reason."""
    verdicts = []
    for run in runs:
        oob = run.out_of_bounds or 0
        mismatched = sum(1 for row in run.rows if row.mismatches)
        peak = run.peak_busbw
        avg = run.avg_busbw if run.avg_busbw is not None else 0.0
        if not run.rows:
            status, reason = "fail", "no result rows in the log"
        elif oob or run.oob_ok is False or any(
                (p.wrong or 0) for row in run.rows for p in (row.out_of_place, row.in_place)):
            status, reason = "fail", f"{oob} out-of-bounds value(s): results are wrong"
        elif peak < fail_fraction * expected_busbw:
            status, reason = "fail", (f"peak bus bandwidth {peak:.2f} GB/s is below "
                                      f"{fail_fraction:.0%} of the expected "
                                      f"{expected_busbw:g} GB/s")
        elif peak < warn_fraction * expected_busbw:
            status, reason = "warn", (f"peak bus bandwidth {peak:.2f} GB/s is below "
                                      f"{warn_fraction:.0%} of the expected "
                                      f"{expected_busbw:g} GB/s")
        elif mismatched:
            status, reason = "warn", (f"{mismatched} row(s) print bandwidths that disagree "
                                      "with size and time")
        else:
            status, reason = "pass", (f"peak bus bandwidth {peak:.2f} GB/s meets the "
                                      f"expected {expected_busbw:g} GB/s")
        verdicts.append(Verdict(status, reason, run.collective, run.ranks, oob, avg, peak,
                                expected_busbw, mismatched))
    return verdicts


def verdict_line(verdict: Verdict, nodes: int | None = None) -> str:
    """``PASS: all_reduce on 8 rank(s) / 2 node(s): …``: the line users and scripts read."""
    where = f" / {nodes} node(s)" if nodes else ""
    return (f"{verdict.status.upper()}: {verdict.collective} on {verdict.ranks} rank(s)"
            f"{where}: {verdict.reason}")
