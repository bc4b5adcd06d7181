"""`imgpipe report RESULTS_DIR`: plots and one HTML page of a BERT workflow's results."""

from __future__ import annotations

from pathlib import Path

import click

from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result


@click.command(name="report", context_settings=CONTEXT)
@click.argument("results_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Folder for the plots and index.html [default: RESULTS_DIR/report].")
@click.option("--profile", "profile_name", default=None,
              help="Cluster profile whose bus bandwidth the NCCL plot and verdict expect "
              "[default: the one the NCCL job was rendered for].")
@reporting
def report(ctx: click.Context, results_dir: Path, output: Path | None,
           profile_name: str | None) -> Result:
    """Plots and one HTML page of a BERT workflow's results.

    Training loss, MLM accuracy and throughput against step for both phases, NCCL bus
    bandwidth against message size with the expected level, as PNGs and one
    self-contained index.html (with the job table and pinned digests when the workflow
    left a workflow.json).

    \b
    Examples:
      imgpipe report /lustre/bert/results
      imgpipe report build/demo/results -o /tmp/report --profile dgx-a100
    """
    from imgpipe.commands.builds.report import make_report

    made = make_report(settings_of(ctx), results_dir, output, profile_name)
    nccl = made["summary"].get("nccl")
    lines = ([f"nccl: {nccl['judged_against']}"] if nccl else []) \
        + [f"report: {made['report']}"] + [f"  plot: {p}" for p in made["plots"]]
    for phase, numbers in made["summary"].items():
        if phase.startswith("phase"):
            lines.append(f"  {phase}: {numbers['steps']} steps, loss {numbers['first_loss']}"
                         f" -> {numbers['final_loss']}")
    if nccl:
        lines.append(f"  nccl: {nccl['line']}")
    return Result(made, lines)
