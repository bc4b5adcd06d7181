"""The sandbox cluster as files: what it is (its spec: hosts, addresses, platforms) and
what its daemons read (slurm.conf, gres.conf, the munge key, each host's boot script, the
TaskProlog that tells an emulated host's tasks their platform)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.platforms import (
    PLATFORM_ENV,
    Platform,
    emulated_cpuinfo,
    emulation_env,
    host_platform,
)
from imgpipe.recipes.sandboxpyxis import (
    bind_lines,
    boot_lines,
    write_host_files,
    write_pyxis,
)

MUNGE_SOCKET = "munge/munge.socket"
SLURMD_PORT = 6818
SLURMCTLD_PORT = 6817

__all__ = ["MUNGE_SOCKET", "Host", "SandboxSpec", "write_boot_script", "write_config",
           "write_platform_prolog"]


@dataclass(frozen=True)
class Host:
    name: str        # hostname inside the namespace, and Slurm's node name
    namespace: str   # network namespace
    address: str


@dataclass(frozen=True)
class SandboxSpec:
    """What cluster to make.  ``name`` prefixes namespaces and links (at most 6 characters,
    so several sandboxes can coexist); ``subnet`` is a /24 given by its first three octets."""

    root: Path
    name: str = "imgp"
    subnet: str = "10.213.7"
    compute_nodes: int = 2
    cpus: int = 2
    gpus: int = 8            # fake GPU device files, so GPU profiles' requests are accepted
    memory_mb: int = 8000
    plugstack: Path | None = None  # a SPANK plugstack.conf (e.g. Pyxis's line) for slurmd
    # compute hosts of another platform than this machine's: "node2=linux/arm64,..."; their
    # jobs run that platform's images under emulation (binfmt), as a Grace node runs them
    # natively
    platforms: str = ""
    # the head host's egress (its registry's link), e.g. "1gbit": tc's token bucket on it, so
    # that what the registry serves shows in time as it would on a real NIC; "" for none
    registry_rate: str = ""
    # each compute host's /var/tmp: a tmpfs of its own (""), or FOLDER/<host> on disk, for
    # node-local files larger than memory (the fan-out bench's 6 GB squashfs on 8 hosts)
    node_scratch: str = ""
    # Pyxis (0.24, built by ./setup.sh) on every compute host: its plugstack line as
    # node-config renders it, with `importer` (imgpipe's importer, a path every job user can
    # run; "" for Enroot's own import) and squashfuse (recipes.sandboxpyxis)
    pyxis: bool = False
    importer: str = ""
    squashfuse: bool = True
    pyxis_line: str = ""  # the plugstack line itself (rendered by with_pyxis)
    # "FOLDER:TARGET,...": a node image's folders bound over each host's own
    node_binds: str = ""
    # "FOLDER,...": folders each compute host has a disk of its own at (an empty tmpfs at
    # every start), as a rack of nodes with local NVMe has /var/lib/imgpipe
    node_disks: str = ""
    # the head registry with TLS ("CERT:KEY", a certificate for the name "head") and logins
    # (an htpasswd file, bcrypt): the registry a site with logins runs
    registry_tls: str = ""
    registry_htpasswd: str = ""

    def node_platform(self, host: Host) -> Platform:
        """The platform ``host`` stands for (this machine's unless ``platforms`` says)."""
        for pair in self.platforms.split(","):
            name, _, platform = pair.partition("=")
            if name.strip() == host.name and platform.strip():
                return Platform.parse(platform)
        return host_platform()

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.subnet}.0/24")

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.254"

    @property
    def head(self) -> Host:
        return Host("head", f"{self.name}-head", f"{self.subnet}.1")

    @property
    def nodes(self) -> list[Host]:
        return [Host(f"node{i}", f"{self.name}-node{i}", f"{self.subnet}.{10 + i}")
                for i in range(1, self.compute_nodes + 1)]

    @property
    def hosts(self) -> list[Host]:
        return [self.head, *self.nodes]


