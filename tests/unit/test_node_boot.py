"""The node-local squashfs folder at each boot: where images reach the nodes one by one
(``enroot.distribution`` fetch, sbcast or broadcast), ``node-config --apply`` writes the unit
that makes the folder before slurmd starts, enabled as ``systemctl enable`` would; a shared
folder gets none; --rollback and --remove take it back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.nodeimage import node_image, sums

UNIT = "etc/systemd/system/imgpipe-cache.service"
WANTS = "etc/systemd/system/multi-user.target.wants/imgpipe-cache.service"
FILES = {"etc/slurm/slurm.conf": "ClusterName=site\n",
         "etc/slurm/plugstack.conf": "required /usr/local/lib/slurm/spank_pyxis.so\n"}


def _local(cli, distribution: str = "broadcast") -> Path:
    return cli.write_config({"registry": {"host": "head"},
                             "outputs": {"squashfs_dir": "/var/lib/imgpipe/squashfs"},
                             "enroot": {"distribution": distribution, "pyxis_importer": True}})


@pytest.mark.parametrize("distribution", ["fetch", "sbcast", "broadcast"])
def test_a_node_local_folder_gets_its_boot_unit_once(cli, tmp_path: Path, distribution: str
                                                     ) -> None:
    root = tmp_path / "node"
    node_image(root, FILES, "usr/local/lib/slurm/spank_pyxis.so")
    config = _local(cli, distribution)
    code, out, err = cli("node-config", "--check", "--root", str(root), "--site-config",
                         str(config))
    assert code == 0, err
    assert "/etc/systemd/system/imgpipe-cache.service (imgpipe's): missing" in out
    assert ("+ ExecStart=/opt/imgpipe/bin/imgpipe node-config --make-cache "
            "/var/lib/imgpipe/squashfs") in out
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                         str(config))
    assert code == 0, err
    unit = (root / UNIT).read_text()
    assert "ExecStart=/opt/imgpipe/bin/imgpipe node-config --make-cache " \
        "/var/lib/imgpipe/squashfs\n" in unit
    assert "Before=slurmd.service" in unit and "WantedBy=multi-user.target" in unit
    assert "RequiredBy" not in unit  # a node whose folder fails still runs the site's jobs
    assert os.readlink(root / WANTS) == "/etc/systemd/system/imgpipe-cache.service"
    after = sums(root)
    code, out, _ = cli("node-config", "--apply", "--root", str(root), "--site-config",
                       str(config))
    assert "nothing to do" in out and sums(root) == after  # idempotent
    code, out, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 0, err
    assert not (root / UNIT).exists() and not os.path.lexists(root / WANTS)


def test_a_shared_folder_gets_no_unit_and_a_changed_folder_a_new_one(cli, tmp_path: Path
                                                                     ) -> None:
    root = tmp_path / "node"
    node_image(root, FILES, "usr/local/lib/slurm/spank_pyxis.so")
    shared = cli.write_config({"registry": {"host": "head"},
                               "outputs": {"squashfs_dir": str(tmp_path / "lustre")},
                               "enroot": {"distribution": "shared"}})
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                         str(shared))
    assert code == 0, err
    assert not (root / "etc/systemd").exists() and "imgpipe-cache.service" not in out
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                         str(_local(cli)))
    assert code == 0, err
    moved = cli.write_config({"registry": {"host": "head"},
                              "outputs": {"squashfs_dir": "/nvme/imgpipe"},
                              "enroot": {"distribution": "fetch", "pyxis_importer": True}})
    code, out, err = cli("node-config", "--check", "--root", str(root), "--site-config",
                         str(moved))
    assert "imgpipe-cache.service (imgpipe's): differs" in out
    assert "- ExecStart=/opt/imgpipe/bin/imgpipe node-config --make-cache " \
        "/var/lib/imgpipe/squashfs" in out
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                         str(moved))
    assert code == 0, err
    assert "--make-cache /nvme/imgpipe\n" in (root / UNIT).read_text()
    code, out, err = cli("node-config", "--remove", "--root", str(root))
    assert code == 0, err
    assert not (root / UNIT).exists() and not os.path.lexists(root / WANTS)


def test_the_unit_the_admin_guide_shows_is_the_one_apply_writes(cli, tmp_path: Path) -> None:
    """docs/admin.md shows the unit: it must be what --apply writes (its comments aside)."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "admin.md").read_text()
    block = guide.split("# /etc/systemd/system/imgpipe-cache.service", 1)[1]
    shown = block.split("\n", 1)[1].split("```", 1)[0]
    root = tmp_path / "node"
    node_image(root, FILES, "usr/local/lib/slurm/spank_pyxis.so")
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                       str(_local(cli)))
    assert code == 0, err
    written = "".join(line for line in (root / UNIT).read_text().splitlines(keepends=True)
                      if not line.startswith("#"))
    assert written == shown


def test_an_upgrade_points_the_unit_at_the_new_venv(cli, tmp_path: Path) -> None:
    """The unit runs the venv the importer link names: --upgrade moves both, --rollback both
    back (before, the unit kept naming the old venv, which the admin then removed)."""
    import shutil

    root = tmp_path / "node"
    node_image(root, FILES, "usr/local/lib/slurm/spank_pyxis.so")
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                       str(_local(cli)))
    assert code == 0, err
    new = root / "opt/imgpipe-2/bin"
    new.mkdir(parents=True)
    (new / "imgpipe-pyxis-importer").write_text("#!/opt/imgpipe-2/bin/python3\n")
    (new / "python3").write_text("#!/bin/sh\necho 1\n")  # the layout version it reports
    for name in ("imgpipe-pyxis-importer", "python3"):
        (new / name).chmod(0o755)
    (new / "python").symlink_to("python3")
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy("/bin/sh", root / "bin/sh")
    code, out, err = cli("node-config", "--upgrade", "--venv", "/opt/imgpipe-2", "--root",
                         str(root))
    assert code == 0, err
    assert "ExecStart=/opt/imgpipe-2/bin/imgpipe node-config --make-cache " \
        "/var/lib/imgpipe/squashfs\n" in (root / UNIT).read_text()
    assert "systemctl daemon-reload" in out
    code, _, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 0, err
    assert "ExecStart=/opt/imgpipe/bin/imgpipe node-config" in (root / UNIT).read_text()
