"""A one-node Slurm (munged, slurmctld, slurmd) for the tests, on 127.0.0.1 and free ports.

Everything lives in one folder: config, state, spool, logs, and munge's key and
socket; the daemons are stopped when the context ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.services import free_port, wait_for


@dataclass
class Slurm:
    root: Path
    conf: Path
    env: dict[str, str]

    def run(self, *argv: str, cwd: Path | None = None, timeout: float = 120,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env={**os.environ, **self.env, **(extra_env or {})})


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    handle = open(log, "ab")
    return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, **env},
                            start_new_session=True)


@contextlib.contextmanager
def one_node_slurm(root: Path) -> Iterator[Slurm]:
    for program in ("munged", "slurmctld", "slurmd", "sbatch"):
        if shutil.which(program) is None:
            raise RuntimeError(f"{program} is missing: apt-get install slurm-wlm munge")
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o711)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    socket_path = root / "munge" / "munge.socket"
    host = socket.gethostname()
    ctld_port, slurmd_port = free_port(), free_port()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=imgpipe-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        # cred_expire is also how long a requeued job waits before it may start again
        # (default 120 s); starting it sooner fails with "Job credential revoked".
        f"AuthInfo=socket={socket_path},cred_expire=10",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "GresTypes=gpu",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000 Gres=gpu:16 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "PartitionName=batch Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ]))
    # Slurm counts a node's GPUs from device files; plain files stand in for them so
    # GPU profiles' requests (--gpus-per-node) can be checked with --test-only.
    (root / "dev").mkdir(exist_ok=True)
    for index in range(16):
        (root / "dev" / f"gpu{index}").touch()
    (root / "gres.conf").write_text(
        f"NodeName={host} Name=gpu File={root / 'dev'}/gpu[0-15]\n")
    env = {"SLURM_CONF": str(conf)}
    daemons = [
        _start(["munged", "--foreground", "--force", f"--key-file={key}",
                f"--socket={socket_path}", f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--log-file={root / 'munge' / 'munged.log'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}"],
               root / "munged.out", env),
    ]
    try:
        wait_for(socket_path.exists, 20, "munged")
        daemons.append(_start(["slurmctld", "-D", "-i", "-f", str(conf)],
                              root / "slurmctld.out", env))
        daemons.append(_start(["slurmd", "-D", "-f", str(conf)], root / "slurmd.out", env))
        slurm = Slurm(root, conf, env)

        def node_idle() -> bool:
            for proc in daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited: {proc.args[0]}; see {root}")
            out = slurm.run("sinfo", "-h", "-o", "%t", timeout=20).stdout.strip()
            return out in ("idle", "idle~", "mix")

        wait_for(node_idle, 60, "the Slurm node", interval=0.5)
        yield slurm
    finally:
        _cancel_jobs(env)
        for proc in reversed(daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        _kill_leftovers(conf)


def _cancel_jobs(env: dict[str, str]) -> None:
    """Cancel every job and give them a moment to end while the daemons still run."""
    full = {**os.environ, **env}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scancel", "--full", f"--user={os.getuid()}"], env=full,
                       capture_output=True, timeout=20)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=full, capture_output=True,
                                   text=True, timeout=20)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.5)


def _kill_leftovers(conf: Path) -> None:
    """slurmstepd daemonizes out of slurmd's process group, and job tasks are its children:
    find them by the SLURM_CONF every one of them inherits, so nothing outlives the test."""
    marker = f"SLURM_CONF={conf}".encode()
    deadline = time.monotonic() + 10
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        if not found or time.monotonic() > deadline:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
