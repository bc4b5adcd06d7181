"""The audit log (issue #63) with real accounts on the sandbox cluster: a sudoers line every
user may use, the importer's `get` and `take` and the cache writer recording as themselves,
the recorder refusing what it should in one line (and writing nothing), and the real
`logrotate` rotating the log with the file the recorder prints.

Everything lives in a folder root made in /tmp (never /etc/imgpipe or /var/log); each sudoers
file the tests install is removed after.  `broadcast` records through the same `record` on
each node (commands/node/broadcast.py); an MPI step is not started here for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import shared_folder
from tests.tenants import ALICE, BOB, REPO, SERVICE, as_user, ensure_user, image


def _sudoers(folder: Path, lines: list[str]) -> Path:
    """A sudoers file of ``lines``, checked by visudo, installed; the caller removes it."""
    sudoers = Path(f"/etc/sudoers.d/imgpipe-audit-tests-{os.getpid()}-{len(lines)}")
    staged = folder / f"sudoers-{len(lines)}"
    staged.write_text("".join(f"{line}\n" for line in lines))
    subprocess.run(["visudo", "-cqf", str(staged)], check=True, capture_output=True)
    os.chmod(staged, 0o440)
    shutil.move(staged, sudoers)
    return sudoers


def _audit_config(folder: Path, site, log: Path, **enroot: str) -> Path:
    """A config of root's (0644, in a root folder) naming the site's cache and an audit log."""
    config = folder / "imgpipe.yaml"
    config.write_text(json.dumps({
        "registry": {"host": "head", "port": 5000},
        "outputs": {"squashfs_dir": str(enroot.pop("cache", site["cache"]))},
        "enroot": enroot,
        "audit": {"log": str(log), "recorder": str(site["bin"] / "imgpipe-audit")}}))
    os.chmod(config, 0o644)
    return config


@pytest.fixture(scope="module")
def audited(site) -> Iterator[dict]:
    """The site's shared cache, a config with `audit.log`, and the recorder's sudoers line."""
    folder = shared_folder("imgpipe-audit-")
    log = folder / "log" / "audit.jsonl"
    config = _audit_config(folder, site, log)
    recorder = site["bin"] / "imgpipe-audit"
    sudoers = _sudoers(folder, [f"ALL ALL=(root) NOPASSWD: {recorder} --config {config} *"])
    try:
        yield {"folder": folder, "log": log, "config": config, "recorder": recorder}
    finally:
        sudoers.unlink()


def lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _uid(name: str) -> int:
    return pwd.getpwnam(name).pw_uid


def _host(site, node: int) -> str:
    cluster = site["cluster"]
    return cluster.run(["hostname"], host=cluster.spec.nodes[node]).stdout.strip()


def _importer(site, audited, user: str, *args: str, node: int = 0, job: str = "77"
              ) -> subprocess.CompletedProcess[str]:
    cluster = site["cluster"]
    return cluster.run([str(site["bin"] / "imgpipe-pyxis-importer"), *args], user=user,
                       env={"IMGPIPE_CONFIG": str(audited["config"]), "SLURM_JOB_ID": job},
                       host=cluster.spec.nodes[node], timeout=300, cwd="/tmp")


def _sudo(site, audited, user: str, args: list[str], prefix: str = "sudo -n",
          config: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(audited["recorder"]), "--config", str(config or audited["config"]), *args]
    return as_user(site, user, f"{prefix} {shlex.join(argv)}".strip())


def test_each_get_is_one_line_of_its_user(site, audited, registry_server) -> None:
    """threat-model: "a line's `uid` and `user` are whom sudo vouches for"."""
    digest = image(registry_server, "audit-get")
    pinned, tagged = f"docker://head:5000#{REPO}@{digest}", "docker://head:5000#tenants/img:audit-get"
    before = len(lines(audited["log"]))
    first = _importer(site, audited, ALICE, "get", pinned, job="101")
    assert first.returncode == 0, first.stderr
    entry = first.stdout.strip()
    assert first.stdout == f"{entry}\n"  # Pyxis reads the path: nothing of the audit is there
    again = _importer(site, audited, ALICE, "get", pinned, job="102")
    by_tag = _importer(site, audited, ALICE, "get", tagged, node=1, job="103")
    assert again.stdout == by_tag.stdout == first.stdout, (again.stderr, by_tag.stderr)
    got = lines(audited["log"])[before:]
    assert [(x["event"], x["result"], x["job"]) for x in got] == [
        ("get", "converted", "101"), ("get", "found", "102"), ("get", "found", "103")]
    for line in got:
        assert (line["uid"], line["user"], line["digest"], line["squashfs"], line["registry"]) \
            == (_uid(ALICE), ALICE, digest, entry, "head:5000")
    assert [x["image"] for x in got] == [f"head:5000/{REPO}@{digest}"] * 2 + [
        "head:5000/tenants/img:audit-get"]
    assert [x["host"] for x in got] == [_host(site, 0), _host(site, 0), _host(site, 1)]


def test_the_log_is_root_s_alone(site, audited) -> None:
    """threat-model: "root alone: a file root owns, 0600"."""
    log = audited["log"]
    digest = "sha256:" + "ef" * 32
    done = _sudo(site, audited, ALICE, ["get", f"head:5000/{REPO}@{digest}", digest, "-",
                                        "found", "-"])
    assert done.returncode == 0 and done.stdout == "", done.stderr
    info, folder = log.stat(), log.parent.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode), info.st_nlink) == (0, 0o600, 1)
    assert folder.st_uid == 0 and not folder.st_mode & 0o022
    for script in (f"cat {log}", f"ls {log.parent}", f"echo forged >> {log}",
                   f"mv {log} {log}.x", f"rm -f {log}"):
        done = as_user(site, BOB, script)
        assert done.returncode != 0 and "Permission denied" in done.stderr, script
    assert log.exists() and b"forged" not in log.read_bytes()


def test_a_call_of_another_form_is_one_line_and_writes_nothing(site, audited, tmp_path) -> None:
    """threat-model: "an argument of another form is refused in one line and writes
    nothing"."""
    digest = "sha256:" + "ab" * 32
    good = ["get", f"head:5000/{REPO}@{digest}", digest, "-", "found", "5"]
    evil = Path(f"/home/{BOB}/audit.yaml")
    evil.write_text(f"audit: {{log: /home/{BOB}/mine.jsonl}}\n")
    os.chown(evil, _uid(BOB), -1)
    before = audited["log"].read_bytes()
    for args, prefix, config, refusal in (
            (["rm", *good[1:]], "sudo -n", None, "event rm: must be one of"),
            ([*good[:2], "sha256:00", *good[3:]], "sudo -n", None, "digest sha256:00"),
            ([*good[:3], "/x\n{\"uid\":0}", *good[4:]], "sudo -n", None, "squashfs /x\\n"),
            ([*good[:5], "5;id"], "sudo -n", None, "must be a Slurm job id"),
            ([*good, "uid=0"], "sudo -n", None, "takes EVENT IMAGE DIGEST"),
            (["--config", str(evil), *good[:4]], "sudo -n", None, "event --config: must be"),
            (good, "sudo -n", evil, "password is required"),  # sudoers names one config
            (good, "", None, "imgpipe-audit runs as root only"),  # without sudo
            (good, "sudo -n SUDO_UID=0", None, "not allowed to set")):
        done = _sudo(site, audited, BOB, args, prefix, config)
        assert done.returncode != 0, args
        # the sandbox's hosts resolve no host name: sudo says so first, on every call
        said = [x for x in done.stderr.splitlines() if "unable to resolve host" not in x]
        assert len(said) == 1 and refusal in said[0], (refusal, done.stderr)
    assert audited["log"].read_bytes() == before
    assert not Path(f"/home/{BOB}/mine.jsonl").exists()


