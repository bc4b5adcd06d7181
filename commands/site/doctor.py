"""`imgpipe doctor`: what this machine has, and how to get what it lacks."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from imgpipe.base.builders import build_route
from imgpipe.base.config import Settings
from imgpipe.base.engine import docker_clients, probe_client
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.platforms import Platform, host_platform
from imgpipe.base.process import which
from imgpipe.base.units import human_bytes
from imgpipe.pipeline.catalog import load_catalog

Verdict = Literal["ok", "warn", "missing"]
MIN_FREE_BYTES = 20 * 1024**3
PLUGSTACK_PLACES = (Path("/etc/slurm/plugstack.conf"), Path("/etc/slurm/plugstack.conf.d"),
                    Path("/etc/slurm-llnl/plugstack.conf"))


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str
    fix: str | None = None
    required: bool = True


def check_docker(settings: Settings) -> list[Check]:
    clients = docker_clients()
    if not clients:
        return [Check("docker engine", "missing", "no docker client on PATH",
                      "apt-get install docker.io")]
    env = {"DOCKER_HOST": settings.docker.host} if settings.docker.host else None
    probed = [probe_client(path, env) for path in clients]
    engine = next((c.engine_version for c in probed if c.engine_version), None)
    checks = [
        Check("docker engine", "ok", f"engine {engine}") if engine else
        Check("docker engine", "missing", "no engine answers",
              "dockerd --bridge=none --iptables=false & (./setup.sh starts it)")
    ]
    paths = [f"{c.path} {c.version}: {c.build_path or 'no BuildKit'}" for c in probed]
    usable = [c for c in probed if c.usable]
    if usable:
        checks.append(Check("buildkit", "ok", "; ".join(paths)))
    else:
        checks.append(Check("buildkit", "missing", "; ".join(paths),
                            "install docker-buildx, or Debian's docker.io (20.10 client)"))
    return checks


def check_registry(settings: Settings) -> Check:
    from imgpipe.commands.shared.wiring import registry_client

    try:
        registry_client(settings).ping()
    except ImgpipeError as exc:
        return Check("registry", "missing", f"{settings.registry.url}: {exc.message}",
                     "imgpipe registry up")
    return Check("registry", "ok", f"{settings.registry.url} answers /v2/")


def check_tool(name: str, programs: list[str], fix: str, required: bool = True) -> Check:
    found = [p for p in programs if which(p)]
    missing = [p for p in programs if not which(p)]
    if missing:
        return Check(name, "missing" if required else "warn",
                     f"not found: {', '.join(missing)}", fix, required)
    return Check(name, "ok", ", ".join(which(p) or p for p in found), required=required)


def check_enroot(settings: Settings) -> Check:
    """Enroot's version (the nodes', from enroot.version, else this host's) and what follows:
    digest references need 4.0."""
    from imgpipe.enroot.nodeconfig import nodes_enroot, takes_digests

    version, learnt = nodes_enroot(settings)
    if version is None:
        return Check("enroot", "warn", "not found here and enroot.version is not set",
                     "install Enroot on the compute nodes (https://github.com/NVIDIA/enroot), "
                     "or set enroot.version in imgpipe.yaml to theirs; imgpipe converts "
                     "without it", required=False)
    shown = ".".join(map(str, version))
    if not takes_digests(version):
        return Check("enroot", "warn", f"Enroot {shown} ({learnt}) rejects @sha256 digest "
                     "references", "pin squashfs files: imgpipe push --convert (recipes "
                     "render then pins the file), or upgrade Enroot to 4.0", required=False)
    where = shutil.which("enroot") if learnt.startswith("the enroot") else None
    at = f" at {where}" if where else ""
    return Check("enroot", "ok", f"Enroot {shown} ({learnt}{at}): digest references work",
                 required=False)


def check_pyxis(detected: tuple[str, tuple[int, int, int]] | None = None) -> Check:
    """Which Pyxis this host has (the plugin's own version mark) and whether a plugstack
    loads it."""
    shown = f"Pyxis {'.'.join(map(str, detected[1]))} ({detected[0]}), " if detected else ""
    for place in PLUGSTACK_PLACES:
        files = sorted(place.glob("*")) if place.is_dir() else [place]
        for file in files:
            try:
                if "spank_pyxis" in file.read_text():
                    return Check("pyxis", "ok", f"{shown}enabled in {file}", required=False)
            except OSError:
                continue
    if detected:
        return Check("pyxis", "warn", f"{shown}in no plugstack.conf",
                     "imgpipe node-config --check shows the line slurmd needs", required=False)
    return Check("pyxis", "warn", "no spank_pyxis.so here",
                 "install Pyxis on the compute nodes (https://github.com/NVIDIA/pyxis; "
                 "./setup.sh peers builds 0.24.0); recipes can still run with --runtime "
                 "charliecloud or host", required=False)


def check_squashfuse_mode(pyxis_version: tuple[int, int, int] | None,
                          filesystems: str | None = None, fuse: Path = Path("/dev/fuse")
                          ) -> list[Check]:
    """What Pyxis's use_squashfuse=1 needs on this node, each named when missing."""
    checks = [check_tool("squashfuse", ["squashfuse"], "apt-get install squashfuse (it must "
                         "be on slurmd's PATH)", required=False),
              check_tool("mountpoint", ["mountpoint"], "apt-get install util-linux",
                         required=False)]
    try:
        mode = fuse.stat().st_mode & 0o777
        if mode & 0o006 == 0o006:
            checks.append(Check("/dev/fuse", "ok", f"mode {mode:04o}", required=False))
        else:
            checks.append(Check("/dev/fuse", "warn", f"mode {mode:04o}: job users cannot "
                                "mount", f"chmod 0666 {fuse} (a udev rule keeps it)",
                                required=False))
    except OSError:
        checks.append(Check("/dev/fuse", "warn", "missing", "modprobe fuse", required=False))
    if filesystems is None:
        try:
            filesystems = Path("/proc/filesystems").read_text()
        except OSError:
            filesystems = ""
    if "overlay" in filesystems.split():
        checks.append(Check("overlayfs", "ok", "in the kernel", required=False))
    else:
        checks.append(Check("overlayfs", "warn", "not in /proc/filesystems",
                            "modprobe overlay (Enroot's native overlayfs)", required=False))
    if pyxis_version is None:
        return checks
    shown = ".".join(map(str, pyxis_version))
    if pyxis_version >= (0, 22):
        scope = "image paths and importer images" if pyxis_version >= (0, 24) else "image paths"
        checks.append(Check("pyxis squashfuse", "ok", f"Pyxis {shown}: use_squashfuse=1 "
                            f"applies to {scope}", required=False))
    else:
        checks.append(Check("pyxis squashfuse", "warn", f"Pyxis {shown} has no use_squashfuse",
                            "upgrade Pyxis to 0.24 to start jobs without unpacking",
                            required=False))
    return checks


def check_disk(settings: Settings) -> Check:
    where = settings.path(settings.outputs.squashfs_dir)
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < MIN_FREE_BYTES:
        return Check("disk", "warn", f"{human_bytes(free)} free at {probe}",
                     "images and squashfs files need tens of GiB: free space or move "
                     "outputs.squashfs_dir", required=False)
    return Check("disk", "ok", f"{human_bytes(free)} free at {probe}", required=False)


def check_cache(settings: Settings) -> Check:
    """The squashfs cache's layout and entries, as the threat model wants them."""
    from imgpipe.commands.shared.wiring import storage
    from imgpipe.enroot.cache.layout import audit

    try:
        cache = storage(settings)
        problems = audit(cache)
    except ImgpipeError as exc:
        return Check("squashfs cache", "warn", exc.message, exc.hint, required=False)
    if cache.shared and _sysctl("fs/protected_hardlinks") != "1":
        problems.insert(0, "fs.protected_hardlinks is not 1: a job user may hard-link "
                        "another entry's file under a shared name (sysctl -w "
                        "fs.protected_hardlinks=1, and in /etc/sysctl.d)")
    if problems:
        return Check("squashfs cache", "warn", f"{cache.root}: " + "; ".join(problems[:5])
                     + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
                     f"as root: imgpipe node-config --make-cache {cache.root}, and remove "
                     "what was planted", required=False)
    kind = "shared" if cache.shared else "private"
    return Check("squashfs cache", "ok", f"{cache.root} ({kind}; layout owned by "
                 f"{cache.trust.admin_names() if cache.shared else 'you'})", required=False)


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", name).read_text().strip()
    except OSError:
        return None


def check_platforms(settings: Settings) -> list[Check]:
    """How each platform the catalog builds for (and build.builders names) is built here:
    natively, by a remote native engine, or under emulation; a platform none can build is
    a warning naming the fix."""
    wanted = {host_platform()} | {Platform.parse(p) for p in settings.build.builders}
    folder = settings.path(settings.images_dir)
    if folder.is_dir():
        try:
            wanted |= {p for image in load_catalog(settings).values() for p in image.platforms}
        except ImgpipeError:
            pass  # a broken catalog is the build's error to report
    checks = []
    for platform in sorted(wanted, key=str):
        try:
            checks.append(Check(f"build {platform}", "ok", build_route(
                platform, settings.build.builders), required=False))
        except ImgpipeError as exc:
            checks.append(Check(f"build {platform}", "warn", exc.message, exc.hint,
                                required=False))
    return checks


def run_checks(settings: Settings) -> list[Check]:
    checks = check_docker(settings)
    checks.extend(check_platforms(settings))
    checks.append(check_registry(settings))
    checks.append(check_tool("squashfs tools", ["mksquashfs", "unsquashfs"],
                             "apt-get install squashfs-tools"))
    checks.append(check_tool("squashfs-tools-ng", ["tar2sqfs"],
                             "apt-get install squashfs-tools-ng", required=False))
    checks.append(check_tool("registry binary", ["docker-registry"],
                             "apt-get install docker-registry", required=False))
    checks.append(check_tool("slurm", ["sbatch", "srun", "sinfo"], "apt-get install slurm-wlm",
                             required=False))
    checks.append(check_enroot(settings))
    from imgpipe.enroot.nodeconfig import detect_pyxis

    detected = detect_pyxis()
    checks.append(check_pyxis(detected))
    checks.extend(check_squashfuse_mode(detected[1] if detected else None))
    checks.append(check_disk(settings))
    checks.append(check_cache(settings))
    return checks
