"""imgpipe.yaml: discovery, defaults, and one clear line for each mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from imgpipe.base.configlayers import load_settings
from imgpipe.base.errors import ConfigError


def test_no_file_gives_the_one_machine_default(tmp_path: Path) -> None:
    settings = load_settings(cwd=tmp_path)
    assert settings.registry.url == "http://127.0.0.1:5000"
    assert settings.path(settings.outputs.squashfs_dir) == tmp_path / "build/squashfs"
    assert settings.source is None


def test_found_by_walking_up_and_paths_resolve_against_it(tmp_path: Path) -> None:
    (tmp_path / "imgpipe.yaml").write_text("registry: {host: head, port: 5001}\n"
                                           "outputs: {squashfs_dir: /shared/sqsh}\n")
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    settings = load_settings(cwd=deep)
    assert settings.registry.address == "head:5001"
    assert settings.path(settings.outputs.squashfs_dir) == Path("/shared/sqsh")
    assert settings.path(settings.outputs.recipes_dir) == tmp_path / "build/recipes"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("registry: {prot: 5000}\n", "imgpipe.yaml: registry.prot: unknown key"),
        ("registry: {port: fivethousand}\n",
         "imgpipe.yaml: registry.port: must be an integer, not 'fivethousand'"),
        ("registry: {scheme: ftp}\n", "imgpipe.yaml: registry.scheme: must be one of"),
        ("registry: {host: 'http://head'}\n", "imgpipe.yaml: registry.host: must be a host"),
        ("default_flavor: gpu\n", "imgpipe.yaml: default_flavor: must be one of 'ngc', 'cpu'"),
        ("registry: [1, 2]\n", "imgpipe.yaml: registry: must be a mapping"),
        ("registry: {port: 1\n", "imgpipe.yaml: not valid YAML (line"),
        ("- a\n", "imgpipe.yaml: must be a mapping of keys to values"),
        ("root: /x\n", "imgpipe.yaml: root: unknown key"),
    ],
)
def test_mistakes_name_file_key_and_problem(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "imgpipe.yaml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_settings(cwd=tmp_path)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_explicit_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_settings(tmp_path / "nope.yaml")


def test_cli_config_errors_exit_2_with_one_line(cli) -> None:
    cli.write_config({"registry": {"port": "abc"}})
    code, out, err = cli("registry", "status")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: {cli.folder / 'imgpipe.yaml'}: registry.port: must be an integer, not 'abc'"
    ]
    assert "Traceback" not in err and out == ""


def test_cli_config_error_in_json_mode_is_an_envelope(cli) -> None:
    import json

    cli.write_config({"registry": {"colour": "blue"}})
    code, out, _ = cli("registry", "status", "--json")
    assert code == 2
    envelope = json.loads(out)
    assert envelope["status"] == "error"
    assert envelope["errors"][0]["code"] == "config"
    assert "registry.colour: unknown key" in envelope["errors"][0]["message"]


def test_the_published_squashfs_keys_of_earlier_releases_are_still_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One word for the published squashfs: enroot.published(_unpinned); a site config that
    still says prebuilt is read as before, with one line saying the new name."""
    from imgpipe.base import config

    config._SAID.clear()
    (tmp_path / "imgpipe.yaml").write_text("enroot: {prebuilt: false, prebuilt_unpinned: true}\n")
    settings = load_settings(tmp_path / "imgpipe.yaml")
    assert (settings.enroot.published, settings.enroot.published_unpinned) == (False, True)
    err = capsys.readouterr().err.splitlines()
    assert err == ["imgpipe: deprecated: enroot.prebuilt is now enroot.published; the old "
                   "name is still read", "imgpipe: deprecated: enroot.prebuilt_unpinned is "
                   "now enroot.published_unpinned; the old name is still read"]
    (tmp_path / "imgpipe.yaml").write_text("enroot: {prebuilt: false, published: true}\n")
    assert load_settings(tmp_path / "imgpipe.yaml").enroot.published is True  # the new wins
