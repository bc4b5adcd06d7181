"""`./setup.sh build-host` installs what a build host needs and nothing of the demo: run as
written, with apt-get, dpkg-query and update-binfmts replaced by recorders (a build host's
packages are installed for real on every CI machine by `./setup.sh`; what this test proves is
what the build-host mode asks for, and what it leaves alone)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO_ONLY = ("slurm-wlm", "munge", "chromium", "qemu-user-static", "binfmt-support",
             "charliecloud-runtime", "docker-registry", "nginx-light", "debootstrap", "sudo",
             "logrotate",
             "libslurm-dev", "libbsd-dev", "makeself")  # the last three build Enroot and Pyxis
RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "$CALLS"\n'


def _run_setup(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    checkout = tmp_path / "checkout"
    (checkout / "images" / "bert" / "trainer").mkdir(parents=True)
    shutil.copy(ROOT / "setup.sh", checkout / "setup.sh")
    shutil.copy(ROOT / "setup-peers.sh", checkout / "setup-peers.sh")
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    (checkout / "images" / "bert" / "trainer" / "pyproject.toml").write_text("")
    venv = checkout / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    (venv / "bin" / "python").chmod(0o755)
    for stamp in (".imgpipe-build-host", ".imgpipe-installed"):
        (venv / stamp).touch()  # imgpipe is installed already: only the packages are asked
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("apt-get", "update-binfmts", "mount", "mountpoint"):
        (tools / tool).write_text(RECORDER + "exit 0\n")
        (tools / tool).chmod(0o755)
    (tools / "dpkg-query").write_text(RECORDER + "exit 1\n")  # nothing installed yet
    (tools / "dpkg-query").chmod(0o755)
    calls = tmp_path / "calls"
    calls.touch()
    done = subprocess.run(["bash", str(checkout / "setup.sh"), *args], capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": f"{tools}:/usr/bin:/bin", "CALLS": str(calls)})
    return done, calls.read_text()


def test_build_host_installs_the_engine_and_squashfs_tools_and_nothing_of_the_demo(
        tmp_path: Path) -> None:
    done, calls = _run_setup(tmp_path, "build-host")
    assert done.returncode == 0, done.stderr
    [install] = [line for line in calls.splitlines() if line.startswith("apt-get install")]
    asked = set(install.split()[2:])
    for wanted in ("docker.io", "squashfs-tools", "squashfs-tools-ng", "git", "python3-venv"):
        assert wanted in asked, install
    assert not asked & set(DEMO_ONLY), asked & set(DEMO_ONLY)
    assert "update-binfmts" not in calls and "mount " not in calls


def test_build_host_arm64_adds_emulation_alone(tmp_path: Path) -> None:
    done, calls = _run_setup(tmp_path, "build-host", "--arm64")
    assert done.returncode == 0, done.stderr
    [install] = [line for line in calls.splitlines() if line.startswith("apt-get install")]
    asked = set(install.split()[2:])
    assert {"qemu-user-static", "binfmt-support"} <= asked
    assert not asked & (set(DEMO_ONLY) - {"qemu-user-static", "binfmt-support"})
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    on_already = entry.exists() and "enabled" in entry.read_text()
    assert on_already or "update-binfmts --enable qemu-aarch64" in calls


def test_a_wrong_mode_is_one_line_and_installs_nothing(tmp_path: Path) -> None:
    done, calls = _run_setup(tmp_path, "build-host", "--grace")
    assert done.returncode == 2 and "usage:" in done.stderr
    assert "apt-get" not in calls
