"""`imgpipe node-config --check | --apply` on a node that already runs Pyxis and Enroot (a node
image under --root): only what imgpipe needs is shown, changes to the site's own jobs are
marked, --apply writes imgpipe's own files only (the site's Pyxis line only when accepted),
keeps backups where nothing includes them, and a second run changes nothing."""

from __future__ import annotations

import os
from pathlib import Path

from tests.nodeimage import node_image, sums

PYXIS = "required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis container_scope=job"


def _node(root: Path) -> dict[str, str]:
    files = {
        "etc/slurm/slurm.conf": "ClusterName=site\n",
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


def test_a_node_without_a_pyxis_line_gets_one_only_when_accepted(cli, tmp_path: Path
                                                                 ) -> None:
    """Before, a missing Pyxis line counted as imgpipe's own file: --apply wrote one, with
    importer=, unasked (every srun on the node then loads Pyxis)."""
    root = tmp_path / "node"
    _node(root)
    (root / "etc/slurm/plugstack.conf.d/pyxis.conf").unlink()
    code, out, err = cli("node-config", "--apply", "--root", str(root))
    assert code == 0, err
    assert not (root / "etc/slurm/plugstack.conf.d/pyxis.conf").exists()
    assert "! written only with --accept pyxis" in out
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis")
    assert code == 0, err
    written = (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text()
    assert written.splitlines()[-1] == ("required /usr/local/lib/slurm/spank_pyxis.so "
                                        "runtime_path=/run/pyxis")
    before = sums(root)
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis")
    assert "nothing to do" in out and sums(root) == before  # a second run changes nothing


def test_the_line_goes_where_slurmd_reads_it(cli, tmp_path: Path) -> None:
    """A plugstack with no include folder gets the line itself (before: a plugstack.conf.d
    file nothing read, rewritten with a new backup on every run); slurm.conf's
    PlugStackConfig is the file slurmd reads."""
    root = tmp_path / "node"
    node_image(root, {"etc/slurm/slurm.conf": "PlugStackConfig=/etc/site/spank.conf\n",
                      "etc/site/spank.conf": "optional /usr/lib/site/spank_x11.so\n"},
               "usr/local/lib/slurm/spank_pyxis.so")
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis",
                         "--accept", "importer")
    assert code == 0, err
    assert "plugstack: /etc/site/spank.conf (PlugStackConfig in /etc/slurm/slurm.conf)" in out
    assert not (root / "etc/slurm/plugstack.conf.d").exists()
    lines = (root / "etc/site/spank.conf").read_text().splitlines()
    assert lines[0] == "optional /usr/lib/site/spank_x11.so"
    assert lines[-1].endswith("runtime_path=/run/pyxis "
                              "importer=/usr/local/bin/imgpipe-pyxis-importer")
    backups = sorted((root / "var/lib/imgpipe/backups").iterdir())
    before = sums(root)
    code, out, _ = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis",
                       "--accept", "importer")
    assert code == 0 and sums(root) == before
    assert sorted((root / "var/lib/imgpipe/backups").iterdir()) == backups  # no new backup


def test_rollback_puts_the_last_run_back(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    link = root / "usr/local/bin/imgpipe-pyxis-importer"
    link.parent.mkdir(parents=True)
    link.symlink_to("/opt/old-imgpipe/bin/imgpipe-pyxis-importer")  # a link of an older install
    config = cli.write_config({"registry": {"host": "head"}})
    site = sums(root)
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--site-config",
                         str(config), "--accept", "importer")
    assert code == 0, err
    assert link.readlink() == Path("/opt/imgpipe/bin/imgpipe-pyxis-importer")
    [kept] = [Path(folder) / name for folder, _, names in os.walk(root / "var/lib/imgpipe")
              for name in names if name == "imgpipe-pyxis-importer"]
    assert kept.readlink() == Path("/opt/old-imgpipe/bin/imgpipe-pyxis-importer")  # as a link
    code, out, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 0, err
    assert link.readlink() == Path("/opt/old-imgpipe/bin/imgpipe-pyxis-importer")
    assert not (root / "etc/imgpipe/imgpipe.yaml").exists()  # made by the run: removed
    assert {k: v for k, v in sums(root).items() if k in site} == site
    assert "restart slurmd" in out
    code, out, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 2 and "nothing to roll back" in err


def test_check_says_when_no_job_user_could_run_the_importer(cli, tmp_path: Path) -> None:
    """Before, --check said "ok" for a link into root's own venv (/root is 0700)."""
    root = tmp_path / "node"
    _node(root)
    (root / "opt/imgpipe").chmod(0o700)
    code, out, err = cli("node-config", "--check", "--root", str(root))
    assert code == 0, err
    assert "(imgpipe's): conflict" in out
    assert "which a job user cannot run: /opt/imgpipe is closed to other users" in out
    (root / "opt/imgpipe").chmod(0o755)
    (root / "usr/bin/python3.11").chmod(0o700)
    code, out, err = cli("node-config", "--check", "--root", str(root))
    assert "/usr/bin/python3.11 is not executable by other users" in out


