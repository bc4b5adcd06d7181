"""`imgpipe report`: a results folder as plots and one self-contained page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from imgpipe.base.config import Settings
from imgpipe.commands.site.nccl import site_profile
from imgpipe.recipes.report import write_report

__all__ = ["make_report"]


def make_report(settings: Settings, results_dir: Path, output: Path | None,
                profile_name: str | None) -> dict[str, Any]:
    """The report of ``results_dir`` (in ``output``, default RESULTS/report), the NCCL check
    judged against ``profile_name``'s expected bus bandwidth, by default against the profile
    the NCCL job was rendered for."""
    if profile_name is None:
        return write_report(results_dir, output)
    profile = site_profile(settings, profile_name)
    return write_report(results_dir, output, (profile.name, profile.busbw_gbs))
