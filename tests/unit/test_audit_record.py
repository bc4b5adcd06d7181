"""The importer's side of the audit log: each answer is one line when the site config sets
``audit.log`` (nothing changes when it does not), nothing of it reaches stdout, a record that
fails fails the import in one line, and only a file of root's alone chooses the audit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.commands.node import audit
from imgpipe.enroot.cache.storage import Storage

DIGEST = "sha256:" + "7e" * 32
URI = f"docker://127.0.0.1:9#imgpipe/bert@{DIGEST}"


def recorder(folder: Path) -> Path:
    """The recorder as a console script would start it (this checkout's Python)."""
    path = folder / "imgpipe-audit"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m imgpipe.cli.audit \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    """A converted digest in a cache, and a root config naming it and an audit log."""
    os.chmod(tmp_path, 0o700)
    cache = Storage(tmp_path / "sqsh")
    cache.prepare()
    entry = cache.squashfs("imgpipe/bert", DIGEST, "zstd")
    entry.write_bytes(b"hsqs")
    log = tmp_path / "log" / "audit.jsonl"
    config = tmp_path / "imgpipe.yaml"
    config.write_text(f"registry: {{host: '127.0.0.1', port: 9}}\n"
                      f"outputs: {{squashfs_dir: {tmp_path / 'sqsh'}}}\n"
                      f"audit: {{log: {log}, recorder: {recorder(tmp_path)}}}\n")
    config.chmod(0o644)
    return {"config": config, "log": log, "entry": entry, "folder": tmp_path}


def importer(node: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "IMGPIPE_CONFIG": str(node["config"]),
           "XDG_RUNTIME_DIR": str(node["folder"]), "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    return subprocess.run([sys.executable, "-m", "imgpipe.cli.importer", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_a_fast_path_get_is_one_line_and_stdout_is_the_path_alone(node) -> None:
    done = importer(node, "get", URI)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{node['entry']}\n" and done.stderr == ""
    [line] = [json.loads(x) for x in node["log"].read_text().splitlines()]
    assert (line["event"], line["result"], line["digest"], line["job"], line["uid"]) == (
        "get", "found", DIGEST, "4242", 0)
    assert (line["image"], line["registry"], line["squashfs"]) == (
        f"127.0.0.1:9/imgpipe/bert@{DIGEST}", "127.0.0.1:9", str(node["entry"]))


def test_a_record_that_fails_fails_the_import_in_one_line(node) -> None:
    node["log"].parent.mkdir(mode=0o700)
    node["log"].parent.chmod(0o777)  # the recorder refuses a folder others may write
    done = importer(node, "get", URI)
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"imgpipe: error: the audit log {node['log']} ({node['config']}) "
                           "did not take this get: ")
    assert "may be written by others" in line and 'docs/admin.md, "Audit log"' in line
    assert not node["log"].exists()


def test_without_audit_log_nothing_is_recorded_or_started(node, monkeypatch) -> None:
    node["config"].write_text("registry: {host: '127.0.0.1', port: 9}\n")
    monkeypatch.setenv("IMGPIPE_CONFIG", str(node["config"]))
    monkeypatch.setattr(audit, "SITE_CONFIG", str(node["folder"] / "absent.yaml"))

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("no recorder runs without audit.log")

    monkeypatch.setattr("imgpipe.base.process.run", never)
    audit.record("get", f"127.0.0.1:9/imgpipe/bert@{DIGEST}", DIGEST, node["entry"], "found")


def test_only_a_file_of_root_s_alone_chooses_the_audit(node, monkeypatch) -> None:
    from imgpipe.base.configlayers import parse_settings

    os.chown(node["config"], 65534, -1)  # a job user's own IMGPIPE_CONFIG
    with pytest.raises(ConfigError, match="audit.log: only a file root owns"):
        audit.audit_keys(str(node["config"]))
    with pytest.raises(ConfigError, match="audit.log: only a file root owns"):
        parse_settings(node["config"])
    os.chown(node["config"], 0, -1)
    node["config"].write_text("audit: {log: relative/audit.jsonl}\n")
    with pytest.raises(ConfigError, match="audit.log: must be an absolute path"):
        audit.audit_keys(str(node["config"]))


def test_a_job_s_own_config_does_not_turn_the_site_s_audit_off(node, monkeypatch) -> None:
    own = node["folder"] / "own.yaml"
    own.write_text("registry: {host: '127.0.0.1', port: 9}\n")  # no audit: the site's holds
    monkeypatch.setenv("IMGPIPE_CONFIG", str(own))
    monkeypatch.setattr(audit, "SITE_CONFIG", str(node["config"]))
    site = audit.configured()
    assert site is not None and site.config == str(node["config"])
    assert site.log == str(node["log"])
    assert audit.configured(str(own)) is None  # the cache writer reads its one file alone


def test_root_runs_the_recorder_itself_and_a_refusal_names_the_fix(node, monkeypatch) -> None:
    monkeypatch.setenv("IMGPIPE_CONFIG", str(node["config"]))
    monkeypatch.setenv("SLURM_JOB_ID", "12; rm -rf /")  # not a job id: recorded as none
    audit.record("take", f"127.0.0.1:9/imgpipe/bert@{DIGEST}", DIGEST, None, "taken")
    [line] = [json.loads(x) for x in node["log"].read_text().splitlines()]
    assert (line["event"], line["job"], line["squashfs"]) == ("take", None, None)
    with pytest.raises(ImgpipeError,
                       match="did not take this take: imgpipe-audit: error: result bogus"):
        audit.record("take", f"127.0.0.1:9/imgpipe/bert@{DIGEST}", DIGEST, None, "bogus")
    site = audit.configured()
    assert site is not None and site.argv(["x"])[0] == str(site.recorder)  # root: no sudo
    assert site.sudoers() == (f"ALL ALL=(root) NOPASSWD: {site.recorder} --config "
                              f"{node['config']} *")


def test_what_a_conversion_answered() -> None:
    from imgpipe.enroot.convert import Conversion

    def made(converted: bool, published: str | None) -> Conversion:
        return Conversion("r", DIGEST, Path("/x"), converted, 0.0, 1, "zstd",
                          published=published)

    assert audit.result_of(made(False, None)) == "found"
    assert audit.result_of(made(True, None)) == "converted"
    assert audit.result_of(made(True, "sha256:" + "1" * 64)) == "fetched"


def test_another_registry_s_image_is_recorded_as_imported_by_enroot(tmp_path: Path) -> None:
    from tests.unit.test_importer_foreign import _importer as foreign_importer

    log = tmp_path / "log" / "audit.jsonl"
    config = f"registry: {{host: head, port: 5000}}\naudit: {{log: {log}, recorder: " \
             f"{recorder(tmp_path)}}}\n"
    for uri in ("docker://nvcr.io#nvidia/pytorch:25.01-py3", f"docker://ubuntu@{DIGEST}"):
        done = foreign_importer(tmp_path, "get", uri, config_text=config)
        assert done.returncode == 0, done.stderr
    tagged, pinned = [json.loads(x) for x in log.read_text().splitlines()]
    assert (tagged["image"], tagged["registry"], tagged["digest"], tagged["result"]) == (
        "nvcr.io/nvidia/pytorch:25.01-py3", "nvcr.io", None, "imported")
    assert (pinned["image"], pinned["digest"], pinned["job"]) == (
        f"registry-1.docker.io/ubuntu@{DIGEST}", DIGEST, "7")
