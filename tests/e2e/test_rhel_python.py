"""RHEL 9's python3 is 3.9, and no Rocky or AlmaLinux tree can be made here (only Debian's
archives are reachable): the interpreter path is tried with a real Python 3.9 instead (pyenv's,
on this machine).  A node venv made from it, as an admin following Debian's lines would make
it, cannot take imgpipe's wheel (pip says which Python it needs), and `node-config --check`
names that venv's Python with what fixes it, reading the venv Python 3.9 itself made."""

from __future__ import annotations

import glob
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.nodeimage import node_image

ROOT = Path(__file__).resolve().parents[2]
IMGPIPE = ROOT / ".venv" / "bin" / "imgpipe"
PYTHON_39 = sorted(glob.glob("/root/.pyenv/versions/3.9.*/bin/python3.9"))


@pytest.mark.skipif(not PYTHON_39, reason="no Python 3.9 on this machine (pyenv's)")
def test_a_python_39_venv_is_refused_by_pip_and_named_by_the_check(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "pip", "wheel", "-q",
                    "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    root = tmp_path / "node"
    node_image(root, {"etc/slurm/slurm.conf": "ClusterName=site\n",
                      "etc/slurm/plugstack.conf":
                          "required /usr/local/lib/slurm/spank_pyxis.so\n"},
                      "usr/local/lib/slurm/spank_pyxis.so")
    venv = root / "opt" / "imgpipe"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([PYTHON_39[-1], "-m", "venv", str(venv)], check=True, capture_output=True,
                   timeout=120)
    [wheel] = wheels.glob("imgpipe-*.whl")
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-index", "--no-deps",
                          str(wheel)], capture_output=True, text=True, timeout=120)
    assert pip.returncode != 0
    assert "requires a different Python: 3.9" in pip.stderr and ">=3.11" in pip.stderr, \
        pip.stderr
    done = subprocess.run([str(IMGPIPE), "node-config", "--check", "--root", str(root)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if "runs Python 3.9" in x)
    assert "dnf install python3.11" in line and "python3.11 -m venv /opt/imgpipe" in line, line
