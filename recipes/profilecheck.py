"""A profile against the node it runs on: partitions, InfiniBand devices, GPUs, cores.

A site's profile is typed by hand from a spec sheet; a wrong HCA name makes NCCL skip that
rail, a wrong partition makes every sbatch wait forever.  ``check`` asks the node itself
(``sinfo``, ``/sys/class/infiniband``, ``nvidia-smi``, the CPU count) and names each mismatch;
what cannot be asked here (no Slurm client, no GPU driver) is said, not guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.base import process
from imgpipe.base.errors import ImgpipeError
from imgpipe.recipes.profiles import Profile

INFINIBAND = Path("/sys/class/infiniband")
CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class NodeFacts:
    """What this node says about itself; None where it cannot be asked here."""

    partitions: list[str] | None
    hcas: list[str] | None
    gpus: list[tuple[str, int]] | None  # (name, memory in MiB) per GPU
    cores: int  # logical CPUs (hardware threads)
    physical_cores: int | None = None  # cores, each counted once however many threads it runs


@dataclass(frozen=True)
class ProfileCheck:
    profile: str
    mismatches: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    matched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def node_facts(infiniband: Path = INFINIBAND, cpus: Path = CPUS) -> NodeFacts:
    return NodeFacts(_partitions(), sorted(p.name for p in infiniband.iterdir())
                     if infiniband.is_dir() else None, _gpus(), os.cpu_count() or 1,
                     physical_cores(cpus))


def physical_cores(cpus: Path = CPUS) -> int | None:
    """Cores, each counted once: distinct (package, core) pairs of the kernel's CPU topology;
    None where the kernel does not say."""
    seen: set[tuple[str, str]] = set()
    for topology in cpus.glob("cpu[0-9]*/topology"):
        try:
            seen.add(((topology / "physical_package_id").read_text().strip(),
                      (topology / "core_id").read_text().strip()))
        except OSError:
            continue
    return len(seen) or None


def _partitions() -> list[str] | None:
    if process.which("sinfo") is None:
        return None
    try:
        listed = process.run(["sinfo", "-h", "-o", "%R"], timeout=30, what="sinfo").stdout
    except ImgpipeError:
        return None
    return sorted({line.strip() for line in listed.splitlines() if line.strip()})


def _gpus() -> list[tuple[str, int]] | None:
    if process.which("nvidia-smi") is None:
        return None
    try:
        listed = process.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], timeout=60,
                             what="nvidia-smi").stdout
    except ImgpipeError:
        return None
    gpus = []
    for line in listed.splitlines():
        name, _, memory = line.rpartition(",")
        if name.strip() and memory.strip().isdigit():
            gpus.append((name.strip(), int(memory.strip())))
    return gpus


def check(profile: Profile, facts: NodeFacts) -> ProfileCheck:
    """Each of the profile's claims against ``facts``: a line per mismatch."""
    result = ProfileCheck(profile.name)
    _check_partition(profile, facts, result)
    _check_hcas(profile, facts, result)
    _check_gpus(profile, facts, result)
    _check_cores(profile, facts, result)
    return result


def _check_cores(profile: Profile, facts: NodeFacts, result: ProfileCheck) -> None:
    """cores_per_node may count cores or hardware threads (spec sheets say cores, Slurm's
    CPUs counts threads): either matches, and the line says which."""
    physical = facts.physical_cores
    if profile.cores_per_node == physical:
        threads = f" ({facts.cores} hardware threads)" if facts.cores != physical else ""
        result.matched.append(f"cores_per_node: {physical} cores{threads}")
    elif profile.cores_per_node == facts.cores:
        result.matched.append(f"cores_per_node: {facts.cores} logical CPUs")
    else:
        cores = f"{physical} cores, " if physical and physical != facts.cores else ""
        result.mismatches.append(f"cores_per_node: the profile says {profile.cores_per_node}, "
                                 f"this node has {cores}{facts.cores} logical CPUs")


def _check_partition(profile: Profile, facts: NodeFacts, result: ProfileCheck) -> None:
    if facts.partitions is None:
        result.unchecked.append("partition: no sinfo answered here (run it on a login node)")
    elif profile.partition not in facts.partitions:
        result.mismatches.append(f"partition: the profile says {profile.partition}, sinfo "
                                 f"lists {', '.join(facts.partitions) or 'none'}")
    else:
        result.matched.append(f"partition: {profile.partition}")


def _check_hcas(profile: Profile, facts: NodeFacts, result: ProfileCheck) -> None:
    if facts.hcas is None:
        if profile.hcas:
            result.unchecked.append(f"hcas: no {INFINIBAND} here (run it on a compute node)")
        return
    missing = [h for h in profile.hcas if h not in facts.hcas]
    unused = [h for h in facts.hcas if h not in profile.hcas]
    if missing:
        result.mismatches.append(f"hcas: the profile names {', '.join(missing)}, which this "
                                 f"node lacks (it has {', '.join(facts.hcas) or 'none'})")
    if not missing:
        result.matched.append(f"hcas: {', '.join(profile.hcas) or 'none'}")
    if unused:  # storage and management HCAs: left out of NCCL's rails on purpose
        result.unchecked.append(f"hcas: this node also has {', '.join(unused)}, which the "
                                "profile leaves out: NCCL will not use them (right for storage "
                                "or management HCAs; add compute rails to the profile's hcas)")


def _check_gpus(profile: Profile, facts: NodeFacts, result: ProfileCheck) -> None:
    if facts.gpus is None:
        if profile.is_gpu:
            result.unchecked.append("gpus: no nvidia-smi here (run it on a compute node)")
        elif facts.cores:
            result.matched.append("gpus: none, as the profile says")
        return
    if len(facts.gpus) != profile.gpus_per_node:
        result.mismatches.append(f"gpus_per_node: the profile says {profile.gpus_per_node}, "
                                 f"nvidia-smi lists {len(facts.gpus)}")
    memory_gb = {round(mib / 1024) for _, mib in facts.gpus}
    if facts.gpus and not any(abs(gb - profile.gpu.memory_gb) <= max(2, gb // 10)
                              for gb in memory_gb):
        result.mismatches.append(f"gpu.memory_gb: the profile says {profile.gpu.memory_gb}, "
                                 f"the GPUs have {', '.join(map(str, sorted(memory_gb)))}")
    if not result.mismatches:
        result.matched.append(f"gpus: {len(facts.gpus)} x {facts.gpus[0][0] if facts.gpus else ''}")
