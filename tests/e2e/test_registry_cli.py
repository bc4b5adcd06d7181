"""`imgpipe registry …` end to end: real engine, real registry, the CLI in-process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import services
from tests.conftest import CliRun


def docker(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run([services.DOCKER, *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_image_pushed_with_docker_is_listed(cli, registry_server, base_image) -> None:
    target = f"{registry_server.address}/cli/base:pushed"
    docker("tag", base_image, target)
    docker("push", target)
    pushed_digest = docker("image", "inspect", "--format", "{{json .RepoDigests}}", target)
    cli.write_config({"registry": {"port": registry_server.port}})

    code, out, err = cli("registry", "ls", "--json")
    assert code == 0, err
    listed = {r["name"]: r["tags"] for r in json.loads(out)["data"]["repositories"]}
    assert listed["cli/base"] == ["pushed"]

    code, out, err = cli("registry", "tags", "cli/base", "--json")
    assert code == 0, err
    envelope = json.loads(out)
    assert envelope["version"] == 1 and envelope["command"] == "registry tags"
    [tag] = envelope["data"]["tags"]
    assert tag["tag"] == "pushed"
    assert tag["digest"] in pushed_digest  # the digest docker recorded for the push

    code, out, _ = cli("registry", "ls")
    assert "cli/base  pushed" in out.splitlines()
    docker("rmi", target)  # untag only: the base image stays for other tests


def test_up_is_idempotent_and_down_too(managed_registry) -> None:
    cli = managed_registry
    code, out, _ = cli("registry", "up")
    assert code == 0 and "already running" in out
    code, out, _ = cli("registry", "status", "--json")
    data = json.loads(out)["data"]
    assert code == 0 and data["mode"] == "binary" and data["reachable"] is True
    assert cli("registry", "down")[0] == 0
    code, out, _ = cli("registry", "down")
    assert code == 0 and "was not running" in out
    code, out, _ = cli("registry", "status")
    assert code == 1 and "reachable: no" in out


def test_rm_then_gc_frees_the_bytes(managed_registry) -> None:
    cli = managed_registry
    code, out, _ = cli("registry", "status", "--json")
    port = int(json.loads(out)["data"]["url"].rsplit(":", 1)[1])
    url = f"http://127.0.0.1:{port}"
    session = services.plain_session()
    big = services.tar_layer({"big.bin": os.urandom(4 * 1024 * 1024)})
    shared = services.tar_layer({"keep": b"kept"})
    services.push_image(session, url, "gc/victim", "1", [shared, big])
    services.push_image(session, url, "gc/victim", "alias", [shared, big])  # same digest
    services.push_image(session, url, "gc/keeper", "1", [shared])

    before = json.loads(cli("registry", "status", "--json")[1])["data"]
    assert before["repositories"] == 2 and before["tags"] == 3

    code, out, err = cli("registry", "rm", "gc/victim:1")  # alias would go too: refused
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "shares its manifest sha256:" in err and "with alias" in err and "--force" in err
    assert json.loads(cli("registry", "status", "--json")[1])["data"]["tags"] == 3

    code, out, err = cli("registry", "rm", "gc/victim:1", "--force")
    assert code == 0, err
    assert "also removed tags pointing to it: alias" in out

    code, out, err = cli("registry", "gc", "--json")
    assert code == 0, err
    freed = json.loads(out)["data"]["bytes_freed"]
    assert freed >= len(big)

    after = json.loads(cli("registry", "status", "--json")[1])["data"]
    assert after["reachable"] is True  # gc restarted it
    # status shows the freed bytes (rm itself removes a few link files too)
    assert before["storage_bytes"] - after["storage_bytes"] >= freed >= len(big)
    assert after["tags"] == 1
    # What was kept is intact.
    assert services.plain_session().get(f"{url}/v2/gc/keeper/manifests/1", timeout=10,
                                        headers={"Accept": "application/vnd.docker."
                                                 "distribution.manifest.v2+json"}).ok


def test_rm_of_a_missing_tag(managed_registry) -> None:
    code, _, err = managed_registry("registry", "rm", "nothing/here:1")
    assert code == 1
    assert err.startswith("error: ") and "not found" in err and "Traceback" not in err


def test_unreachable_registry(cli) -> None:
    port = services.free_port()
    cli.write_config({"registry": {"port": port}})
    code, out, err = cli("registry", "ls")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        f"error: cannot reach the registry at http://127.0.0.1:{port} (hint: start it with "
        "`imgpipe registry up`, or fix registry.host/port in imgpipe.yaml)"]


def test_port_already_taken(cli) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        cli.write_config({"registry": {"port": port}})
        code, out, err = cli("registry", "up")
    assert code == 1
    assert err.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use by a program that does not answer as a "
        "registry (hint: stop that program, or choose another registry.port in imgpipe.yaml)"]
    assert not (cli.folder / "build").exists()  # nothing half-done


def test_up_adopts_a_registry_someone_else_runs(cli, registry_server) -> None:
    """A head node where another registry already answers (DeepOps installs one): `up` says
    so and exits 0, status and ls use it, down and gc leave it alone."""
    cli.write_config({"registry": {"port": registry_server.port}})
    code, out, err = cli("registry", "up", "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["mode"] == "external"
    code, out, err = cli("registry", "status", "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["mode"] == "external" and data["reachable"] is True
    assert cli("registry", "ls")[0] == 0
    code, out, _ = cli("registry", "down")
    assert code == 0 and "left running" in out
    assert registry_server.proc.poll() is None  # still serving
    code, _, err = cli("registry", "gc")
    assert code == 1 and "was not started by imgpipe" in err


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A temporary folder other users can enter (pytest's own is private to root)."""
    with tempfile.TemporaryDirectory(prefix="imgpipe-test-") as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def test_up_without_permission_to_the_data_directory(public_tmp: Path) -> None:
    """As an unprivileged user (root would bypass the permission check)."""
    tmp_path = public_tmp
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o755)  # owned by root: others may not create anything inside
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)
    (work / "imgpipe.yaml").write_text(
        f"registry:\n  port: {services.free_port()}\n  server:\n"
        f"    mode: binary\n    data_dir: {locked}/data\n    state_dir: {work}/state\n")
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", "from imgpipe.cli.main import run; run()", "registry", "up"],
        cwd=work, capture_output=True, text=True, timeout=60,
        env={**os.environ, "HOME": str(work)},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot write the registry's directory {locked}/data: permission denied "
        "(hint: run as a user who may write there, or set registry.server.data_dir and "
        "state_dir in imgpipe.yaml)"]
    assert list(locked.iterdir()) == []
    assert not (work / "state" / "registry.pid").exists()


