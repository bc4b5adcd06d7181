"""Checkpoints: atomic files ``<output_dir>/phase<N>/ckpt_<step>.pt``, the last K kept.

A checkpoint holds everything an exact resume needs: model, optimizer (LAMB
moments and step), loss scaler, scheduler, and per rank the data position and
the RNG states.  Files are written to a temporary name in the same directory,
flushed, then renamed, so a job killed mid-write leaves the previous checkpoint
as the latest.  Only tensors, numbers, strings and containers are stored, so
``torch.load(weights_only=True)`` reads them.
"""

from __future__ import annotations

import os
import random
import re
import socket
from pathlib import Path

import torch

FORMAT = 1
NAME = re.compile(r"^ckpt_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or from an incompatible run."""


def phase_dir(output_dir: Path, phase: int) -> Path:
    return output_dir / f"phase{phase}"


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest(folder: Path) -> Path | None:
    found = checkpoints(folder)
    return found[-1][1] if found else None


def save(folder: Path, step: int, payload: dict, keep: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"ckpt_{step}.pt"
    tmp = folder / f".ckpt_{step}.pt.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    for _, old in checkpoints(folder)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    for leftover in folder.glob(".ckpt_*.pt.tmp-*"):  # from runs killed mid-write
        if not leftover.name.endswith(f"-{socket.gethostname()}-{os.getpid()}"):
            leftover.unlink(missing_ok=True)
    return final


def load(path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint ({exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a checkpoint of this trainer (format {FORMAT})")
    return payload


def rng_state(device: torch.device) -> dict:
    version, state, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "python": [version, list(state), gauss]}


def restore_rng(saved: dict, device: torch.device) -> None:
    torch.set_rng_state(saved["torch"])
    if device.type == "cuda" and saved.get("cuda") is not None:
        torch.cuda.set_rng_state(saved["cuda"], device)
    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