def test_a_caller_cannot_name_another_uid(site, audited) -> None:
    """threat-model: "a user adds lines naming only themselves and can read, change or remove
    no line"."""
    digest = "sha256:" + "cd" * 32
    args = ["get", f"head:5000/{REPO}@{digest}", digest, "-", "found", "6"]
    done = _sudo(site, audited, BOB, args, prefix="SUDO_UID=0 SUDO_USER=root sudo -n")
    assert done.returncode == 0, done.stderr
    line = lines(audited["log"])[-1]
    assert (line["uid"], line["user"], line["digest"]) == (_uid(BOB), BOB, digest)


def test_take_records_what_the_node_took(site, audited, registry_server) -> None:
    """`take` with an sbcast copy (bob's own, hashing to the staged sha256): taken; again,
    the entry it made: found."""
    from imgpipe.enroot.cache.storage import Storage

    digest = image(registry_server, "audit-take")
    uri = f"docker://head:5000#{REPO}@{digest}"
    made = _importer(site, audited, ALICE, "get", uri)
    assert made.returncode == 0, made.stderr
    source = Path(made.stdout.strip())
    sha256 = "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()
    copy = Storage(site["cache"]).tmp / f"sbcast.u{_uid(BOB)}.88.{secrets.token_hex(8)}.sqsh"
    placed = as_user(site, BOB, f"cp {shlex.quote(str(source))} {shlex.quote(str(copy))}")
    assert placed.returncode == 0, placed.stderr
    took = _importer(site, audited, BOB, "take", uri, sha256, str(copy), digest, node=1,
                     job="88")
    assert took.returncode == 0, took.stderr
    again = _importer(site, audited, BOB, "take", uri, node=1, job="89")
    assert again.returncode == 0 and again.stdout == took.stdout, again.stderr
    got = [x for x in lines(audited["log"]) if x["digest"] == digest]
    assert [(x["user"], x["event"], x["result"], x["job"]) for x in got] == [
        (ALICE, "get", "converted", "77"), (BOB, "take", "taken", "88"),
        (BOB, "take", "found", "89")]
    assert got[1]["squashfs"] == took.stdout.strip()


