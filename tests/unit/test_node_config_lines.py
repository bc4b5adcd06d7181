"""The Pyxis line `imgpipe node-config` prints: what changes existing jobs is commented out and
marked unless --accept names it, and the plugstack is the one slurmd reads."""

from __future__ import annotations

from pathlib import Path

from imgpipe.base.configlayers import load_settings
from imgpipe.enroot.nodeconfig import find_plugstack, parse_version, render

IMPORTER = "/usr/local/bin/imgpipe-pyxis-importer"
CHANGING = ("importer=", "container_scope=job", "use_squashfuse=1")


def _settings(tmp_path: Path):
    (tmp_path / "imgpipe.yaml").write_text("registry: {host: head}\n")
    return load_settings(str(tmp_path / "imgpipe.yaml"))


def _required(text: str) -> str:
    [line] = [x for x in text.splitlines() if x.startswith("required")]
    return line


def test_every_option_that_changes_jobs_is_commented_and_marked(tmp_path: Path) -> None:
    config = render(_settings(tmp_path), IMPORTER, parse_version("0.24"),
                    enroot_path="/usr/bin/enroot")
    line = _required(config.plugstack_conf)
    assert not [o for o in CHANGING if o in line], line
    assert "runtime_path=/run/pyxis" in line  # Pyxis's own defaults stay
    marks = {"importer": f"#   importer={IMPORTER}", "container_scope": "#   container_scope=job",
             "squashfuse": "#   use_squashfuse=1"}
    lines = config.plugstack_conf.splitlines()
    for name, option in marks.items():
        at = lines.index(option)
        assert lines[at - 1].startswith("# option, changes existing jobs: "), lines[at - 1]
        assert f"--accept {name}" in lines[at - 1]
    assert "--accept pyxis" in lines[0]  # a Pyxis line where none was loads Pyxis anew


def test_accepted_options_go_on_the_line_and_leave_the_comments(tmp_path: Path) -> None:
    config = render(_settings(tmp_path), IMPORTER, parse_version("0.24"),
                    enroot_path="/usr/bin/enroot",
                    accept=frozenset({"importer", "squashfuse"}))
    line = _required(config.plugstack_conf)
    assert f"importer={IMPORTER}" in line and "use_squashfuse=1" in line
    assert "container_scope=job" not in line
    assert "#   container_scope=job" in config.plugstack_conf
    assert f"#   importer={IMPORTER}" not in config.plugstack_conf


def test_the_plugstack_is_found_as_slurmd_finds_it(tmp_path: Path) -> None:
    assert find_plugstack(tmp_path) == ("/etc/slurm/plugstack.conf",
                                        "Slurm's default (no slurm.conf found)")
    llnl = tmp_path / "etc" / "slurm-llnl"
    llnl.mkdir(parents=True)
    (llnl / "slurm.conf").write_text("ClusterName=old\n")
    assert find_plugstack(tmp_path)[0] == "/etc/slurm-llnl/plugstack.conf"
    slurm = tmp_path / "etc" / "slurm"
    slurm.mkdir()
    (slurm / "slurm.conf").write_text("# PlugStackConfig=/nowhere\n"
                                      "plugstackconfig = /etc/site/spank.conf  # ours\n")
    assert find_plugstack(tmp_path) == ("/etc/site/spank.conf",
                                        "PlugStackConfig in /etc/slurm/slurm.conf")
