"""`imgpipe node-config --remove` and `--upgrade` on a node image (--root): removal takes back
every install step, leaves the site's own files byte for byte, says what it keeps, and
`--rollback` undoes it; an upgrade swaps the importer link in one rename, refuses a venv that
cannot serve the node's cache, and is rolled back too.  On a Pyxis sandbox with jobs running:
tests/e2e/test_node_upgrade.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.nodeimage import node_image, sums

PYXIS = "required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis container_scope=job"
LINK = "usr/local/bin/imgpipe-pyxis-importer"


def _node(root: Path, pyxis_line: bool = True) -> dict[str, str]:
    files = {
        "etc/slurm/slurm.conf": "ClusterName=site\n",
        "etc/slurm/plugstack.conf": "include /etc/slurm/plugstack.conf.d/*\n",
        "etc/enroot/enroot.conf": "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)\n",
        "etc/sudoers.d/site": "%admins ALL=(ALL) ALL\n",
        "etc/systemd/system/slurmd.service.d/site.conf": "[Service]\nLimitNOFILE=65536\n",
    }
    if pyxis_line:
        files["etc/slurm/plugstack.conf.d/pyxis.conf"] = f"# the site's\n{PYXIS}  # ours\n"
    else:
        files["etc/slurm/plugstack.conf.d/other.conf"] = "optional /usr/lib/x.so\n"
    node_image(root, files, "usr/local/lib/slurm/spank_pyxis.so")
    return files


def _guide_files(root: Path) -> None:
    """What the admin guide has a site add for imgpipe: sudo rules, a unit, logrotate."""
    for name, text in {
            "etc/sudoers.d/imgpipe": "ALL ALL=(imgpipe-cache) NOPASSWD: /opt/imgpipe/bin/"
                                     "imgpipe-cache-writer --config /etc/imgpipe/imgpipe.yaml *\n",
            "etc/sudoers.d/mixed": "%admins ALL=(ALL) ALL\nALL ALL=(root) NOPASSWD: "
                                   "/opt/imgpipe/bin/imgpipe-audit *\n",
            "etc/systemd/system/imgpipe-cache.service": "[Service]\nExecStart=/opt/imgpipe/bin/"
                                                        "imgpipe node-config --make-cache X\n",
            "etc/logrotate.d/imgpipe": "/var/log/imgpipe/audit.jsonl { weekly }\n",
            # the guide's slurmd drop-in: left without the unit, slurmd would never start
            "etc/systemd/system/slurmd.service.d/imgpipe-cache.conf":
                "[Unit]\nRequires=imgpipe-cache.service\nAfter=imgpipe-cache.service\n"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "usr/local/bin/imgpipe-cache-writer").symlink_to(
        "/opt/imgpipe/bin/imgpipe-cache-writer")
    (root / "etc/imgpipe/profiles").mkdir(parents=True, exist_ok=True)
    (root / "etc/imgpipe/profiles/site.yaml").write_text("name: site\n")
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True)
    (wants / "imgpipe-cache.service").symlink_to("/etc/systemd/system/imgpipe-cache.service")


def test_remove_takes_back_every_step_and_rollback_puts_it_back(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    site = sums(root)
    config = cli.write_config({"registry": {"host": "head"}})
    code, _, err = cli("node-config", "--apply", "--accept", "importer", "--root", str(root),
                       "--site-config", str(config))
    assert code == 0, err
    pyxis = root / "etc/slurm/plugstack.conf.d/pyxis.conf"
    assert "importer=/usr/local/bin/imgpipe-pyxis-importer" in pyxis.read_text()
    _guide_files(root)
    installed = {**sums(root), "link": os.readlink(root / LINK)}
    code, out, err = cli("node-config", "--remove", "--root", str(root), "--json")
    assert code == 0, err
    after = sums(root)
    assert {k: v for k, v in after.items() if not k.startswith((
        "var/lib/imgpipe/backups", "etc/sudoers.d/mixed", "etc/imgpipe/profiles"))} \
        == {k: v for k, v in site.items()}  # the site's own files as they were, byte for byte
    assert pyxis.read_text() == f"# the site's\n{PYXIS}  # ours\n"
    for gone in (LINK, "etc/imgpipe/imgpipe.yaml", "usr/local/bin/imgpipe-cache-writer",
                 "etc/sudoers.d/imgpipe",
                 "etc/systemd/system/imgpipe-cache.service", "etc/logrotate.d/imgpipe",
                 "etc/systemd/system/slurmd.service.d/imgpipe-cache.conf",
                 "etc/systemd/system/multi-user.target.wants/imgpipe-cache.service"):
        assert not os.path.lexists(root / gone), gone
    import json
    data = json.loads(out)["data"]
    kept = "\n".join(data["kept"])
    assert "etc/sudoers.d/mixed: imgpipe's rules among the site's" in kept
    assert "etc/imgpipe: profiles (the site's own files there" in kept
    assert "var/lib/imgpipe/backups" in kept and "venv" in kept
    assert any("restart slurmd" in line for line in data["removed"])
    assert any("daemon-reload" in line for line in data["removed"])
    # a second run finds nothing of imgpipe's
    code, out, err = cli("node-config", "--remove", "--root", str(root))
    assert code == 0 and "nothing of imgpipe's to remove" in out, out + err
    # the removal was recorded: --rollback puts every file back
    code, out, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 0, err
    assert {**sums(root), "link": os.readlink(root / LINK)} == {
        **{k: v for k, v in installed.items()},
        **{k: v for k, v in sums(root).items() if k.startswith("var/lib/imgpipe/backups")}}


def test_remove_takes_out_the_pyxis_line_apply_added(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root, pyxis_line=False)
    before = (root / "etc/slurm/plugstack.conf").read_text()
    code, _, err = cli("node-config", "--apply", "--accept", "pyxis", "--accept", "importer",
                       "--root", str(root))
    assert code == 0, err
    assert "spank_pyxis.so" in (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text() \
        or "spank_pyxis.so" in (root / "etc/slurm/plugstack.conf").read_text()
    code, _, err = cli("node-config", "--remove", "--root", str(root))
    assert code == 0, err
    assert (root / "etc/slurm/plugstack.conf").read_text() == before
    written = root / "etc/slurm/plugstack.conf.d/pyxis.conf"
    assert not written.exists() or "spank_pyxis" not in written.read_text()


def test_upgrade_swaps_the_link_and_refuses_a_venv_that_cannot_serve(cli, tmp_path: Path
                                                                     ) -> None:
    root = tmp_path / "node"
    _node(root)
    code, _, err = cli("node-config", "--apply", "--root", str(root))
    assert code == 0, err
    assert os.readlink(root / LINK) == "/opt/imgpipe/bin/imgpipe-pyxis-importer"
    new = root / "opt/imgpipe-2/bin"
    new.mkdir(parents=True)
    (new / "imgpipe-pyxis-importer").write_text("#!/opt/imgpipe-2/bin/python3\n")
    (new / "python3").write_text("#!/bin/sh\necho 1\n")  # layout 1, as the node's cache
    for name in ("imgpipe-pyxis-importer", "python3"):
        (new / name).chmod(0o755)
    (new / "python").symlink_to("python3")
    (root / "bin").mkdir()
    shutil.copy("/bin/sh", root / "bin/sh")  # the node's own shell runs the stand-in
    cache = root / "var/cache/sq/.imgpipe"
    cache.mkdir(parents=True)
    (cache / "VERSION").write_text("1\n")
    (root / "etc/imgpipe/imgpipe.yaml").write_text(
        "registry: {host: head}\noutputs: {squashfs_dir: /var/cache/sq}\n")
    site = sums(root)
    code, _, err = cli("node-config", "--upgrade", "--root", str(root))
    assert code != 0 and "--upgrade needs --venv NEW" in err, err
    (cache / "VERSION").write_text("0\n")  # a cache the new imgpipe would refuse
    code, _, err = cli("node-config", "--upgrade", "--venv", "/opt/imgpipe-2", "--root",
                       str(root))
    assert code != 0 and "layout 1" in err and "holds layout 0" in err, err
    assert "Traceback" not in err
    assert os.readlink(root / LINK) == "/opt/imgpipe/bin/imgpipe-pyxis-importer"
    (cache / "VERSION").write_text("1\n")
    code, out, err = cli("node-config", "--upgrade", "--venv", "/opt/imgpipe-2", "--root",
                         str(root))
    assert code == 0, err
    assert os.readlink(root / LINK) == "/opt/imgpipe-2/bin/imgpipe-pyxis-importer"
    assert "(was /opt/imgpipe/bin/imgpipe-pyxis-importer)" in out
    assert "nothing runs from /opt/imgpipe now" in out
    assert not [p for p in (root / LINK).parent.iterdir() if p.name.startswith(".")]
    assert {k: v for k, v in sums(root).items() if not k.startswith("var/lib")} == \
        {k: v for k, v in site.items() if not k.startswith("var/lib")}
    code, out, _ = cli("node-config", "--upgrade", "--venv", "/opt/imgpipe-2", "--root",
                       str(root))
    assert code == 0 and "nothing to do" in out
    code, _, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 0, err
    assert os.readlink(root / LINK) == "/opt/imgpipe/bin/imgpipe-pyxis-importer"


def test_one_of_check_apply_rollback_upgrade_remove_at_a_time(cli, tmp_path: Path) -> None:
    code, _, err = cli("node-config", "--remove", "--apply", "--root", str(tmp_path))
    assert code == 2 and "--apply and --remove: one at a time" in err, err
