"""The multi-host test cluster and what jobs on it need: non-root users, a shared folder
they can use, the bert cpu image as a squashfs file, and submitting recipes as a user does.

The cluster itself is imgpipe's sandbox (``imgpipe.recipes.sandbox``): the same code
serves the tests, the demo and ``imgpipe sandbox``.
"""

from __future__ import annotations

import atexit
import json
import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from imgpipe.recipes.sandbox import Sandbox

USERS = ("imgpipe-alice", "imgpipe-bob")


def ensure_users() -> None:
    """The test cluster's job users (every host shares /etc/passwd, as with LDAP)."""
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name],
                           check=True, capture_output=True)


def prepare_node_devices() -> None:
    """What a compute node has: /dev/fuse usable by every user (squashfuse, ch-run)."""
    os.chmod("/dev/fuse", 0o666)


def shared_folder(prefix: str) -> Path:
    """A folder every job user can enter (pytest's tmp_path is root's, mode 0700), removed
    when the test process ends: a run leaves no squashfs files or clones behind in /tmp."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(folder, 0o755)
    atexit.register(remove_folder, folder)
    return folder


def remove_folder(folder: Path) -> None:
    """What a test made, with the files its job users wrote there; a mount left inside is
    not crossed (``--one-file-system``)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(folder)], capture_output=True,
                   check=False)


def node_cache(prefix: str) -> tuple[Path, Path]:
    """What node-config sets up on a cluster: an empty squashfs folder every user shares
    (1777, its layout root's: `imgpipe node-config --make-cache`) and the nodes'
    imgpipe.yaml naming it and the head's registry."""
    from imgpipe.enroot.cache.layout import make_layout
    from imgpipe.enroot.cache.storage import Storage

    shared = shared_folder(prefix)
    squashfs = shared / "squashfs"
    make_layout(Storage(squashfs))
    config = shared / "imgpipe.yaml"
    config.write_text(json.dumps({"registry": {"host": "head", "port": 5000},
                                  "outputs": {"squashfs_dir": str(squashfs)}}))
    os.chmod(config, 0o644)
    return squashfs, config


def owned_by(user: str, *folders: Path) -> None:
    entry = pwd.getpwnam(user)
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, entry.pw_uid, entry.pw_gid)


@dataclass
class Submitter:
    """Submits rendered recipes the way users do: source a config, sbatch, wait."""

    cluster: Sandbox
    recipes: Path
    workdir: Path
    user: str | None
    env: dict[str, str]

    def submit(self, script: str, config: str | None, *sbatch_args: str,
               timeout: float = 600) -> tuple[str, str]:
        """sbatch --wait; returns (job id, the job's output).  Fails on a non-zero exit."""
        sourced = f"source {shlex.quote(str(self.recipes / config))} && " if config else ""
        command = (f"{sourced}sbatch --parsable --wait {' '.join(map(shlex.quote, sbatch_args))}"
                   f" {shlex.quote(str(self.recipes / script))}")
        done = self.cluster.run(["bash", "-c", command], user=self.user, env=self.env,
                                timeout=timeout, cwd=self.workdir)
        job = done.stdout.strip().split(";")[0].splitlines()[0] if done.stdout.strip() else "?"
        output = self.job_output(script, job)
        assert done.returncode == 0, (script, config, done.stderr[-2000:], output[-4000:])
        return job, output

    def job_output(self, script: str, job: str) -> str:
        names = {"run.sub": "bert-pretrain", "dataset.sub": "bert-dataset",
                 "nccl.sub": "nccl-check"}
        log = self.workdir / f"{names.get(script, script)}-{job}.out"
        return log.read_text() if log.exists() else ""

    def job_state(self, job: str) -> str:
        shown = self.cluster.run(["scontrol", "show", "job", job, "-o"], timeout=20).stdout
        for field in shown.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "?"


def journal(results: Path, phase: int) -> list[dict]:
    """Every event of the trainer's JSON log for ``phase`` under ``results`` (all jobs)."""
    events = []
    for path in sorted(results.glob(f"*/bert_phase{phase}.jsonl")):
        events += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return events


def wait_until(predicate, what: str, seconds: float, describe=lambda: "") -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, (what, describe())
        time.sleep(0.5)


SYSTEM_VENV = Path("/opt/imgpipe-tests/venv")


def system_imgpipe(source: Path) -> Path:
    """imgpipe installed the way node-config says: a venv from the system Python that every
    user can execute (this checkout's .venv comes from a Python under /root, which others
    cannot run).  Dependencies are installed once per pyproject; imgpipe itself each time."""
    import hashlib

    digest = hashlib.sha256((source / "pyproject.toml").read_bytes()).hexdigest()[:16]
    stamp = SYSTEM_VENV / f".deps-{digest}"
    pip = [str(SYSTEM_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    if not stamp.exists():
        subprocess.run(["rm", "-rf", str(SYSTEM_VENV)], check=True)
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(SYSTEM_VENV)], check=True,
                       capture_output=True)
        subprocess.run([*pip, "setuptools>=68", str(source)], check=True, capture_output=True,
                       timeout=900)
        stamp.touch()
    build = Path(tempfile.mkdtemp(prefix="imgpipe-wheel-"))
    try:
        subprocess.run([*pip, "--no-deps", "--force-reinstall", "--no-build-isolation",
                        str(source)], check=True, capture_output=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(build)})
    finally:
        shutil.rmtree(build, ignore_errors=True)
    subprocess.run(["chmod", "-R", "a+rX", str(SYSTEM_VENV.parent)], check=True)
    return SYSTEM_VENV / "bin"