def test_a_record_that_fails_fails_the_import_in_one_line(site, audited, registry_server
                                                          ) -> None:
    """threat-model: "a record that fails fails the import in one line"."""
    digest = image(registry_server, "audit-unrecorded")
    config = audited["folder"] / "no-sudoers.yaml"  # a config no sudoers line names
    shutil.copy(audited["config"], config)
    done = site["cluster"].run(
        [str(site["bin"] / "imgpipe-pyxis-importer"), "get", f"head:5000#{REPO}@{digest}"],
        user=ALICE, env={"IMGPIPE_CONFIG": str(config)}, host=site["cluster"].spec.nodes[0],
        timeout=300, cwd="/tmp")
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()[-1:]
    assert f"did not take this get: sudo: a password is required (hint: as root, on every " \
        f"node, in /etc/sudoers.d/imgpipe: ALL ALL=(root) NOPASSWD: {audited['recorder']} " \
        f"--config {config} *)" in line
    assert "Traceback" not in done.stderr


def test_logrotate_rotates_it_with_the_file_the_recorder_prints(site, audited,
                                                                 registry_server) -> None:
    log, folder = audited["log"], audited["folder"]
    digest = "sha256:" + "0f" * 32
    done = _sudo(site, audited, ALICE, ["get", f"head:5000/{REPO}@{digest}", digest, "-",
                                        "found", "-"])
    assert done.returncode == 0, done.stderr
    before = log.read_bytes()
    printed = subprocess.run([str(audited["recorder"]), "--config", str(audited["config"]),
                            "--logrotate"], capture_output=True, text=True, check=True)
    conf = folder / "logrotate.conf"  # /etc/logrotate.d/imgpipe on a node
    conf.write_text(printed.stdout)
    conf.chmod(0o644)
    rotated = subprocess.run(["logrotate", "-f", "-s", str(folder / "logrotate.state"),
                              str(conf)], capture_output=True, text=True, timeout=60)
    assert rotated.returncode == 0, rotated.stderr
    assert Path(f"{log}.1").read_bytes() == before
    fresh = log.stat()
    assert (fresh.st_uid, stat.S_IMODE(fresh.st_mode), fresh.st_size) == (0, 0o600, 0)
    log.unlink()  # missing altogether: the next record makes it, root's and 0600
    digest = image(registry_server, "audit-rotated")
    got = _importer(site, audited, ALICE, "get", f"head:5000#{REPO}@{digest}")
    assert got.returncode == 0, got.stderr
    assert [x["digest"] for x in lines(log)] == [digest]
    made = log.stat()
    assert (made.st_uid, stat.S_IMODE(made.st_mode)) == (0, 0o600)


@pytest.fixture(scope="module")
def audited_writer(site) -> Iterator[dict]:
    """The cache's service account writes the shared entries, and records as itself."""
    from imgpipe.enroot.cache.layout import make_layout
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.cache.trust import CacheTrust

    ensure_user(SERVICE)
    folder = shared_folder("imgpipe-audit-writer-")
    cache = folder / "squashfs"
    make_layout(Storage(cache, CacheTrust.of(SERVICE)))
    writer, recorder = site["bin"] / "imgpipe-cache-writer", site["bin"] / "imgpipe-audit"
    log = folder / "log" / "audit.jsonl"
    config = _audit_config(folder, site, log, cache=str(cache), cache_owner=SERVICE,
                           cache_writer=f"{writer} --config {folder / 'imgpipe.yaml'}")
    sudoers = _sudoers(folder, [f"ALL ALL=({SERVICE}) NOPASSWD: {writer} --config {config} *",
                                f"ALL ALL=(root) NOPASSWD: {recorder} --config {config} *"])
    try:
        yield {"log": log, "config": config}
    finally:
        sudoers.unlink()


def test_the_writer_records_what_it_wrote_as_itself(site, audited_writer, registry_server
                                                     ) -> None:
    digest = image(registry_server, "audit-writer")
    done = _importer(site, audited_writer, ALICE, "get", f"head:5000#{REPO}@{digest}", job="9")
    assert done.returncode == 0, done.stderr
    assert f"asking {SERVICE} to convert" in done.stderr
    written, got = lines(audited_writer["log"])
    assert (written["event"], written["result"], written["user"], written["uid"],
            written["job"]) == ("write", "converted", SERVICE, _uid(SERVICE), None)
    assert (got["event"], got["result"], got["user"], got["job"]) == (
        "get", "found", ALICE, "9")
    assert written["digest"] == got["digest"] == digest
    assert written["squashfs"] == got["squashfs"] == done.stdout.strip()
