"""Platforms (``linux/amd64``, ``linux/arm64``): what an image is built for and a node runs.

One spelling everywhere: OCI's ``os/architecture[/variant]``.  A node's platform is its
kernel's (``uname -m``) unless ``IMGPIPE_PLATFORM`` says otherwise (tests, and hosts whose
kernel name says nothing useful); the same rule serves the importer and the job scripts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from imgpipe.base.errors import ConfigError

PLATFORM_ENV = "IMGPIPE_PLATFORM"
# uname -m -> OCI architecture (and back, for the job scripts' case on `uname -m`)
MACHINES = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}
_PLATFORM_RE = re.compile(r"^([a-z0-9]+)/([a-z0-9_]+)(?:/([a-z0-9]+))?$")

__all__ = ["EMULATED_CPUS", "MACHINES", "PLATFORM_ENV", "Platform", "emulated_cpuinfo",
           "emulation_env", "host_platform", "node_platform", "parse_platforms"]


@dataclass(frozen=True, order=True)
class Platform:
    """An OCI platform; the variant is kept only where it tells builds apart (arm/v7)."""

    os: str = "linux"
    architecture: str = "amd64"
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> Platform:
        """``linux/arm64`` (``linux/arm64/v8`` is the same platform); a bad one is a
        ConfigError naming the form."""
        match = _PLATFORM_RE.match(text.strip())
        if not match:
            raise ConfigError(f"{text!r} is not a platform",
                              hint="write os/architecture, e.g. linux/amd64 or linux/arm64")
        os_name, arch, variant = match.groups()
        if arch == "arm64" and variant == "v8":
            variant = None  # arm64 has one variant: the two spellings are one platform
        return cls(os_name, arch, variant)

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)

    @property
    def machine(self) -> str:
        """What ``uname -m`` prints on a node of this platform (aarch64 for arm64)."""
        return {arch: machine for machine, arch in MACHINES.items()}.get(self.architecture,
                                                                         self.architecture)

    @property
    def tag_suffix(self) -> str:
        """A tag-safe name of the platform: ``arm64``, ``arm-v7``."""
        return "-".join(p for p in (self.architecture, self.variant) if p)

    def oci(self) -> dict[str, str]:
        """The ``platform`` object of an index entry."""
        entry = {"os": self.os, "architecture": self.architecture}
        if self.variant:
            entry["variant"] = self.variant
        return entry


def host_platform() -> Platform:
    """The platform of the kernel this runs on."""
    machine = os.uname().machine
    return Platform("linux", MACHINES.get(machine, machine))


def node_platform() -> Platform:
    """The platform a job on this node runs: ``IMGPIPE_PLATFORM`` when set, else the host's."""
    override = os.environ.get(PLATFORM_ENV, "").strip()
    return Platform.parse(override) if override else host_platform()


def parse_platforms(text: str | list[str] | tuple[str, ...]) -> tuple[Platform, ...]:
    """``linux/amd64,linux/arm64`` (or a list of them): each once, in the order given."""
    items = text.split(",") if isinstance(text, str) else list(text)
    parsed = tuple(dict.fromkeys(Platform.parse(item) for item in items if item.strip()))
    if not parsed:
        raise ConfigError("no platform given", hint="e.g. --platform linux/amd64,linux/arm64")
    return parsed


# The CPU qemu-user emulates for a platform's programs here, as qemu names it, and what
# /proc/cpuinfo says of it (implementer, part).  Not qemu's default ("max"): its SVE is
# emulated element by element, and PyTorch's aarch64 kernels (NVPL BLAS, oneDNN) take SVE
# where the CPU has it: a step of the bert self-test took 7.3 s on "max", 0.7 s on a
# Neoverse N1 (Armv8.2, NEON only).  A real Grace (Neoverse V2) runs the SVE kernels.
EMULATED_CPUS = {"arm64": ("neoverse-n1", "0x41", "0xd0c")}


def _emulated(platform: Platform) -> tuple[str, str, str] | None:
    if platform.architecture == host_platform().architecture:
        return None
    return EMULATED_CPUS.get(platform.architecture)


def emulation_env(platform: Platform) -> dict[str, str]:
    """The environment that makes qemu-user emulate ``EMULATED_CPUS``' CPU for programs of
    ``platform`` (binfmt starts qemu with the program's environment); empty where this
    host runs it natively."""
    cpu = _emulated(platform)
    return {"QEMU_CPU": cpu[0]} if cpu else {}


def emulated_cpuinfo(platform: Platform, cpus: int | None = None) -> str | None:
    """``/proc/cpuinfo`` as a kernel of ``platform`` on the emulated CPU writes it, for
    programs of that platform run here under emulation; None where this host runs it
    natively, or for a platform with no such text here.

    qemu-user (7.2, Debian 12's) shows aarch64 programs this host's x86 /proc/cpuinfo, and
    PyTorch's cpuinfo library, which reads it when ``import torch`` loads its libraries,
    dies on it (SIGSEGV: it finds no Arm core).  An emulated container or sandbox host is
    given this one instead: one entry per CPU of this host.
    """
    cpu = _emulated(platform)
    if cpu is None:
        return None
    _, implementer, part = cpu
    features = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"
    count = cpus or os.cpu_count() or 1
    return "\n".join(f"processor\t: {n}\nBogoMIPS\t: 2000.00\nFeatures\t: {features}\n"
                     f"CPU implementer\t: {implementer}\nCPU architecture: 8\n"
                     f"CPU variant\t: 0x0\nCPU part\t: {part}\nCPU revision\t: 0\n"
                     for n in range(count)) + "\n"
