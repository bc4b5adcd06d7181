"""`imgpipe nccl check`: an nccl-tests (or the PyTorch benchmark's) log judged against a
cluster profile's expected bus bandwidth, with the transport NCCL chose per rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError
from imgpipe.recipes.nccl import Run, Verdict, parse, verdict_line
from imgpipe.recipes.nccl import check as judge
from imgpipe.recipes.ncclinfo import TransportReport, analyze
from imgpipe.recipes.profiles import Profile, load_profile

__all__ = ["NcclCheck", "check_log", "site_profile", "verdict_line"]


@dataclass(frozen=True)
class NcclCheck:
    profile: Profile
    runs: list[Run]
    verdicts: list[Verdict]
    transport: TransportReport


def site_profile(settings: Settings, name: str) -> Profile:
    """A shipped profile, or one of the site's (recipes.profiles_dir)."""
    folder = settings.recipes.profiles_dir
    return load_profile(name, settings.path(folder) if folder else None)


def check_log(settings: Settings, log: Path, profile_name: str, plot: Path | None = None
              ) -> NcclCheck:
    """Judge every run of ``log``; with ``plot``, draw the last one's bus bandwidth."""
    profile = site_profile(settings, profile_name)
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read {log}: {exc.strerror}") from exc
    runs = parse(text)
    if not runs:
        raise ConfigError(f"{log} holds no nccl-tests results",
                          hint="pass the output of all_reduce_perf (or the PyTorch benchmark)")
    verdicts = judge(runs, profile.busbw_gbs)
    if plot is not None:
        from imgpipe.recipes.plot import plot_busbw  # matplotlib: imported on use

        plot_busbw(runs[-1], verdicts[-1], plot, f"nccl-tests against profile {profile.name}")
    return NcclCheck(profile, runs, verdicts, analyze(text))
