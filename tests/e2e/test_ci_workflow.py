"""The images workflow's per-merge steps (.github/per-merge.sh), run the way a head-node
runner runs them: a fresh clone (no imgpipe.lock), as a non-root user in the docker group,
with apt-get, apt, dpkg and sudo replaced by tripwires.  Against a registry holding the last
push of bert/cpu, it pulls the lock from the registry and builds nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster import USERS, ensure_users, shared_folder, system_imgpipe

pytestmark = pytest.mark.slow  # every test here takes over 20 s

RUNNER = USERS[1]
REPO = Path(__file__).resolve().parents[2]
TRIPWIRES = ("apt-get", "apt", "dpkg", "sudo", "su")


def as_runner(argv: list[str], home: Path, env: dict[str, str], cwd: Path,
              timeout: float = 900) -> subprocess.CompletedProcess[str]:
    values = {"HOME": str(home), "USER": RUNNER, "LANG": "C.UTF-8", **env}
    return subprocess.run(["runuser", "-u", RUNNER, "--", "env", "-i",
                           *(f"{k}={v}" for k, v in values.items()), *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def one_time_setup(work: Path, site_config: Path) -> dict[str, str]:
    """What the README has an admin do once, as root: dependencies in a venv the runner
    owns, the runner in the docker group, the site's imgpipe.yaml."""
    ensure_users()
    venv = work / "venv"
    shutil.copytree(system_imgpipe(REPO).parent, venv, symlinks=True)  # deps installed
    subprocess.run(["usermod", "-aG", "docker", RUNNER], check=True)
    tripwires = work / "tripwires"
    tripwires.mkdir()
    for name in TRIPWIRES:
        wire = tripwires / name
        wire.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {work}/tripped\nexit 1\n")
        wire.chmod(0o755)
    site = work / "site.yaml"
    shutil.copy(site_config, site)
    site.chmod(0o644)
    subprocess.run(["chown", "-R", RUNNER, str(venv)], check=True)
    return {"IMGPIPE_VENV": str(venv), "IMGPIPE_SITE_CONFIG": str(site),
            "PATH": f"{tripwires}:/usr/local/bin:/usr/bin:/bin"}


def test_per_merge_steps_from_a_fresh_clone_build_nothing_unchanged(bert_cpu) -> None:
    work = shared_folder("imgpipe-runner-")
    env = one_time_setup(work, bert_cpu["project"] / "imgpipe.yaml")
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["chown", "-R", RUNNER, str(clone), str(work)], check=True)
    assert not (clone / "imgpipe.lock").exists()  # as actions/checkout leaves it

    try:
        done = as_runner(["bash", ".github/per-merge.sh", "cpu"], work, env, clone)
    finally:
        subprocess.run(["gpasswd", "-d", RUNNER, "docker"], capture_output=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nothing changed: all images up to date" in done.stdout
    assert not (work / "tripped").exists(), (work / "tripped").read_text()
    lock = json.loads((clone / "imgpipe.lock").read_text())
    pinned = lock["images"]["bert"]["cpu"]
    assert f"{pinned['repository']}@{pinned['digest']}" == bert_cpu["reference"]

    # Without the lock at all, plan answers from the registry alone.
    os.unlink(clone / "imgpipe.lock")
    imgpipe = str(Path(env["IMGPIPE_VENV"]) / "bin" / "imgpipe")
    subprocess.run(["usermod", "-aG", "docker", RUNNER], check=True)
    try:
        planned = as_runner([imgpipe, "plan", "bert", "--flavor", "cpu", "--json"], work, env,
                            clone, timeout=300)
    finally:
        subprocess.run(["gpasswd", "-d", RUNNER, "docker"], capture_output=True)
    assert planned.returncode == 0, planned.stderr
    [item] = json.loads(planned.stdout)["data"]["images"]
    assert item["action"] == "up to date", item
    assert not (clone / "imgpipe.lock").exists()  # planning writes nothing