def test_check_names_a_missing_registry_ca(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    ca = tmp_path / "site-ca.crt"
    ca.write_text("CA\n")
    config = cli.write_config({"registry": {"host": "head", "ca_file": str(ca)}})
    code, out, err = cli("node-config", "--check", "--root", str(root), "--site-config",
                         str(config))
    assert code == 0, err
    assert f"registry.ca_file names {ca}, which this node lacks" in out


def test_apply_refuses_importer_when_no_job_user_could_run_it(cli, tmp_path: Path) -> None:
    """Before, --accept importer rewrote the site's Pyxis line while the link stayed out (its
    target closed to users): every --container-image job on the node would have failed."""
    root = tmp_path / "node"
    _node(root)
    (root / "opt/imgpipe").chmod(0o700)
    before = sums(root)
    code, _, err = cli("node-config", "--apply", "--accept", "importer", "--root", str(root))
    assert code == 2 and "refused: Pyxis would run" in err and "is closed to other users" in err
    assert sums(root) == before


def test_a_new_pyxis_line_takes_only_the_options_this_node_can_run(cli, tmp_path: Path
                                                                   ) -> None:
    """container_scope=job drains the node when Pyxis's cleanup finds no enroot on its PATH;
    use_squashfuse=1 is unknown to Pyxis before 0.22.  Accepted, each is still left out
    where it cannot work, in a line."""
    root = tmp_path / "node"
    _node(root)
    (root / "etc/slurm/plugstack.conf.d/pyxis.conf").unlink()
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis",
                         "--accept", "container_scope", "--accept", "squashfuse")
    assert code == 0, err
    line = (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text().splitlines()[-1]
    assert "container_scope" not in line and "use_squashfuse=1" in line
    assert "container_scope=job left out" in out
    (root / "etc/slurm/plugstack.conf.d/pyxis.conf").unlink()
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    (root / "usr/bin/enroot").write_text("#!/bin/sh\n")
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis",
                         "--accept", "container_scope")
    assert "container_scope=job" in (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text()


def test_configless_slurm_gets_no_line_slurmd_would_not_read(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    (root / "etc/slurm/slurm.conf").unlink()  # configless: slurmd fetches it from slurmctld
    (root / "etc/slurm/plugstack.conf.d/pyxis.conf").unlink()
    before = sums(root)
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "pyxis")
    assert code == 2 and "configless Slurm" in err and "--plugstack FILE" in err
    assert sums(root) == before


def test_a_relative_include_a_trailing_comment_and_the_plugin_path_of_the_line(
        cli, tmp_path: Path) -> None:
    """Slurm reads a relative include from the including file's folder and drops what follows
    '#' on a line; Pyxis may live where the site's own line says, not where Debian puts it.
    Before, such a node "loaded no Pyxis", and importer= went after the comment, unread."""
    root = tmp_path / "node"
    line = "required /opt/slurm/lib/spank_pyxis.so runtime_path=/run/pyxis  # ours"
    node_image(root, {"etc/slurm/slurm.conf": "ClusterName=site\n",
                      "etc/slurm/plugstack.conf": "include plugstack.conf.d/*.conf\n",
                      "etc/slurm/plugstack.conf.d/pyxis.conf": line + "\n"},
               "opt/slurm/lib/spank_pyxis.so")
    code, out, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer")
    assert code == 0, err
    written = (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text().splitlines()[-1]
    assert written == ("required /opt/slurm/lib/spank_pyxis.so runtime_path=/run/pyxis "
                       "importer=/usr/local/bin/imgpipe-pyxis-importer  # ours")  # spacing kept
    code, out, _ = cli("node-config", "--check", "--root", str(root))
    assert "/etc/slurm/plugstack.conf.d/pyxis.conf (the site's): ok" in out


def test_what_importer_changes_on_a_line_with_enroot_load_or_squashfuse_is_said(
        cli, tmp_path: Path) -> None:
    """Pyxis skips use_enroot_load when an importer is set, and with use_squashfuse=1 (0.24)
    mounts what the importer returns: either changes how nvcr.io's images start."""
    root = tmp_path / "node"
    _node(root)
    (root / "etc/slurm/plugstack.conf.d/pyxis.conf").write_text(
        PYXIS + " use_enroot_load=1 use_squashfuse=1\n")
    code, out, err = cli("node-config", "--check", "--root", str(root))
    assert code == 0, err
    [affects] = [line for line in out.splitlines() if "! changes existing jobs" in line]
    assert "use_enroot_load=1" in affects and "use_squashfuse=1" in affects


def test_importer_is_not_written_where_no_slurm_conf_says_slurmd_reads_it(cli, tmp_path: Path
                                                                          ) -> None:
    root = tmp_path / "node"
    _node(root)
    (root / "etc/slurm/slurm.conf").unlink()  # configless: the plugstack is slurmctld's
    before = sums(root)
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer")
    assert code == 2 and "configless Slurm" in err
    assert sums(root) == before


def test_an_importer_another_account_could_change_is_refused(cli, tmp_path: Path) -> None:
    """Pyxis runs the importer in every user's container step: a venv the CI runner's account
    owns (docs/images.md hands it one) must not become it."""
    root = tmp_path / "node"
    _node(root)
    os.chown(root / "opt/imgpipe/bin", 65534, -1)  # nobody's, e.g. a runner's venv
    code, out, _ = cli("node-config", "--check", "--root", str(root))
    assert "/opt/imgpipe/bin belongs to uid 65534, not root" in out
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer")
    assert code == 2 and "refused" in err
    os.chown(root / "opt/imgpipe/bin", 0, -1)
    (root / "opt/imgpipe/bin/imgpipe-pyxis-importer").chmod(0o777)
    code, out, _ = cli("node-config", "--check", "--root", str(root))
    assert "imgpipe-pyxis-importer is writable by others" in out


def test_apply_and_rollback_keep_the_site_files_owner(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    pyxis = root / "etc/slurm/plugstack.conf.d/pyxis.conf"
    os.chown(pyxis, 0, 65534)  # the site's group, e.g. its configuration management's
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer")
    assert code == 0, err
    assert (pyxis.stat().st_uid, pyxis.stat().st_gid) == (0, 65534)
    code, _, err = cli("node-config", "--rollback", "--root", str(root))
    assert code == 0, err
    assert pyxis.read_text() == PYXIS + "\n"
    assert (pyxis.stat().st_uid, pyxis.stat().st_gid) == (0, 65534)


def test_importer_goes_on_the_active_line_not_a_commented_copy(cli, tmp_path: Path) -> None:
    root = tmp_path / "node"
    _node(root)
    pyxis = root / "etc/slurm/plugstack.conf.d/pyxis.conf"
    pyxis.write_text(f"# old: {PYXIS}\n{PYXIS}\n")
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer")
    assert code == 0, err
    assert pyxis.read_text() == (f"# old: {PYXIS}\n"
                                 f"{PYXIS} importer=/usr/local/bin/imgpipe-pyxis-importer\n")


def test_a_plugstack_every_node_mounts_is_changed_only_when_said(cli, tmp_path: Path,
                                                                 monkeypatch) -> None:
    """/etc/slurm on NFS: one --apply would put importer= on every node's line at once,
    before imgpipe is on them (every container job there would fail).  The mount table
    says NFS here (the sandbox has none to offer)."""
    import imgpipe.commands.site.nodecheck as nodecheck

    root = tmp_path / "node"
    _node(root)
    monkeypatch.setattr(nodecheck, "filesystem_type", lambda path: "nfs4")
    before = sums(root)
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer")
    assert code == 2 and "which other hosts mount" in err and "--shared-plugstack" in err
    assert sums(root) == before
    code, _, err = cli("node-config", "--apply", "--root", str(root), "--accept", "importer",
                       "--shared-plugstack")
    assert code == 0, err
    assert "importer=" in (root / "etc/slurm/plugstack.conf.d/pyxis.conf").read_text()


def test_a_venv_of_rhel_9s_python_is_named_with_what_fixes_it(cli, tmp_path: Path) -> None:
    """RHEL 9's python3 is 3.9: a venv made from it cannot run imgpipe (3.11+), and the check
    says so, with the packages that fix it, instead of a traceback in every job."""
    root = tmp_path / "node"
    _node(root)
    cfg = root / "opt/imgpipe/pyvenv.cfg"
    cfg.write_text("home = /usr/bin\nversion = 3.9.18\n")
    code, out, err = cli("node-config", "--check", "--root", str(root))
    assert code == 0, err
    line = next(x for x in out.splitlines() if "runs Python 3.9" in x)
    assert "imgpipe needs 3.11 or newer" in line and "dnf install python3.11" in line, line
    assert "python3.11 -m venv /opt/imgpipe" in line, line
    code, _, err = cli("node-config", "--apply", "--accept", "importer", "--root", str(root))
    assert code != 0 and "runs Python 3.9" in err and "Traceback" not in err, err
    cfg.write_text("home = /usr/bin\nversion = 3.11.2\n")
    code, out, _ = cli("node-config", "--check", "--root", str(root))
    assert "runs Python" not in out
