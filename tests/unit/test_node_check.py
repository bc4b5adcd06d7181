"""`imgpipe node-config --check | --apply` on a node that already runs Pyxis and Enroot (a node
image under --root): only what imgpipe needs is shown, changes to the site's own jobs are
marked, --apply writes imgpipe's own files only (the site's Pyxis line only when accepted),
keeps backups where nothing includes them, and a second run changes nothing."""

from __future__ import annotations

from pathlib import Path

from tests.nodeimage import node_image, sums

PYXIS = "required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis container_scope=job"


def _node(root: Path) -> dict[str, str]:
    files = {
        "etc/slurm/plugstack.conf": "include /etc/slurm/plugstack.conf.d/*\n",
        "etc/slurm/plugstack.conf.d/pyxis.conf": PYXIS + "\n",
        "etc/enroot/enroot.conf": "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)\n",
        "etc/enroot/environ.d/50-site.env": "SITE=1\n",
    }
    node_image(root, files, "usr/local/lib/slurm/spank_pyxis.so")
    return files


def test_check_shows_only_what_imgpipe_needs_and_marks_changes_to_jobs(cli, tmp_path: Path
                                                                        ) -> None:
    root = tmp_path / "node"
    _node(root)
    config = cli.write_config({"registry": {"host": "head", "scheme": "http"}})
    before = sums(root)
    code, out, err = cli("node-config", "--check", "--root", str(root), "--site-config",
                         str(config))
    assert code == 0, err
    assert sums(root) == before  # --check reads only
    assert "/etc/imgpipe/imgpipe.yaml (imgpipe's): missing" in out
    assert "/usr/local/bin/imgpipe-pyxis-importer (imgpipe's): missing" in out
    assert "/etc/slurm/plugstack.conf.d/pyxis.conf (the site's): differs" in out
    assert f"  - {PYXIS}" in out
    assert f"  + {PYXIS} importer=/usr/local/bin/imgpipe-pyxis-importer" in out
    assert "  ! changes existing jobs: every job's --container-image" in out
    assert "/etc/enroot/enroot.conf (the site's): ok" in out
    assert "#ENROOT_ALLOW_HTTP yes (switches every registry" in out  # an option, never applied
    assert "2 of imgpipe's own files to write" in out


def test_apply_writes_imgpipes_own_files_keeps_backups_and_is_idempotent(cli, tmp_path: Path
                                                                         ) -> None:
    root = tmp_path / "node"
    _node(root)
    config = cli.write_config({"registry": {"host": "head"}})
    site = sums(root)
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                         str(config))
    assert code == 0, err
    after = sums(root)
    assert {k: v for k, v in after.items() if k in site} == site  # the site's files as they were
    assert (root / "etc/imgpipe/imgpipe.yaml").read_text() == config.read_text()
    assert (root / "usr/local/bin/imgpipe-pyxis-importer").is_symlink()
    code, out, _ = cli("node-config", "--apply", "--root", str(root), "--site-config",
                       str(config))
    assert "nothing to do: the node has what imgpipe needs" in out and sums(root) == after
    code, out, err = cli("node-config", "--apply", "--accept", "importer", "--root", str(root),
                         "--site-config", str(config))
    assert code == 0, err
    pyxis = root / "etc/slurm/plugstack.conf.d/pyxis.conf"
    assert pyxis.read_text() == f"{PYXIS} importer=/usr/local/bin/imgpipe-pyxis-importer\n"
    assert list((root / "etc/slurm/plugstack.conf.d").iterdir()) == [pyxis]  # nothing beside
    [backup] = (root / "var/lib/imgpipe/backups").rglob("pyxis.conf")
    assert backup.read_text() == PYXIS + "\n"
    code, out, _ = cli("node-config", "--check", "--root", str(root))
    assert "pyxis.conf (the site's): ok" in out


def test_a_node_without_a_pyxis_line_gets_one_of_imgpipes_own(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    (root / "etc/slurm/plugstack.conf.d/pyxis.conf").unlink()
    code, out, err = cli("node-config", "--apply", "--root", str(root))
    assert code == 0, err
    written = (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text()
    assert written.splitlines()[-1] == ("required /usr/local/lib/slurm/spank_pyxis.so "
                                        "runtime_path=/run/pyxis "
                                        "importer=/usr/local/bin/imgpipe-pyxis-importer")
