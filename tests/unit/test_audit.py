"""The audit recorder (``imgpipe-audit``) is narrow: every argument of a fixed form, the config
and the log root's alone, one JSON line per call and nothing else (issue #63).  Run as root,
as the recorder is; tests/e2e/test_audit.py plays the same through sudo with real accounts."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from imgpipe.base.errors import ImgpipeError
from imgpipe.cli.audit import main
from imgpipe.commands.node.auditlog import (
    AUDIT_PATH,
    Entry,
    append,
    audit_log,
    caller_uid,
    logrotate_file,
    record_call,
)

DIGEST = "sha256:" + "c3" * 32
IMAGE = f"head:5000/tenants/img@{DIGEST}"
GOOD = ["get", IMAGE, DIGEST, "/cache/tenants+img+sha256-c3.sqsh", "found", "4242"]
NOBODY = 65534


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Path]:
    """A config of root's naming a log in a folder the recorder makes."""
    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    log = tmp_path / "log" / "audit.jsonl"
    config = folder / "imgpipe.yaml"
    config.write_text(f"audit:\n  log: {log}\n")
    config.chmod(0o644)
    return {"config": config, "log": log}


def lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_one_call_is_one_json_line_naming_whom_sudo_vouches_for(site) -> None:
    record_call(str(site["config"]), GOOD, {"SUDO_UID": "0", "HOME": "/ignored"})
    record_call(str(site["config"]), ["take", "head:5000/tenants/img:v1", "-", "-", "taken",
                                      "-"], {})
    first, second = lines(site["log"])
    assert set(first) == {"time", "host", "uid", "user", "event", "image", "registry",
                          "digest", "squashfs", "result", "job"}
    assert first["uid"] == 0 and first["user"] == "root" and first["host"] == os.uname().nodename
    assert (first["event"], first["image"], first["registry"], first["digest"],
            first["squashfs"], first["result"], first["job"]) == (
        "get", IMAGE, "head:5000", DIGEST, GOOD[3], "found", "4242")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert (second["digest"], second["squashfs"], second["job"]) == (None, None, None)
    assert second["image"] == "head:5000/tenants/img:v1"
    info = site["log"].stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == 0
    assert stat.S_IMODE(site["log"].parent.stat().st_mode) == 0o700


def test_the_uid_is_sudo_s_and_a_caller_cannot_name_another() -> None:
    assert caller_uid({"SUDO_UID": "1001", "USER": "root", "LOGNAME": "root"}, 0) == 1001
    assert caller_uid({}, 0) == 0  # root itself, not through sudo
    with pytest.raises(ImgpipeError, match="not a uid"):
        caller_uid({"SUDO_UID": "0 1001"}, 0)
    with pytest.raises(ImgpipeError, match="runs as root only"):
        caller_uid({"SUDO_UID": "0"}, 1001)
    with pytest.raises(ImgpipeError, match="takes EVENT IMAGE"):  # no uid argument exists
        Entry.parse([*GOOD, "uid=0"])


@pytest.mark.parametrize(("at", "value", "refusal"), [
    (0, "rm", "event rm: must be one of get, take, broadcast, write"),
    (4, "deleted", "result deleted: must be one of"),
    (1, "no registry/img:tag", "not an image reference with its registry"),
    (1, "head:5000/" + "a" * 1100, "longer than 1024"),
    (1, "head:5000/img:v1\n{\"uid\": 0}", "not an image reference"),
    (2, "sha256:" + "C3" * 32, "must be sha256: and 64 lower-case hex digits"),
    (2, "md5:00", "must be sha256:"),
    (3, "/cache/x.sqsh\n{\"uid\": 0}", "squashfs"),
    (3, "/x\x1b[2J", "squashfs"),
    (3, "/" + "x" * 3000, "squashfs"),
    (3, "", "squashfs"),
    (5, "12; rm -rf /", "must be a Slurm job id"),
    (5, "\u0661\u0662", "must be a Slurm job id"),  # digits of another script
])
def test_each_argument_has_one_form(at: int, value: str, refusal: str) -> None:
    args = list(GOOD)
    args[at] = value
    with pytest.raises(ImgpipeError, match=re.escape(refusal)):
        Entry.parse(args)


def test_a_refused_call_writes_no_line_and_says_one(site, capsys) -> None:
    config = str(site["config"])
    assert main(["--config", config, *GOOD]) == 0
    for argv in (["--config", config, "rm", *GOOD[1:]],
                 ["--config", config, *GOOD, "extra"],
                 ["--config", config, "--config", "/home/bob/evil.yaml", *GOOD[:4]],
                 ["--config", config, *GOOD[:3], "/x\n{\"uid\":0}", *GOOD[4:]]):
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("imgpipe-audit: error: "), err
    for argv in ([], ["get"], ["--configx", config, *GOOD]):
        assert main(argv) == 2
    assert len(lines(site["log"])) == 1


