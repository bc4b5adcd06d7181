"""Config where sites keep it: /etc, then the user's, then the project's, then --config,
merged key by key; `imgpipe config show --origin` says which file set what; what the threat
model trusts comes only from a file root owns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from imgpipe.base.configlayers import load_settings, parse_settings
from imgpipe.base.errors import ConfigError
from imgpipe.commands.site.config import effective_keys


def _layers(tmp_path: Path) -> dict[str, Path]:
    site = tmp_path / "etc" / "imgpipe.yaml"
    user = tmp_path / "home" / ".config" / "imgpipe" / "imgpipe.yaml"
    project = tmp_path / "project" / "imgpipe.yaml"
    explicit = tmp_path / "run.yaml"
    for path, text in (
            (site, "registry: {host: head, port: 5000, scheme: https}\n"
                   "enroot: {cache_owner: root, zstd_level: 5}\n"
                   "recipes: {partition: gpu, profiles_dir: profiles}\n"),
            (user, "registry: {port: 5001}\nrecipes: {walltime_minutes: 60}\n"),
            (project, "default_flavor: ngc\nrecipes: {partition: a100}\n"),
            (explicit, "enroot: {zstd_level: 9}\n")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"site": site, "user": user, "project": project, "explicit": explicit}


def test_layers_merge_key_by_key_and_each_key_knows_its_file(tmp_path: Path) -> None:
    files = _layers(tmp_path)
    settings = load_settings(files["explicit"], cwd=files["project"].parent,
                             site=files["site"], user=files["user"])
    assert settings.registry.address == "head:5001"  # host from the site, port the user's
    assert settings.registry.scheme == "https"
    assert settings.enroot.zstd_level == 9 and settings.enroot.cache_owner == "root"
    assert settings.recipes.partition == "a100" and settings.recipes.walltime_minutes == 60
    assert settings.default_flavor == "ngc"
    # a relative path in a file is relative to that file's folder, defaults to the run's
    assert settings.recipes.profiles_dir == files["site"].parent / "profiles"
    assert settings.path(settings.outputs.squashfs_dir) == tmp_path / "build" / "squashfs"
    origin = {k.key: k.origin for k in effective_keys(settings)}
    assert origin["registry.host"] == str(files["site"])
    assert origin["registry.port"] == str(files["user"])
    assert origin["recipes.partition"] == str(files["project"])
    assert origin["enroot.zstd_level"] == str(files["explicit"])
    assert origin["registry.read_timeout_s"] == "default"


def test_config_show_origin_prints_every_key(cli, tmp_path: Path) -> None:
    cli.write_config({"registry": {"host": "head"}, "recipes": {"partition": "gpu"}})
    code, out, err = cli("config", "show", "--origin")
    assert code == 0, err
    project = str(cli.folder / "imgpipe.yaml")
    assert f"{project}  registry.host=\"head\"" in out.splitlines()[0]
    assert any(line.endswith('recipes.partition="gpu"') and line.startswith(project)
               for line in out.splitlines())
    assert any(line.startswith("default") and "registry.port=5000" in line
               for line in out.splitlines())
    code, out, _ = cli("config", "show", "--json")
    keys = {k["key"]: k for k in json.loads(out)["data"]["keys"]}
    assert keys["registry.host"]["origin"] == project and keys["registry.port"]["value"] == 5000


def test_a_key_the_threat_model_trusts_comes_only_from_a_root_owned_file(tmp_path: Path
                                                                         ) -> None:
    files = _layers(tmp_path)
    mine = tmp_path / "project" / "imgpipe.yaml"
    mine.write_text("enroot: {cache_owner: imgpipe-bob, cache_writer: /tmp/evil}\n")
    os.chown(mine, 65534, 65534)
    with pytest.raises(ConfigError) as caught:
        load_settings(cwd=mine.parent, site=files["site"], user=files["user"])
    message = str(caught.value)
    assert message.startswith(f"{mine}: enroot.cache_owner: only a file root owns")
    assert "uid 65534" in message and "\n" not in message
    with pytest.raises(ConfigError, match="enroot.cache_owner: only a file root owns"):
        parse_settings(mine)  # the importer's one file, likewise
    os.chown(mine, 0, 0)
    os.chmod(mine, 0o666)  # root's, but anyone may write it
    with pytest.raises(ConfigError, match="mode 0666"):
        parse_settings(mine)
    os.chmod(mine, 0o644)
    assert parse_settings(mine).enroot.cache_owner == "imgpipe-bob"


def test_a_bad_key_names_the_layer_that_set_it(tmp_path: Path) -> None:
    files = _layers(tmp_path)
    files["user"].write_text("registry: {port: fivethousand}\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(cwd=tmp_path, site=files["site"], user=files["user"])
    assert str(caught.value).startswith(f"{files['user']}: registry.port: must be an integer")


def test_a_folder_closed_to_this_account_is_passed_over(tmp_path, monkeypatch) -> None:
    """`sudo -u imgpipe-cache imgpipe …` started in root's home: the lookup of a project's
    imgpipe.yaml passes the folder it may not enter instead of failing with a traceback."""
    from pathlib import Path

    from imgpipe.base.configlayers import find_config

    closed = tmp_path / "root-home"
    closed.mkdir()
    (tmp_path / "imgpipe.yaml").write_text("{}\n")
    real = Path.is_file

    def is_file(path: Path) -> bool:
        if path.parent == closed:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(Path, "is_file", is_file)
    assert find_config(closed) == tmp_path / "imgpipe.yaml"