def write_config(spec: SandboxSpec, root: Path) -> Path:
    """slurm.conf (and gres.conf, the munge key, the fake GPU devices, the platform
    TaskProlog) for ``spec`` in ``root``; the slurm.conf path."""
    conf = root / "slurm.conf"
    for sub in ("state", "spool", "munge", "log", "dev"):
        (root / sub).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o711)
    key = root / "munge" / "munge.key"
    if not key.exists():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(1024))
    for index in range(spec.gpus):
        (root / "dev" / f"gpu{index}").touch()
    plugstack = spec.plugstack
    if spec.pyxis and plugstack is None:
        plugstack = write_pyxis(root, spec.pyxis_line)
    elif spec.pyxis:
        write_host_files(root)  # the site's own plugstack loads Pyxis
    last = spec.compute_nodes
    gpus = f"Gres=gpu:{spec.gpus} " if spec.gpus else ""
    node_lines = [f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} "
                  f"CPUs={spec.cpus} RealMemory={spec.memory_mb} {gpus}"
                  f"Features={spec.node_platform(h).architecture} State=UNKNOWN"
                  for h in spec.nodes]
    emulated = {h.name: spec.node_platform(h) for h in spec.nodes
                if spec.node_platform(h) != host_platform()}
    prolog = write_platform_prolog(root, emulated)
    for host in spec.nodes:  # each emulated host's /proc/cpuinfo (boot.sh mounts it)
        cpuinfo = emulated_cpuinfo(emulated[host.name]) if host.name in emulated else None
        path = root / f"cpuinfo-{host.name}"
        if cpuinfo is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(cpuinfo)
            os.chmod(path, 0o644)
    conf.write_text("\n".join([
        f"ClusterName={spec.name}-sandbox",
        f"SlurmctldHost={spec.head.name}({spec.head.address})",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        # cred_expire is also how long a requeued job waits before it may start again
        # (default 120 s); starting it sooner fails with "Job credential revoked".
        f"AuthInfo=socket={root / MUNGE_SOCKET},cred_expire=10",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'spool'}/slurmd-%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        # Nodes are what slurm.conf says (CPUs, GPUs), whatever this machine has.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "KillWait=10",
        "GresTypes=gpu",
        *([f"PlugStackConfig={plugstack}"] if plugstack else []),
        *([f"TaskProlog={prolog}"] if prolog else []),
        *node_lines,
        f"PartitionName=debug Nodes=node[1-{last}] Default=YES MaxTime=INFINITE "
        "State=UP OverSubscribe=YES",
        f"PartitionName=batch Nodes=node[1-{last}] MaxTime=INFINITE State=UP "
        "OverSubscribe=YES",
        "",
    ]))
    # srun --mpi=pmix (enroot.distribution: broadcast): PMIx's client folder goes under
    # TmpFS (/tmp) by default, named by job and step alone, and every sandbox host shares
    # /tmp: the second host's step then fails ("File exists"). Each host's /var/tmp is its own.
    (root / "mpi.conf").write_text("PMIxCliTmpDirBase=/var/tmp\n")
    if spec.gpus:
        (root / "gres.conf").write_text(
            f"Name=gpu File={root / 'dev'}/gpu[0-{spec.gpus - 1}]\n")
    elif (root / "gres.conf").exists():
        (root / "gres.conf").unlink()
    for path in (conf, root / "gres.conf", root / "mpi.conf"):
        if path.exists():
            os.chmod(path, 0o644)
    return conf


def write_platform_prolog(root: Path, emulated: dict[str, Platform]) -> Path | None:
    """Slurm's TaskProlog for hosts that stand for another platform: it gives their tasks
    ``IMGPIPE_PLATFORM`` (what ``uname -m`` says on a real node of that platform), which the
    importer and the job scripts read, and the CPU qemu emulates for them
    (``emulation_env``).  None (and no file) when every host is this one's."""
    path = root / "taskprolog.sh"
    if not emulated:
        path.unlink(missing_ok=True)
        return None
    cases = "".join(
        f'  {name}) echo "export {PLATFORM_ENV}={platform}"'
        + "".join(f'; echo "export {k}={v}"' for k, v in emulation_env(platform).items())
        + " ;;\n" for name, platform in sorted(emulated.items()))
    path.write_text(f'#!/bin/sh\ncase "${{SLURMD_NODENAME:-$(hostname)}}" in\n{cases}esac\n')
    os.chmod(path, 0o755)
    return path


def write_boot_script(root: Path, node_scratch: str = "", pyxis: bool = False,
                      binds: str = "", disks: str = "") -> None:
    """What each daemon runs first in its host: set the hostname, mount node-local
    scratch folders, and mount the cgroup
    hierarchies as the root namespace has them (`ip netns exec` mounts a fresh /sys
    without them, and slurmd refuses a layout other than the one /proc/self/cgroup
    shows)."""
    lines = ["set -e", 'hostname "$1"', "shift",
             "if ! mountpoint -q /sys/fs/cgroup; then"]
    for source, target, fstype, options in _cgroup_mounts():
        lines.append(f"  mkdir -p {target}")
        lines.append(f"  mount -t {fstype} -o {options} {source} {target}")
    # Node-local scratch, as real nodes have: /dev/shm (where a node's tasks meet)
    # and /var/tmp (ch-run's squashfs mount points).  /tmp stays shared, standing in
    # for the cluster file system.
    # A host that stands for another platform shows its jobs that platform's /proc/cpuinfo
    # (write_config writes it): qemu-user shows this machine's, which PyTorch's aarch64
    # libraries die on (base.platforms.emulated_cpuinfo).
    cpuinfo = root / "cpuinfo-"
    lines += ["fi",
              "mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm",
              *(["mount -t tmpfs -o mode=1777 tmpfs /var/tmp"] if not node_scratch else [
                  f'mkdir -p "{node_scratch}/$(hostname)"',
                  f'chmod 1777 "{node_scratch}/$(hostname)"',
                  f'mount --bind "{node_scratch}/$(hostname)" /var/tmp']),
              *(boot_lines(root) if pyxis else []),
              *bind_lines(binds),
              *(f'mount -t tmpfs -o mode=0755 tmpfs "{folder}"'
                for folder in filter(None, disks.split(","))),
              f'if [ -f "{cpuinfo}$(hostname)" ]; then',
              f'  mount --bind "{cpuinfo}$(hostname)" /proc/cpuinfo',
              "fi",
              'exec "$@"', ""]
    (root / "boot.sh").write_text("\n".join(lines))


def _cgroup_mounts() -> list[tuple[str, str, str, str]]:
    """(source, target, type, options) of the cgroup file systems under /sys/fs/cgroup."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, target, fstype, options = line.split()[:4]
        if not target.startswith("/sys/fs/cgroup") or fstype not in ("tmpfs", "cgroup",
                                                                      "cgroup2"):
            continue
        kept = [o for o in options.split(",") if o not in ("ro", "rw") and "=" not in o
                or o.startswith("name=") or o.startswith("mode=")]
        found.append((source, target, fstype, ",".join(kept) or "defaults"))
    return found