def test_the_config_must_be_root_s_alone(site, tmp_path: Path) -> None:
    config = site["config"]
    os.chown(config, NOBODY, -1)
    with pytest.raises(ImgpipeError, match="reads only a config root owns"):
        audit_log(str(config))
    os.chown(config, 0, -1)
    config.chmod(0o664)
    with pytest.raises(ImgpipeError, match="mode 0664"):
        audit_log(str(config))
    config.chmod(0o644)
    link = config.parent / "link.yaml"
    link.symlink_to(config)
    with pytest.raises(ImgpipeError, match="link.yaml"):
        audit_log(str(link))
    config.parent.chmod(0o777)  # someone else could swap the file
    with pytest.raises(ImgpipeError, match="may be written by others"):
        audit_log(str(config))
    config.parent.chmod(0o755)
    with pytest.raises(ImgpipeError, match="must be an absolute path"):
        audit_log("etc/imgpipe.yaml")
    config.write_text("registry: {port: 5000}\n")
    with pytest.raises(ImgpipeError, match="sets no audit.log"):
        audit_log(str(config))
    config.write_text("audit: {log: /var/log/../../etc/shadow}\n")
    with pytest.raises(ImgpipeError, match="audit.log: must be an absolute path"):
        audit_log(str(config))


def test_the_log_is_appended_only_when_it_is_root_s_alone(site) -> None:
    log, line = site["log"], b'{"x": 1}\n'
    append(str(log), line)
    append(str(log), line)
    assert log.read_bytes() == line * 2
    log.chmod(0o640)
    with pytest.raises(ImgpipeError, match="not root's alone"):
        append(str(log), line)
    log.chmod(0o600)
    os.chown(log, NOBODY, -1)
    with pytest.raises(ImgpipeError, match="owner uid 65534"):
        append(str(log), line)
    os.chown(log, 0, -1)
    twin = log.parent / "twin"
    os.link(log, twin)  # a second name: the file could be read or swapped through it
    with pytest.raises(ImgpipeError, match="2 link"):
        append(str(log), line)
    twin.unlink()
    assert log.read_bytes() == line * 2


@pytest.mark.parametrize("planted", ["symlink", "fifo", "folder"])
def test_nothing_but_a_regular_file_is_written(site, tmp_path: Path, planted: str) -> None:
    log = site["log"]
    log.parent.mkdir(mode=0o700)
    target = tmp_path / "shadow"
    target.write_text("root:x:0\n")
    if planted == "symlink":
        log.symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(log)  # opened without blocking: refused, never waited on
    else:
        log.mkdir()
    with pytest.raises(ImgpipeError, match="cannot be opened|not root's alone"):
        append(str(log), b"line\n")
    assert target.read_text() == "root:x:0\n"


def test_the_log_s_folder_is_root_s_and_nobody_else_writes_it(site) -> None:
    folder = site["log"].parent
    folder.mkdir(mode=0o700)
    folder.chmod(0o1777)
    with pytest.raises(ImgpipeError, match="may be written by others"):
        append(str(site["log"]), b"line\n")
    folder.chmod(0o700)
    os.chown(folder, NOBODY, -1)
    with pytest.raises(ImgpipeError, match="65534"):
        append(str(site["log"]), b"line\n")
    assert not site["log"].exists()


def test_logrotate_s_file_names_the_configured_log(site) -> None:
    text = logrotate_file(str(site["config"]))
    assert text.startswith(f"{site['log']} {{\n")
    assert "    create 0600 root root\n" in text and text.endswith("}\n")


@pytest.mark.parametrize("path", ["/var/log/imgpipe/audit.jsonl", "/opt/imgpipe/bin/imgpipe-audit",
                                  "var/log/x", "/var/log/../x", "/var/log/.x", "/a b", "/a\nb",
                                  "/a/", "/a*", "/", "/x/+y-z_1.2"])
def test_the_config_model_and_the_recorder_take_the_same_paths(path: str) -> None:
    from pydantic import ValidationError

    from imgpipe.base.config import AuditConfig
    from imgpipe.commands.node.audit import DEFAULT_RECORDER

    try:
        AuditConfig(log=path)
        model = True
    except ValidationError:
        model = False
    assert model == bool(AUDIT_PATH.fullmatch(path)), path
    assert AuditConfig().recorder == DEFAULT_RECORDER
