"""Hostile and broken layers: each refused with a clear error, nothing written outside.

Every case is pushed to the real registry as an image and converted through the
CLI, so the whole path (fetch, verify, merge, squash) meets it.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path

import pytest

from tests import services
from tests.conftest import CliRun
from tests.hostile_layers import BASE, CASES, entry, layer


@pytest.fixture
def jail(tmp_path: Path, registry_server, capsys) -> tuple[CliRun, Path]:
    """A project whose squashfs directory is its only place to write; `outside` must stay empty."""
    work = tmp_path / "project"
    work.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    cli = CliRun(work, capsys)
    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(work / "sqsh")}})
    return cli, outside


def assert_nothing_escaped(tmp_path: Path, outside: Path) -> None:
    assert list(outside.iterdir()) == []
    for root, _dirs, files in os.walk(tmp_path):
        assert "pwned" not in files and "escape" not in files, root
    assert not Path("/etc/pwned").exists() and not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_layer_is_refused(case: str, jail, registry_server, tmp_path) -> None:
    cli, outside = jail
    layers, expected = CASES[case]
    repo = "hostile/" + re.sub(r"[^a-z0-9]+", "-", case.lower()).strip("-")
    services.push_image(services.plain_session(), registry_server.url, repo, "1", layers)
    code, out, err = cli("convert", f"{registry_server.address}/{repo}:1")
    assert code == 1, (out, err)
    [line] = [text for text in err.splitlines() if text.startswith("error:")]
    assert line.startswith("error: layer sha256:") and expected in line, line
    assert "Traceback" not in err
    assert not list((cli.folder / "sqsh").glob("*.sqsh"))
    assert not list((cli.folder / "sqsh").glob(".tmp-*"))
    assert_nothing_escaped(tmp_path, outside)


def test_blob_with_the_wrong_digest_never_enters_the_cache(jail, registry_server,
                                                           tmp_path) -> None:
    cli, outside = jail
    good = layer(entry("ok", data=b"fine\n"))
    services.push_image(services.plain_session(), registry_server.url, "hostile/digest", "1",
                        [good])
    digest = services.digest_of(good).split(":")[1]
    on_disk = (registry_server.data / "docker/registry/v2/blobs/sha256" / digest[:2] / digest
               / "data")
    on_disk.write_bytes(layer(entry("ok", data=b"evil\n")))
    code, _, err = cli("convert", f"{registry_server.address}/hostile/digest:1")
    assert code == 1
    assert f"blob sha256:{digest} of hostile/digest failed verification" in err
    assert not (cli.folder / "sqsh/.imgpipe/blobs/sha256" / digest).exists()
    assert_nothing_escaped(tmp_path, outside)


def test_device_nodes_and_dev_entries_are_dropped_not_fatal(jail, registry_server) -> None:
    import subprocess

    cli, _ = jail
    layers = [layer(entry("dev/", tarfile.DIRTYPE), entry("dev/null", tarfile.CHRTYPE),
                    entry("disk", tarfile.BLKTYPE), entry("dev/shm/x"), entry("ok"))]
    services.push_image(services.plain_session(), registry_server.url, "hostile/devices", "1",
                        layers)
    code, out, err = cli("convert", f"{registry_server.address}/hostile/devices:1", "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["layers"][0]["devices_skipped"] == 3
    listing = subprocess.run(["unsquashfs", "-l", "-d", "R", data["squashfs"]],
                             capture_output=True, text=True, check=True).stdout.split()
    assert "R/dev" in listing and "R/ok" in listing
    assert not [p for p in listing if p.startswith("R/dev/") or p == "R/disk"]


def test_a_diff_id_other_than_the_content_is_refused_when_asked(jail, registry_server,
                                                                 tmp_path) -> None:
    cli, outside = jail
    services.push_image(services.plain_session(), registry_server.url, "hostile/diffid", "1",
                        [BASE], diff_ids=[services.digest_of(b"something else")])
    ref = f"{registry_server.address}/hostile/diffid:1"
    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(cli.folder / "sqsh")},
                      "enroot": {"verify_diff_ids": True}})
    code, _, err = cli("convert", ref)
    assert code == 1
    assert "not to the image config's diff_id" in err and "Traceback" not in err
    assert not list((cli.folder / "sqsh").glob("*.sqsh"))
    # By default, as Enroot, only the blobs' digests are checked: the root is the same
    # whatever the config claims, and the conversion goes through.
    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(cli.folder / "sqsh")}})
    code, _, err = cli("convert", ref)
    assert code == 0, err
    assert len(list((cli.folder / "sqsh").glob("*.sqsh"))) == 1


def test_an_unknown_layer_media_type_is_refused(jail, registry_server) -> None:
    cli, _ = jail
    services.push_image(services.plain_session(), registry_server.url, "hostile/foreign", "1",
                        [BASE], media_type="application/vnd.example.helm.chart.v1+gzip")
    code, _, err = cli("convert", f"{registry_server.address}/hostile/foreign:1")
    assert code == 1 and "unknown layer media type" in err


def test_a_path_twice_in_one_layer_converts_in_two_passes(jail, registry_server) -> None:
    """Legal but odd (tar keeps the last): the one pass cannot place it, says so, and the
    conversion merges first; the squashfs holds the later copy."""
    import subprocess

    cli, _ = jail
    twice = layer(entry("etc/", tarfile.DIRTYPE), entry("etc/motd", data=b"first\n"),
                  entry("etc/motd", data=b"second\n"))
    services.push_image(services.plain_session(), registry_server.url, "odd/twice", "1",
                        [BASE, twice])
    code, out, err = cli("convert", f"{registry_server.address}/odd/twice:1")
    assert code == 0, err
    assert "one pass cannot place 'etc/motd'" in out + err and "two passes" in out + err
    [squashfs] = [str(path) for path in (cli.folder / "sqsh").glob("*.sqsh")]
    shown = subprocess.run(["rdsquashfs", "--cat", "etc/motd", squashfs],
                           capture_output=True, check=True).stdout
    assert shown == b"second\n"
