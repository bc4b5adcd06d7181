"""Rank, world size and rendezvous from torchrun's variables, else from Slurm's.

Enroot's PyTorch hook sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and
LOCAL_RANK only for images whose environment has PYTORCH_VERSION, and plain
``srun`` sets none of them, so they are derived from ``SLURM_*`` when missing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact host lists: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.match(r"^(?P<prefix>[^\[]*)\[(?P<ranges>[^\]]+)\](?P<suffix>.*)$", part)
        if not match:
            hosts.append(part)
            continue
        for item in match.group("ranges").split(","):
            low, _, high = item.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{match.group('prefix')}{number:0{width}d}{match.group('suffix')}")
    return hosts


def placement(env: dict[str, str] | None = None) -> Placement:
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return Placement(int(env["RANK"]), int(env["WORLD_SIZE"]),
                         int(env.get("LOCAL_RANK", "0")), env.get("MASTER_ADDR", "127.0.0.1"),
                         int(env.get("MASTER_PORT", "29500")))
    if "SLURM_PROCID" in env:
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                or "127.0.0.1")
        job = int(env.get("SLURM_JOB_ID", "0"))
        return Placement(int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", "1")),
                         int(env.get("SLURM_LOCALID", "0")), env.get("MASTER_ADDR", nodes[0]),
                         int(env.get("MASTER_PORT", str(20000 + job % 20000))))
    return Placement(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", "29500")))
