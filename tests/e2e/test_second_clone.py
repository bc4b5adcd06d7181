"""A second checkout on the same head node: the registry is the truth for every command.

Clone A builds and pushes; a fresh clone B of the same repository (no imgpipe.lock, no
build record: both are ignored files) runs each command that takes an IMAGE on its own and
gets A's digest.  Before this, every one of them but `build` answered "has not been built
here" and pointed at `build`, which answered "up to date".
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import services
from tests.conftest import CliRun

REPO = Path(__file__).resolve().parents[2]
HELLO = {"name": "hello", "repository": "clones/hello", "version": "1.0.0",
         "flavors": {"cpu": {"base": services.BASE_IMAGE}}, "selftest": ["cat", "/hello.txt"]}


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci", *args],
                   cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory, registry_server, bert_cpu: dict) -> Path:
    """The repository: bert and a small image, and a config every clone shares (the
    registry; the cluster's squashfs cache, where bert_cpu converted bert)."""
    repo = tmp_path_factory.mktemp("origin")
    shutil.copytree(REPO / "images" / "bert", repo / "images" / "bert")
    (repo / "images" / "hello").mkdir()
    (repo / "images" / "hello" / "Dockerfile").write_text(
        "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nCOPY hello.txt /hello.txt\n")
    (repo / "images" / "hello" / "hello.txt").write_text("hello from clone A\n")
    (repo / "images" / "hello" / "image.yaml").write_text(json.dumps(HELLO))
    (repo / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": registry_server.port}, "default_flavor": "cpu",
        "outputs": {"squashfs_dir": str(bert_cpu["squashfs"].parent)}}))
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "images", cwd=repo)
    return repo


def _clone(origin: Path, where: Path, capsys: pytest.CaptureFixture[str]) -> CliRun:
    _git("clone", "-q", str(origin), str(where), cwd=origin.parent)
    return CliRun(where, capsys)


def _lock(clone: CliRun) -> dict:
    return json.loads((clone.folder / "imgpipe.lock").read_text())["images"]


@pytest.fixture(scope="module")
def first(origin: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Clone A: `imgpipe build --wheels W && imgpipe push`, as the README says; its lock."""
    folder = tmp_path_factory.mktemp("clones") / "a"
    _git("clone", "-q", str(origin), str(folder), cwd=origin.parent)
    imgpipe = str(Path(sys.executable).parent / "imgpipe")
    for argv in (["build", "--wheels", str(services.torch_wheels_dir())], ["push"]):
        done = subprocess.run([imgpipe, *argv], cwd=folder, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
    lock = json.loads((folder / "imgpipe.lock").read_text())["images"]
    assert set(lock) == {"bert", "hello"}
    return lock


def _drop_from_engine(reference: str) -> None:
    """The engine forgets every tag of the image ``reference`` names (a fresh runner)."""
    import docker

    client = docker.from_env()
    image = client.images.get(reference)
    client.images.remove(image.id, force=True)


@pytest.mark.parametrize("argv, image", [
    (("selftest", "hello"), "hello"),
    (("convert", "bert", "--json"), "bert"),
    (("recipes", "render", "--profile", "local", "--nodes", "2", "-o", "rendered"), "bert"),
    (("push", "bert"), "bert"),
    (("push",), "hello"),
], ids=["selftest", "convert", "recipes render", "push an image", "push all"])
def test_a_fresh_clone_finds_what_the_registry_holds(origin: Path, first: dict, tmp_path: Path,
                                                     capsys, argv: tuple[str, ...],
                                                     image: str) -> None:
    """Each command alone, in a clone that never built: exit 0, the digest clone A pushed,
    recorded in its own lock; no wheels folder offered (the wheels cannot be hashed here)."""
    pushed = first[image]["cpu"]
    second = _clone(origin, tmp_path / "b", capsys)
    assert not (second.folder / "imgpipe.lock").exists()
    if argv[0] == "selftest":  # not in the engine either: the self-test pulls it
        _drop_from_engine(f"{pushed['repository']}@{pushed['digest']}")
    code, out, err = second(*argv)
    assert code == 0, out + err
    if "--json" not in argv:  # progress says where the digest came from
        assert "recorded in imgpipe.lock" in out + err
    assert _lock(second)[image]["cpu"]["digest"] == pushed["digest"]
    if argv[0] == "selftest":
        assert "self-test passed: hello from clone A" in out
        assert f"pull {pushed['repository']}@{pushed['digest']}" in err
    if argv[0] == "convert":  # the cluster's shared cache had it: nothing converted again
        data = json.loads(out)["data"]
        assert data["digest"] == pushed["digest"] and data["converted"] is False
    if argv[0] == "recipes":
        assert pushed["digest"] in (second.folder / "rendered" / "run.sub").read_text()
    if argv[0] == "push":
        assert "in the registry already" in out and "nothing to push" not in out
        code, out, err = second(*argv)
        assert code == 0 and "nothing to push" in out, out + err


def test_changed_inputs_point_to_a_build_that_builds(origin: Path, first: dict,
                                                     tmp_path: Path, capsys) -> None:
    """What the registry does not hold from these inputs: the one-line error's hint is
    build-then-push, and that build really builds (never "up to date"), then all works."""
    second = _clone(origin, tmp_path / "b", capsys)
    (second.folder / "images" / "hello" / "hello.txt").write_text("changed in clone B\n")
    code, out, err = second("convert", "hello")
    assert code != 0 and len(err.strip().splitlines()) == 1, out + err
    assert "clones/hello:1.0.0 was built from other inputs (context changed)" in err
    assert "(hint: imgpipe build hello --flavor cpu && imgpipe push hello --flavor cpu)" in err
    code, out, err = second("build", "hello", "--json")
    assert code == 0, err
    assert [i["action"] for i in json.loads(out)["data"]["images"]] == ["built"]
    code, out, err = second("push", "hello", "--flavor", "cpu")
    assert code == 0, out + err
    assert _lock(second)["hello"]["cpu"]["digest"] != first["hello"]["cpu"]["digest"]
    code, out, err = second("selftest", "hello")
    assert code == 0 and "changed in clone B" in out, out + err
