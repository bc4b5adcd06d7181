"""`imgpipe nccl check`: judge nccl-tests (or the PyTorch benchmark's) output against a profile."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.site.nccl import check_log, verdict_line


@click.group(context_settings=CONTEXT)
def nccl() -> None:
    """Cluster validation: read all_reduce_perf logs and judge the fabric.

    \b
    Example:
      srun all_reduce_perf -b 8 -e 8G -f 2 -g 1 | tee nccl.log
      imgpipe nccl check nccl.log --profile dgx-h100 --nodes 4 --plot busbw.png
    """


@nccl.command(name="check", context_settings=CONTEXT)
@click.argument("log", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--profile", "profile_name", required=True, help="Cluster profile whose "
              "expected bus bandwidth the results are judged against.")
@click.option("--nodes", type=click.IntRange(1), default=None,
              help="Nodes the test ran on (for the report).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw bus bandwidth against message size into this PNG.")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too, not only failures.")
@reporting
def check_command(ctx: click.Context, log: Path, profile_name: str, nodes: int | None,
                  plot: Path | None, strict: bool) -> Result:
    """Out-of-bounds values, average and peak bus bandwidth -> pass, warn or fail.

    The peak is the best out-of-place bus bandwidth over the largest messages
    (within a factor 8 of the largest), compared with the profile's expected
    inter-node bus bandwidth: below 90% warns, below 70% fails.  With
    NCCL_DEBUG=INFO lines in the log it also reports, per rank, the transport
    NCCL chose between nodes.  Exit 1 on fail (and on warn with --strict).
    """
    checked = check_log(settings_of(ctx), log, profile_name, plot)
    profile, runs, verdicts, transport = (checked.profile, checked.runs, checked.verdicts,
                                          checked.transport)
    lines = []
    for verdict in verdicts:
        lines.append(verdict_line(verdict, nodes))
        lines.append(f"  out of bounds {verdict.out_of_bounds}, average bus bandwidth "
                     f"{verdict.avg_busbw:.2f} GB/s, peak {verdict.peak_busbw:.2f} GB/s, "
                     f"expected {verdict.expected_busbw:g} GB/s ({profile.name})")
    if transport.status != "none":
        lines.append(f"transport: {transport.status}: {transport.reason}")
        for rank in transport.ranks:
            hcas = ",".join(sorted(rank.hcas)) or "-"
            lines.append(f"  rank {rank.rank:>4} on {rank.host}: {rank.verdict} (HCAs {hcas})")
    if plot is not None:
        lines.append(f"plot: {plot}")
    failed = any(v.status == "fail" for v in verdicts)
    warned = any(v.status == "warn" for v in verdicts) or transport.status == "warn"
    data = {"profile": profile.name, "nodes": nodes,
            "runs": [asdict(v) for v in verdicts],
            "rows": [[asdict(row) for row in run.rows] for run in runs],
            "transport": {"status": transport.status, "reason": transport.reason,
                          "ranks": [{"rank": r.rank, "host": r.host, "verdict": r.verdict,
                                     "hcas": sorted(r.hcas)} for r in transport.ranks]},
            "status": "fail" if failed else "warn" if warned else "pass"}
    return Result(data, lines, ok=not failed and not (strict and warned))


check_command.name = "check"
