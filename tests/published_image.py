"""A small image CI builds and publishes with its squashfs (`imgpipe ci --squashfs`), as
tests of published squashfs files and of node-local fan-out use it."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests import services

REPO = Path(__file__).resolve().parents[1]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci", *args],
                   cwd=cwd, check=True, capture_output=True, timeout=60)


def hello_origin(repo: Path, registry_port: int, repository: str) -> Path:
    """A git repository holding one image, ``hello`` (``/hello.txt``), pushed to
    ``repository`` of the registry at 127.0.0.1:``registry_port``."""
    spec = {"name": "hello", "repository": repository, "version": "1.0.0",
            "flavors": {"cpu": {"base": services.BASE_IMAGE}}, "selftest": ["cat", "/hello.txt"]}
    (repo / "images" / "hello").mkdir(parents=True)
    (repo / "images" / "hello" / "Dockerfile").write_text(
        "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nCOPY hello.txt /hello.txt\n")
    (repo / "images" / "hello" / "hello.txt").write_text("hello from CI\n")
    (repo / "images" / "hello" / "image.yaml").write_text(json.dumps(spec))
    (repo / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": registry_port}, "default_flavor": "cpu"}))
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    git("init", "-q", "-b", "main", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "images", cwd=repo)
    return repo


def ci_publish(origin: Path, folder: Path) -> dict:
    """A clone of ``origin`` in ``folder`` runs `imgpipe ci --flavor cpu --squashfs` as the
    workflow does: {"folder", "entry" (its lock entry), "pin" (the squashfs digest),
    "digest" (the manifest's)}."""
    git("clone", "-q", str(origin), str(folder), cwd=origin.parent)
    imgpipe = str(Path(sys.executable).parent / "imgpipe")
    done = subprocess.run([imgpipe, "ci", "--flavor", "cpu", "--squashfs"], cwd=folder,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads((folder / "imgpipe.lock").read_text())["images"]["hello"]["cpu"]
    pin = entry["squashfs_digests"]["zstd"]
    assert f"hello/cpu: squashfs {pin} (zstd)" in done.stdout
    return {"folder": folder, "entry": entry, "pin": pin, "digest": entry["digest"]}
