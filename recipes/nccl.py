"""nccl-tests output: parsing, recomputing bandwidths, and judging them against a profile.

Every vintage of the output is read, by its own column header (the ``# size count …``
line before the rows):

* 2.13 and newer: ``size count type redop root | time algbw busbw #wrong`` out of
  place, then in place; ``#wrong`` an integer, or ``N/A`` when checking is off (``-c 0``);
  2.19's per-iteration columns (``i_min i_max i_p99 i_cv%``) and trailing timestamps
  are read past.
* 2.0 to 2.12 (what DeepOps' validation guide shows): ``size count type redop`` (or
  ``root`` for broadcast and reduce) ``| time algbw busbw error``, the error a float such
  as ``0e+00`` or ``N/A``.
* 1.x: ``bytes N type op | time algbw busbw res``, time in milliseconds.

Time in µs (1.x's ms converted), bandwidth in GB/s (1e9 bytes).  ``algbw = size / time``
and ``busbw = algbw × factor``, with all_reduce's factor 2(n−1)/n, reduce_scatter /
all_gather / alltoall (n−1)/n, broadcast / reduce / sendrecv 1 (n ranks, counted from
the ``# Rank N …`` device lines of any vintage).  Lines may carry srun's ``-l`` prefix
(``12: ``); a log may hold several runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

SRUN_PREFIX = re.compile(r"^\s*\d+:\s?")
RANK_LINE = re.compile(r"^#\s+Rank\s+(\d+)\b")
# The column header: "# size count type redop root time algbw busbw #wrong time …",
# "# bytes N type op time …" (1.x); the first column named time (or cputime) starts the
# out-of-place columns.
HEADER = re.compile(r"^#\s*(size|bytes)\s+(count|N)\s+type\b.*\balgbw\b")
OOB = re.compile(r"^#?\s*Out of bounds values\s*:\s*(\d+)\s*(OK|FAILED)")
AVG = re.compile(r"^#?\s*Avg bus bandwidth\s*:\s*([\d.eE+-]+)")
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
    wrong: int | None  # wrong elements (2.13+); None when printed as N/A (-c 0) or older
    max_delta: float | None = None  # 1.x and 2.0-2.12: largest difference from the expected
    time_error_us: float = 0.0  # half the last printed digit of the time (1.x prints ms)


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


@dataclass(frozen=True)
class Columns:
    """Where a vintage's row keeps what: the leading columns, the width of one placement
    (time, algbw, busbw, wrong and any per-iteration statistics), the time unit."""

    leading: tuple[str, ...] = ("size", "count", "type", "redop", "root")
    per_placement: int = 4
    time_to_us: float = 1.0
    check: str = "#wrong"  # or "error" (2.0-2.12), "res" (1.x): a float, the largest delta

    @classmethod
    def from_header(cls, line: str) -> Columns:
        names = line.lstrip("#").split()
        first_time = next(i for i, name in enumerate(names) if name in ("time", "cputime"))
        second_time = next((i for i, name in enumerate(names)
                            if i > first_time and name in ("time", "cputime")), None)
        width = (second_time - first_time) if second_time else 4
        leading = tuple(names[:first_time])
        return cls(leading, width, 1000.0 if leading[0] == "bytes" else 1.0,
                   names[first_time + 3])

    def row(self, line: str) -> Row | None:
        """The row ``line`` holds, or None when it is not one of this layout's rows."""
        tokens = line.split()
        lead = len(self.leading)
        if len(tokens) < lead + 2 * self.per_placement:
            return None
        try:
            size, count = int(tokens[0]), int(tokens[1])
            named = dict(zip(self.leading, tokens[:lead], strict=True))
            first = self._placement(tokens[lead:lead + 4])
            second = self._placement(tokens[lead + self.per_placement:
                                            lead + self.per_placement + 4])
        except ValueError:
            return None
        root = named.get("root", "-1")
        return Row(size, count, tokens[2], named.get("redop", named.get("op", "none")),
                   int(root) if root.lstrip("-").isdigit() else -1, first, second)

    def _placement(self, fields: list[str]) -> Placement:
        time, algbw, busbw, checked = fields
        numbers = (float(time) * self.time_to_us, float(algbw), float(busbw))
        decimals = len(time.partition(".")[2])
        error = 0.5 * 10.0 ** -decimals * self.time_to_us
        if checked == "N/A":
            return Placement(*numbers, None, None, error)
        if self.check == "#wrong":
            return Placement(*numbers, int(float(checked)), None, error)
        return Placement(*numbers, None, float(checked), error)


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
    columns = Columns()
    devices = 0  # rank lines before a run starts (1.x prints them before any settings line)
    for raw in text.splitlines():
        line = SRUN_PREFIX.sub("", raw, count=1) if SRUN_PREFIX.match(raw) else raw
        if match := START.match(line):
            pending_name = _collective(match.group(1))
            current = None
            continue
        if match := SETTINGS.match(line):
            current = Run(pending_name, devices, _settings(match.group(1)), [])
            runs.append(current)
            devices = 0
            continue
        if HEADER.match(line):
            columns = Columns.from_header(line)
            continue
        row = None if line.startswith("#") else columns.row(line)
        if current is None:
            if RANK_LINE.match(line):
                devices += 1
            if row is None:
                continue
            current = Run(pending_name, devices, {}, [])  # rows without a settings line
            runs.append(current)
            devices = 0
        if RANK_LINE.match(line):
            current.ranks += 1
        elif row is not None:
            current.rows.append(row)
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
            # the time as printed may be off by half its last digit: so may the rates
            spread = placement.time_error_us / placement.time_us
            for what, printed, computed in (("algbw", placement.algbw, algbw),
                                            ("busbw", placement.busbw, busbw)):
                if abs(printed - computed) > 0.011 + (0.01 + spread) * computed:
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
