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


def _without_dpkg(tmp_path: Path, pythons: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """build-host on a host with no dpkg (RHEL, Rocky): PATH holds only the tools it needs and
    the Pythons given (name: the version each says)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir(parents=True)
    for name in ("setup.sh", "setup-peers.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    tools = tmp_path / "bin"
    tools.mkdir(parents=True)
    for tool in ("id", "dirname", "rm", "cat", "mkdir"):
        (tools / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    (tools / "apt-get").write_text("#!/bin/sh\necho apt-get was run >&2\nexit 1\n")
    for name, version in pythons.items():
        major, minor = version.split(".")[:2]
        (tools / name).write_text(
            "#!/bin/sh\n"
            f'if [ "$1" = --version ]; then echo "Python {version}"; exit 0; fi\n'
            f'if [ "$1" = -c ]; then exit {0 if (int(major), int(minor)) >= (3, 11) else 1}; fi\n'
            'if [ "$1" = -m ]; then mkdir -p .venv/bin && printf "#!/bin/sh\\n" > '
            '.venv/bin/python && chmod +x .venv/bin/python && touch '
            '.venv/.imgpipe-build-host; exit 0; fi\n')
        (tools / name).chmod(0o755)
    (tools / "chmod").symlink_to(shutil.which("chmod") or "/bin/chmod")
    (tools / "touch").symlink_to(shutil.which("touch") or "/usr/bin/touch")
    (tools / "printf").symlink_to(shutil.which("printf") or "/usr/bin/printf")
    return subprocess.run(["/bin/bash", str(checkout / "setup.sh"), "build-host"],
                          capture_output=True, text=True, timeout=60, cwd=checkout,
                          env={"PATH": str(tools)})


def test_build_host_without_dpkg_needs_a_python_311_and_installs_no_package(tmp_path: Path
                                                                              ) -> None:
    """RHEL 9's python3 is 3.9: one line naming what to install, nothing made; with
    python3.11 beside it, the venv is made from that one, and apt is never asked."""
    done = _without_dpkg(tmp_path / "a", {"python3": "3.9.18"})
    assert done.returncode == 2, done.stderr
    assert "no Python 3.11 or newer" in done.stderr and "dnf install python3.11" in done.stderr
    assert "apt-get was run" not in done.stderr
    assert not (tmp_path / "a" / "checkout" / ".venv").exists()
    done = _without_dpkg(tmp_path / "b", {"python3": "3.9.18", "python3.11": "3.11.7"})
    assert done.returncode == 0, done.stderr
    assert "no dpkg here" in done.stderr and "squashfs-tools-ng" in done.stderr
    assert "creating .venv with Python 3.11.7" in done.stderr
    assert "apt-get was run" not in done.stderr
