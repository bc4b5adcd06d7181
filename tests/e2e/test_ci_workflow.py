"""The images workflow (.github/workflows/images.yml) run the way a head-node runner runs it:
its steps as the file writes them, in a fresh clone (no imgpipe.lock), as a non-root user in
the docker group, with apt-get, apt, dpkg and sudo replaced by tripwires.  Against a registry
holding the last push of bert/cpu, it pulls the lock from the registry and builds nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cluster import USERS, ensure_users, shared_folder, system_imgpipe

pytestmark = pytest.mark.slow  # every test here takes over 20 s

RUNNER = USERS[1]
REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "images.yml"
TRIPWIRES = ("apt-get", "apt", "dpkg", "sudo", "su")
EXPRESSION = re.compile(r"\$\{\{\s*(vars|secrets)\.(\w+)(?:\s*\|\|\s*'([^']*)')?\s*\}\}")


def github_value(text: str, variables: dict[str, str]) -> str:
    """``${{ vars.X || 'default' }}`` and ``${{ secrets.X }}`` as Actions reads them (a secret
    the repository lacks is empty); any other expression fails the test."""
    def one(match: re.Match[str]) -> str:
        kind, name, default = match.groups()
        value = variables.get(name, "") if kind == "vars" else ""
        return value or (default or "")

    evaluated = EXPRESSION.sub(one, text)
    assert "${{" not in evaluated, f"an expression this test cannot evaluate: {text}"
    return evaluated


def workflow_steps() -> list[dict[str, object]]:
    [job] = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    steps: list[dict[str, object]] = job["steps"]
    return steps


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


def run_workflow(work: Path, env: dict[str, str], variables: dict[str, str]) -> tuple[
        Path, list[subprocess.CompletedProcess[str]]]:
    """Each step of the workflow as a runner takes it: checkout is a fresh clone, `run` steps
    run with Actions' shell (bash -eo pipefail) and their `env`, upload-artifact finds its
    file.  A step of another kind fails the test: this test must run what the runner runs."""
    clone = work / "clone"
    done = []
    for step in workflow_steps():
        uses = str(step.get("uses", ""))
        if uses.startswith("actions/checkout@"):
            subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
            subprocess.run(["chown", "-R", RUNNER, str(clone), str(work)], check=True)
            assert not (clone / "imgpipe.lock").exists()  # as actions/checkout leaves it
        elif uses.startswith("actions/upload-artifact@"):
            kept = clone / str(step["with"]["path"])  # type: ignore[index]
            assert kept.is_file(), f"{kept} for the step {step.get('name')!r}"
        elif "run" in step:
            step_env = {k: github_value(str(v), variables)
                        for k, v in dict(step.get("env") or {}).items()}
            command = github_value(str(step["run"]), variables)
            ran = as_runner(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                             command], work, {**env, **step_env}, clone)
            done.append(ran)
            assert ran.returncode == 0, (step.get("name"), ran.stdout[-3000:],
                                         ran.stderr[-3000:])
        else:
            raise AssertionError(f"a workflow step this test cannot run: {step}")
    return clone, done


def test_the_workflow_runs_from_a_fresh_clone_and_builds_nothing_unchanged(bert_cpu) -> None:
    work = shared_folder("imgpipe-runner-")
    env = one_time_setup(work, bert_cpu["project"] / "imgpipe.yaml")
    variables = {"IMGPIPE_VENV": env.pop("IMGPIPE_VENV"),
                 "IMGPIPE_SITE_CONFIG": env.pop("IMGPIPE_SITE_CONFIG"),
                 "IMGPIPE_FLAVOR": "cpu"}
    try:
        clone, done = run_workflow(work, env, variables)
    finally:
        subprocess.run(["gpasswd", "-d", RUNNER, "docker"], capture_output=True)
    said = "".join(ran.stdout for ran in done)
    assert "nothing changed: all images up to date" in said
    assert not (work / "tripped").exists(), (work / "tripped").read_text()
    lock = json.loads((clone / "imgpipe.lock").read_text())
    pinned = lock["images"]["bert"]["cpu"]
    assert f"{pinned['repository']}@{pinned['digest']}" == bert_cpu["reference"]
    env["IMGPIPE_VENV"] = variables["IMGPIPE_VENV"]

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
