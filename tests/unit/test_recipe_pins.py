"""What the recipes hand the nodes follows what the site says its nodes run: with imgpipe's
importer (enroot.pyxis_importer: true) the digest, without it the squashfs file `imgpipe
convert` made (refused in one line until there is one), unsaid the file where one exists in
a shared folder.  Before, the recipes knew nothing of the nodes' Pyxis line."""

from __future__ import annotations

from pathlib import Path

import pytest

from imgpipe.pipeline.lock import LockEntry, lock_path, updating_lock
from tests.conftest import CliRun

DIGEST = "sha256:" + "d" * 64


def _lock(cli: CliRun, converted: bool) -> Path:
    made = cli.folder / "squashfs" / "bert.sqsh"
    made.parent.mkdir(exist_ok=True)
    if converted:
        made.write_bytes(b"hsqs" + bytes(92))
    with updating_lock(lock_path(cli.folder)) as lock:
        lock.images["bert"] = {"cpu": LockEntry(
            repository="head:5000/imgpipe/bert", tags=["0.1.0"], digest=DIGEST,
            config_digest="c", input_hash="h", inputs={}, flavor="cpu", base="b",
            pushed_at="now", squashfs=str(made))}
    return made


def _render(cli: CliRun, importer: bool | None) -> tuple[int, str, str]:
    enroot: dict[str, object] = {"version": "4.1.2"}
    if importer is not None:
        enroot["pyxis_importer"] = importer
    cli.write_config({"registry": {"host": "head"}, "enroot": enroot})
    return cli("recipes", "render", "--profile", "local", "--flavor", "cpu", "--nodes", "2",
               "-o", str(cli.folder / "out"))


@pytest.mark.parametrize(("importer", "converted", "pinned"), [
    (True, True, "digest"), (True, False, "digest"),
    (False, True, "file"),
    (None, True, "file"), (None, False, "digest")])
def test_the_pin_follows_what_the_nodes_run(cli: CliRun, importer: bool | None,
                                            converted: bool, pinned: str) -> None:
    made = _lock(cli, converted)
    code, _, err = _render(cli, importer)
    assert code == 0, err
    run_sub = (cli.folder / "out" / "run.sub").read_text()
    assert (str(made) in run_sub) is (pinned == "file")
    assert (f"head:5000#imgpipe/bert@{DIGEST}" in run_sub) is (pinned == "digest")


def test_nodes_without_the_importer_and_no_converted_file_is_one_line(cli: CliRun) -> None:
    _lock(cli, converted=False)
    code, _, err = _render(cli, False)
    assert code == 2 and not (cli.folder / "out").exists()
    assert err.strip().splitlines() == [
        "error: the nodes run Pyxis without imgpipe's importer (enroot.pyxis_importer: "
        "false), so jobs need bert/cpu's squashfs file, and imgpipe.lock records none "
        "(hint: imgpipe convert bert --flavor cpu (on a host that sees the shared squashfs "
        "folder), then render again)"]
