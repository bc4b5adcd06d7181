"""The sandbox as a Pyxis cluster, as files: its plugstack line is the one `node-config`
renders for a site with every option accepted, slurm.conf names it, each compute host binds
its own Enroot settings, Pyxis runtime folder and a /dev/fuse for every user; a machine
without Pyxis or Enroot is told in one line what builds them.  (tests/e2e/test_pyxis.py
runs jobs on it.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from imgpipe.commands.builds import sandbox as sandbox_commands
from imgpipe.commands.builds.sandbox import with_pyxis
from imgpipe.recipes.errors import SandboxError
from imgpipe.recipes.sandboxfiles import SandboxSpec, write_boot_script, write_config


def test_the_pyxis_line_is_node_configs_with_every_option_accepted(tmp_path: Path) -> None:
    spec = with_pyxis(SandboxSpec(tmp_path, compute_nodes=2),
                      importer="/opt/imgpipe/bin/imgpipe-pyxis-importer")
    plugin = sandbox_commands.detect_pyxis()
    assert plugin is not None
    assert spec.pyxis_line == (
        f"required {plugin[0]} runtime_path=/run/pyxis sbatch_support=1 "
        "importer=/opt/imgpipe/bin/imgpipe-pyxis-importer container_scope=job "
        "use_squashfuse=1")
    without = with_pyxis(SandboxSpec(tmp_path), importer="")
    assert "importer=" not in without.pyxis_line  # Enroot's own import


def test_the_hosts_load_it_with_their_own_enroot_folders_and_fuse(tmp_path: Path) -> None:
    spec = with_pyxis(SandboxSpec(tmp_path, compute_nodes=2), importer="/x/importer")
    conf = write_config(spec, tmp_path).read_text()
    assert f"PlugStackConfig={tmp_path / 'plugstack.conf'}\n" in conf
    assert spec.pyxis_line in (tmp_path / "plugstack.conf").read_text().splitlines()
    enroot = (tmp_path / "enroot.conf").read_text()
    assert "ENROOT_RUNTIME_PATH /var/tmp/enroot/runtime/user-$(id -u)" in enroot
    fuse = (tmp_path / "dev" / "fuse").stat()
    assert stat.S_ISCHR(fuse.st_mode) and stat.S_IMODE(fuse.st_mode) == 0o666
    assert os.major(fuse.st_rdev) == 10 and os.minor(fuse.st_rdev) == 229
    write_boot_script(tmp_path, pyxis=True, binds="/img/usr/local/bin:/usr/local/bin")
    boot = (tmp_path / "boot.sh").read_text()
    assert f'mount --bind "{tmp_path}/enroot.conf" /etc/enroot/enroot.conf' in boot
    assert "mount -t tmpfs -o mode=755 tmpfs /run/pyxis" in boot
    assert f'mount --bind "{tmp_path}/dev/fuse" /dev/fuse' in boot
    assert 'mount --bind "/img/usr/local/bin" "/usr/local/bin"' in boot
    # each user's Enroot folders under the host's own /var/tmp, made after it is mounted
    assert boot.index("tmpfs /var/tmp") < boot.index("mkdir -p -m 1777 /var/tmp/enroot/runtime")


def test_a_machine_without_pyxis_is_told_what_builds_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(sandbox_commands, "detect_pyxis", lambda: None)
    with pytest.raises(SandboxError) as raised:
        with_pyxis(SandboxSpec(tmp_path))
    assert "no Pyxis plugin" in raised.value.message
    assert raised.value.hint == "./setup.sh peers builds Enroot 4.1.2 and Pyxis 0.24.0 (as root)"


def test_a_spec_without_its_line_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="no Pyxis line"):
        write_config(SandboxSpec(tmp_path, pyxis=True), tmp_path)
