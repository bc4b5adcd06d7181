"""Every command that takes a path, given one that is missing, unwritable or of the wrong
type: one line naming what to fix, a non-zero exit, no traceback, nothing written.

Run through the real entry point in a new process (as a user types it); the unwritable
cases use /proc, which not even root may write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PINNED = "head:5000/imgpipe/bert@sha256:" + "ab" * 32


RENDER = ["recipes", "render", "--profile", "local", "--nodes", "1", "--image", PINNED]
# {file}: a regular file; {dir}: an empty folder; {missing}: nothing there.
CASES: dict[str, list[str]] = {
    "render into /proc": [*RENDER, "-o", "/proc/imgpipe-nope"],
    "render into a file": [*RENDER, "-o", "{file}"],
    "render into a missing parent in /proc": [*RENDER, "-o", "/proc/nope/deeper"],
    "publish a missing folder": ["recipes", "publish", "{missing}"],
    "publish a file": ["recipes", "publish", "{file}"],
    "publish a folder that is no bundle": ["recipes", "publish", "{dir}"],
    "nccl check a missing log": ["nccl", "check", "{missing}", "--profile", "local"],
    "nccl check a folder": ["nccl", "check", "{dir}", "--profile", "local"],
    "nccl check a log that is no log": ["nccl", "check", "{file}", "--profile", "local"],
    "nccl plot into /proc": ["nccl", "check", "{file}", "--profile", "local", "--plot",
                             "/proc/nope.png"],
    "report a missing folder": ["report", "{missing}"],
    "report a file": ["report", "{file}"],
    "report an empty folder": ["report", "{dir}"],
    "report into /proc": ["report", "{dir}", "-o", "/proc/nope"],
    "config missing": ["--config", "{missing}", "plan"],
    "config a folder": ["--config", "{dir}", "plan"],
    "config not yaml": ["--config", "{file}", "plan"],
    "build with missing wheels": ["build", "--wheels", "{missing}"],
    "plan with a file as wheels": ["plan", "--wheels", "{file}"],
    "plan in a folder without images": ["plan"],
    "convert into a squashfs folder in /proc": ["convert", PINNED],
    "importer with its cache in /proc": ["@importer", "get",
                                         "docker://127.0.0.1:5000#imgpipe/bert@sha256:"
                                         + "ab" * 32],
    "importer without enroot for another registry's image": [
        "@importer", "get", "docker://nvcr.io#nvidia/pytorch:25.01-py3"],
}


def argv_for(name: str, tmp: Path) -> list[str]:
    (tmp / "a-file").write_text("not a folder, not a log\n")
    (tmp / "a-dir").mkdir()
    places = {"file": str(tmp / "a-file"), "dir": str(tmp / "a-dir"),
              "missing": str(tmp / "missing")}
    return [part.format(**places) for part in CASES[name]]


def _attempt(name: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[str],
                                                  list[str]]:
    """One case run as a user types it: the result, and the tree before and after."""
    work = tmp_path / "work"
    work.mkdir(parents=True)
    (work / "imgpipe.yaml").write_text("outputs:\n  squashfs_dir: /proc/imgpipe-cache\n")
    argv = argv_for(name, tmp_path)
    entry = "from imgpipe.cli.main import run\nrun()"
    if argv[0] == "@importer":
        entry, argv = "from imgpipe.cli.importer import run\nrun()", argv[1:]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    done = subprocess.run([sys.executable, "-c", entry, *argv], capture_output=True,
                          text=True, timeout=120, cwd=work,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                               "IMGPIPE_CONFIG": str(work / "imgpipe.yaml")})
    return done, before, sorted(p.name for p in tmp_path.rglob("*"))


@pytest.fixture(scope="module")
def attempts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Every case at once, four processes at a time (each is mostly Python's start)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_attempt, name, tmp_path_factory.mktemp("bad"))
                   for name in sorted(CASES)}
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_path_is_one_line_and_no_traceback(name: str, attempts: dict[str, tuple]
                                                 ) -> None:
    done, before, after = attempts[name]
    assert done.returncode != 0, (name, done.stdout)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2 and lines[0].startswith("Usage:"):  # click's usage error
        assert [line for line in lines if line.startswith("Error:")] == [lines[-1]], lines
    else:
        assert len(lines) == 1 and lines[0].startswith(("error:", "imgpipe:")), lines
    assert after == before  # nothing left behind