def test_help_teaches_with_examples(cli) -> None:
    for args in ([], ["registry"], ["registry", "rm"], ["registry", "tags"], ["doctor"]):
        code, out, _ = cli(*args, "--help")
        assert code == 0
        assert "Example" in out or "First steps" in out, args


def test_usage_errors_exit_2(cli) -> None:
    code, _, err = cli("registry", "rm")
    assert code == 2 and "Missing argument" in err
    code, _, err = cli("registry", "up", "--mode", "kubernetes")
    assert code == 2 and "Invalid value" in err
    code, _, err = cli("no-such-command")
    assert code == 2


def test_bad_reference_exits_2(cli) -> None:
    code, _, err = cli("registry", "rm", "Bad/Name:1")
    assert code == 2
    assert "invalid image reference 'Bad/Name:1'" in err


def test_container_mode_up_status_gc_down(cli, base_image) -> None:
    image = services.ensure_registry_image(base_image)
    port = services.free_port()
    name = f"imgpipe-registry-test-{port}"
    cli.write_config({"registry": {"port": port, "server": {
        "mode": "container", "image": image, "container_name": name}}})
    try:
        code, out, err = cli("registry", "up", "--json")
        assert code == 0, err
        data = json.loads(out)["data"]
        assert data["mode"] == "container" and data["started"] is True
        inspect = json.loads(docker("inspect", name))[0]
        assert inspect["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
        assert inspect["HostConfig"]["NetworkMode"] == "host"
        assert cli("registry", "up")[1].startswith("registry already running")
        # A second checkout with the same configuration (the container's name is
        # machine-wide): it uses that registry, and its down and gc leave it alone.
        second = CliRun(cli.folder / "second", cli.capsys)
        second.folder.mkdir()
        shutil.copy(cli.folder / "imgpipe.yaml", second.folder / "imgpipe.yaml")
        code, out, err = second("registry", "up", "--json")
        assert code == 0 and json.loads(out)["data"]["mode"] == "external", out + err
        code, out, err = second("registry", "down")
        assert code == 0 and "left running" in out, out + err
        assert second("registry", "gc")[0] != 0
        assert json.loads(docker("inspect", name))[0]["State"]["Running"] is True

        url = f"http://127.0.0.1:{port}"
        session = services.plain_session()
        big = services.tar_layer({"big": os.urandom(2 * 1024 * 1024)})
        services.push_image(session, url, "ctr/img", "1", [big])
        assert (cli.folder / "build/registry/data/docker/registry/v2/repositories/ctr/img").is_dir()
        assert cli("registry", "rm", "ctr/img:1")[0] == 0
        code, out, err = cli("registry", "gc", "--json")
        assert code == 0, err
        assert json.loads(out)["data"]["bytes_freed"] >= len(big)
        status = json.loads(cli("registry", "status", "--json")[1])["data"]
        assert status["mode"] == "container" and status["reachable"] is True
    finally:
        code, out, _ = cli("registry", "down")
    assert code == 0 and "stopped (container)" in out
    gone = subprocess.run([services.DOCKER, "inspect", name], capture_output=True)
    assert gone.returncode != 0


def test_doctor_reports_each_piece_with_a_fix(cli, docker_engine) -> None:
    cli.write_config({"registry": {"port": services.free_port()}})
    code, out, _ = cli("doctor", "--json")
    checks = {c["name"]: c for c in json.loads(out)["data"]["checks"]}
    assert checks["docker engine"]["verdict"] == "ok"
    assert checks["buildkit"]["verdict"] == "ok"
    assert checks["squashfs tools"]["verdict"] == "ok"
    assert checks["registry"]["verdict"] == "missing"
    assert checks["registry"]["fix"] == "imgpipe registry up"
    assert code == 1  # a required piece (the registry) is missing
    for check in checks.values():
        assert check["verdict"] == "ok" or check["fix"], check


def test_ls_lists_a_repository_that_holds_only_blobs(cli, registry_server) -> None:
    """An interrupted push leaves a repository in the catalog with no tags (its tag list
    answers NAME_UNKNOWN): `ls` shows it empty instead of failing on it."""
    services.push_blob(services.plain_session(), registry_server.url, "cli/blobs-only",
                       b"orphan layer")
    cli.write_config({"registry": {"port": registry_server.port}})
    code, out, err = cli("registry", "ls", "--json")
    assert code == 0, err
    listed = {r["name"]: r["tags"] for r in json.loads(out)["data"]["repositories"]}
    assert listed["cli/blobs-only"] == []
