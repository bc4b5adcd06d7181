"""`./setup.sh node-wheels` as the admin guide runs it on a build host: as a user with no root
and no apt (both tripwires), in a fresh clone; then a node's install from those wheels alone
(`pip install --no-index`), run by a job user.  Made for RHEL 9's glibc (NODE_GLIBC=2.34),
as the guide says for such nodes: no wheel needs a newer one."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.cluster import USERS, ensure_users, shared_folder

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BUILDER, JOB_USER = USERS
TRIPWIRES = ("apt-get", "apt", "dpkg", "sudo", "su")


def _platform_tags(wheel: Path) -> set[str]:
    """The platform tags a wheel's file name carries (py3-none-any: {'any'})."""
    return set(wheel.name.removesuffix(".whl").split("-")[-1].split("."))


def _oldest_glibc(wheel: Path) -> int:
    """The oldest glibc (2.N: N) any platform tag of a wheel accepts; 0 for a pure one."""
    legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
    found = []
    for tag in _platform_tags(wheel):
        if tag.startswith("manylinux_2_"):
            found.append(int(tag.split("_")[2]))
        elif tag.split("_")[0] in legacy:
            found.append(legacy[tag.split("_")[0]])
    return min(found, default=0)


def test_node_wheels_are_made_without_root_and_install_offline_for_both_platforms() -> None:
    ensure_users()
    work = shared_folder("imgpipe-node-wheels-")
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    tripwires = work / "tripwires"
    tripwires.mkdir()
    for name in TRIPWIRES:
        (tripwires / name).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {work}/tripped\nexit 1\n")
        (tripwires / name).chmod(0o755)
    subprocess.run(["chown", "-R", BUILDER, str(work)], check=True)
    done = subprocess.run(
        ["runuser", "-u", BUILDER, "--", "env", f"HOME={work}", "PYTHON=/usr/bin/python3",
         f"PATH={tripwires}:/usr/bin:/bin", "NODE_GLIBC=2.34", "bash", "setup.sh",
         "node-wheels"],
        capture_output=True, text=True, cwd=clone, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (work / "tripped").exists(), (work / "tripped").read_text()
    nodes = clone / "dist" / "nodes"
    for arch, other in (("x86_64", "aarch64"), ("aarch64", "x86_64")):
        wheels = sorted((nodes / arch).glob("*.whl"))
        names = {w.name.split("-")[0].lower() for w in wheels}
        assert {"imgpipe", "pydantic_core", "zstandard", "pyyaml"} <= names, names
        binary = [w for w in wheels if "any" not in _platform_tags(w)]
        assert binary and all(any(t.endswith(arch) for t in _platform_tags(w))
                               for w in binary), binary
        assert not [w for w in wheels if other in w.name]
        assert not [w for w in wheels if _oldest_glibc(w) > 34]  # RHEL 9 installs them all
    [imgpipe_wheel] = (nodes / "x86_64").glob("imgpipe-*.whl")
    with zipfile.ZipFile(imgpipe_wheel) as wheel:
        assert any(n.endswith("commands/node/importer.py") for n in wheel.namelist())

    # a node (root, as the guide says): a venv of the system Python, from the folder alone
    venv = work / "opt-imgpipe"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links",
                    str(nodes / "x86_64"), "imgpipe"], check=True, capture_output=True,
                   timeout=600)
    subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
    ran = subprocess.run(["runuser", "-u", JOB_USER, "--", str(venv / "bin" / "imgpipe"),
                          "--version"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "imgpipe" in ran.stdout, ran.stderr
