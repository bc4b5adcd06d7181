"""Enroot's version decides the reference form: 4.0+ pulls by digest, 3.x does not
("Invalid image reference").  doctor says which Enroot it found and what follows; recipes
for Pyxis refuse a digest pin the nodes' Enroot cannot use, and pin squashfs files anyway.

The nodes' Enroot is learnt from `enroot version` (a stand-in script printing what Enroot's
own `version` command prints: the version alone) or from enroot.version in imgpipe.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CliRun

PINNED = "head:5000/imgpipe/bert@sha256:" + "ab" * 32


@pytest.fixture
def enroot_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def install(version: str) -> None:
        folder = tmp_path / "bin"
        folder.mkdir(exist_ok=True)
        script = folder / "enroot"
        script.write_text(f"#!/bin/sh\n[ \"$1\" = version ] && echo {version}\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
    return install


def render(cli: CliRun, image: str, *extra: str) -> tuple[int, str, str]:
    return cli("recipes", "render", "--profile", "dgx1", "--flavor", "ngc", "--nodes", "2",
               "--image", image, "-o", str(cli.folder / "out"), *extra)


def test_enroot_3_refuses_a_digest_pin_and_takes_a_squashfs_file(cli: CliRun,
                                                                 enroot_on_path) -> None:
    enroot_on_path("3.4.1")
    code, _, err = render(cli, PINNED)
    assert code == 1
    assert err.strip().splitlines() == [
        "error: the nodes' Enroot (3.4.1, from the enroot on this host) rejects digest "
        f"references such as {PINNED.replace('/', '#', 1)} (hint: convert the image "
        "(imgpipe convert, or push --convert) so the recipes pin its squashfs file, or "
        "upgrade Enroot to 4.0)"]
    assert not (cli.folder / "out").exists()
    code, _, err = render(cli, "/lustre/images/bert.sqsh")
    assert code == 0, err
    assert "/lustre/images/bert.sqsh" in (cli.folder / "out" / "run.sub").read_text()
    code, _, err = render(cli, PINNED, "--runtime", "host")  # no Enroot involved
    assert code == 0, err


def test_enroot_4_pins_the_digest(cli: CliRun, enroot_on_path) -> None:
    enroot_on_path("4.1.2")
    code, _, err = render(cli, PINNED)
    assert code == 0, err
    assert PINNED.replace("/", "#", 1) in (cli.folder / "out" / "run.sub").read_text()


def test_the_configured_version_speaks_for_the_nodes(cli: CliRun, enroot_on_path) -> None:
    enroot_on_path("4.1.2")  # this host's, but the nodes run 3.5
    cli.write_config({"enroot": {"version": "3.5"}})
    code, _, err = render(cli, PINNED)
    assert code == 1 and "(3.5.0, from enroot.version in imgpipe.yaml)" in err
    cli.write_config({"enroot": {"version": "four"}})
    code, _, err = render(cli, PINNED)
    assert code == 2 and "enroot.version" in err and "Traceback" not in err


@pytest.mark.parametrize(("version", "status", "words"), [
    ("3.4.1", "warn", "Enroot 3.4.1 (the enroot on this host) rejects @sha256 digest"),
    ("4.0.1", "ok", "Enroot 4.0.1 (the enroot on this host at "),
])
def test_doctor_reports_the_enroot_version_and_what_follows(cli: CliRun, enroot_on_path,
                                                            version: str, status: str,
                                                            words: str) -> None:
    from imgpipe.base.configlayers import load_settings
    from imgpipe.commands.site.doctor import check_enroot

    enroot_on_path(version)
    check = check_enroot(load_settings(cli.write_config({})))
    assert check.verdict == status and words in check.detail, check
    if status == "ok":  # where the host's enroot is, which doctor names
        assert check.detail.endswith("/enroot): digest references work"), check


def test_asking_enroot_its_version_leaves_nothing_in_home(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Enroot makes its runtime, cache and data folders (default under the user's home) on
    every command, `version` too: the probe points them at a scratch folder it removes, so a
    head node with real Enroot keeps no ~/.cache/enroot from `recipes render` or `doctor`."""
    from imgpipe.enroot.nodeconfig import detect_enroot

    home = tmp_path / "home"
    home.mkdir()
    seen = tmp_path / "seen"
    script = tmp_path / "enroot"
    script.write_text(  # makes its folders as Enroot's start-up does, with its defaults
        "#!/bin/sh\n"
        'for d in "${ENROOT_RUNTIME_PATH:-$HOME/.run/enroot}" '
        '"${ENROOT_CACHE_PATH:-$HOME/.cache/enroot}" "${ENROOT_DATA_PATH:-$HOME/.local/share/'
        'enroot}"; do mkdir -p "$d" && echo "$d" >> ' + str(seen) + "; done\n"
        "echo 4.1.2\n")
    script.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    assert detect_enroot(str(script)) == (4, 1, 2)
    made = seen.read_text().split()
    assert len(made) == 3 and not any(Path(d).exists() for d in made)
    assert list(home.iterdir()) == []
