"""Builds through the real engine's BuildKit, pushes to a real registry, imgpipe.lock.

The bert image (cpu flavor) is built once for the module from the debootstrap
base; later tests reuse it and BuildKit's cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from imgpipe.registry.client import RegistryClient
from tests import services
from tests.conftest import CliRun

REPO_IMAGES = Path(__file__).resolve().parents[2] / "images"
PIP_SECRET = "pip-token-7f3c9e1a-do-not-leak"
NGC_SECRET = "nvapi-4d2b8e6f0a-do-not-leak"

HELLO_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY hello.txt /hello.txt
"""

SECRETIVE_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN --mount=type=secret,id=ngc_api_key --mount=type=secret,id=pip_config \\
    test -s /run/secrets/pip_config && wc -c < /run/secrets/ngc_api_key > /secret-size
"""


def _image(folder: Path, name: str, dockerfile: str, files: dict[str, str],
           secrets: list[str], selftest: list[str]) -> None:
    target = folder / name
    target.mkdir(parents=True)
    (target / "Dockerfile").write_text(dockerfile)
    for rel, text in files.items():
        (target / rel).write_text(text)
    (target / "image.yaml").write_text(json.dumps({
        "name": name, "repository": f"test/{name}", "version": "1.0.0",
        "flavors": {"cpu": {"base": services.BASE_IMAGE}}, "secrets": secrets,
        "selftest": selftest}))


@pytest.fixture(scope="module")
def project_dir(tmp_path_factory, registry_server, base_image) -> Path:
    root = tmp_path_factory.mktemp("project")
    images = root / "images"
    shutil.copytree(REPO_IMAGES / "bert", images / "bert")
    _image(images, "hello", HELLO_DOCKERFILE, {"hello.txt": "hello\n"}, [], ["cat", "/hello.txt"])
    _image(images, "secretive", SECRETIVE_DOCKERFILE, {}, ["ngc_api_key", "pip_config"],
           ["cat", "/secret-size"])
    pip_conf = root / "pip.conf"
    pip_conf.write_text(f"# {PIP_SECRET}\n[global]\ndisable-pip-version-check = true\n")
    (root / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": registry_server.port},
        "build": {"wheels_dir": str(services.torch_wheels_dir()),
                  "secrets": {"pip_config": str(pip_conf)}},
        "default_flavor": "cpu"}))
    return root


@pytest.fixture
def project(project_dir: Path, capsys) -> CliRun:
    return CliRun(project_dir, capsys)


def lock_of(project: CliRun) -> dict:
    return json.loads((project.folder / "imgpipe.lock").read_text())


@pytest.mark.slow
def test_bert_cpu_builds_selftests_and_pushes_with_the_registry_digest(
    project: CliRun, registry_server
) -> None:
    code, out, err = project("build", "bert", "--json")
    assert code == 0, err[-3000:]
    [built] = json.loads(out)["data"]["images"]
    assert built["action"] == "built"
    # The version and latest tags, and the git revision's when the project is a checkout.
    from imgpipe.pipeline.gitinfo import revision

    checkout = revision(project.folder)
    expected = ["0.1.0-cpu", "latest-cpu"] + ([f"{checkout.tag}-cpu"] if checkout else [])
    assert sorted(built["tags"]) == sorted(expected)

    code, out, err = project("selftest", "bert", "--json")
    assert code == 0, err[-3000:]
    assert json.loads(json.loads(out)["data"]["result"])["selftest"] == "passed"

    code, out, err = project("push", "bert", "--json")
    assert code == 0, err[-3000:]
    [pushed] = json.loads(out)["data"]["images"]
    entry = lock_of(project)["images"]["bert"]["cpu"]
    registry = RegistryClient(registry_server.url)
    assert entry["digest"] == pushed["digest"]
    assert entry["digest"] == registry.manifest_digest("imgpipe/bert", "0.1.0-cpu")
    assert entry["digest"] == registry.manifest_digest("imgpipe/bert", "latest-cpu")
    assert entry["config_digest"] == registry.manifest("imgpipe/bert", "0.1.0-cpu").config_digest
    inspect = subprocess.run([services.DOCKER, "image", "inspect", entry["config_digest"]],
                             capture_output=True, text=True, check=True)
    config = json.loads(inspect.stdout)[0]["Config"]
    assert "PYTORCH_VERSION=2.13.0" in config["Env"]
    assert config["Labels"]["org.imgpipe.input-hash"] == entry["input_hash"]
    assert config["Labels"]["org.opencontainers.image.version"] == "0.1.0"
    # Bytecode for what every job imports ships in the image: a squashfs is read-only, so a
    # module without it is compiled again by every rank of every job (seconds per start).
    probe = ("import importlib.util, os, h5py, numpy, torch, bert_trainer.pretrain as t\n"
             "missing = [m.__name__ for m in (h5py, numpy, torch, t)\n"
             "           if not os.path.exists(importlib.util.cache_from_source(m.__file__))]\n"
             "print(missing)")
    ran = subprocess.run([services.DOCKER, "run", "--rm", "--network=none", "--read-only",
                          entry["config_digest"], "python3", "-c", probe],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "[]", ran.stdout


def test_second_build_with_nothing_changed_calls_no_build(project: CliRun) -> None:
    # Built and pushed here (a no-op when the test above ran first): any order works.
    assert project("build", "bert")[0] == 0 and project("push", "bert")[0] == 0
    before = lock_of(project)
    code, out, err = project("build", "bert", "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["engine_called"] is False
    assert [i["action"] for i in data["images"]] == ["up to date"]
    code, out, _ = project("push")
    assert code == 0 and "nothing to push" in out
    assert lock_of(project) == before


def test_a_manifest_deleted_from_the_registry_is_pushed_again(project: CliRun,
                                                              registry_server) -> None:
    """`registry rm` of a pushed tag: plan and push no longer say "up to date" on the lock's
    word; push sends it again (the build is still in the engine); --force pushes anyway."""
    assert project("build", "hello")[0] == 0 and project("push", "hello")[0] == 0
    tag = lock_of(project)["images"]["hello"]["cpu"]["tags"][0]
    code, _, err = project("registry", "rm", f"test/hello:{tag}", "--force")
    assert code == 0, err
    code, out, _ = project("plan", "hello", "--json")
    [item] = json.loads(out)["data"]["images"]
    assert item["action"] == "build" and "is gone from the registry" in item["reason"]
    code, out, err = project("push", "hello")
    assert code == 0 and "nothing to push" not in out, err
    entry = lock_of(project)["images"]["hello"]["cpu"]
    assert RegistryClient(registry_server.url).manifest_digest("test/hello", tag) == (
        entry["digest"])
    code, out, _ = project("plan", "hello", "--json")
    assert json.loads(out)["data"]["images"][0]["action"] == "up to date"
    code, out, err = project("push", "hello", "--force")
    assert code == 0 and "nothing to push" not in out, err


def test_a_fresh_checkout_pushes_nothing_the_registry_holds_and_records_it(
        project: CliRun, tmp_path: Path, capsys) -> None:
    """Another machine pushed these inputs: on a fresh checkout `build` says up to date
    (the registry's labels) and records the registry's digest in the lock, and
    `imgpipe push hello --convert` then makes the squashfs, pushing nothing."""
    assert project("build", "hello")[0] == 0 and project("push", "hello")[0] == 0
    pushed = lock_of(project)["images"]["hello"]["cpu"]
    fresh = CliRun(tmp_path / "checkout", capsys)
    shutil.copytree(project.folder / "images" / "hello", fresh.folder / "images" / "hello")
    config = json.loads((project.folder / "imgpipe.yaml").read_text())
    fresh.write_config({**config, "outputs": {"squashfs_dir": str(tmp_path / "sqsh")}})
    code, out, err = fresh("build", "hello", "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["engine_called"] is False
    # build found it up to date on the registry's word, and the lock learnt it there
    assert lock_of(fresh)["images"]["hello"]["cpu"]["digest"] == pushed["digest"]
    code, out, err = fresh("push", "hello", "--convert")
    assert code == 0, out + err
    assert "nothing to push" in out and "hello/cpu: " in out
    entry = lock_of(fresh)["images"]["hello"]["cpu"]
    assert entry["digest"] == pushed["digest"] and entry["input_hash"] == pushed["input_hash"]
    assert entry["squashfs"] and Path(entry["squashfs"]).read_bytes()[:4] == b"hsqs"
    code, out, _ = fresh("push", "hello", "--convert")
    assert code == 0 and "nothing to push" in out
    assert lock_of(fresh)["images"]["hello"]["cpu"] == entry
    # A name whose inputs nobody pushed is still "not built here".
    (fresh.folder / "images" / "hello" / "hello.txt").write_text("changed\n")
    code, _, err = fresh("push", "hello")
    assert code != 0 and "hello/cpu has not been built here, and " in err
    assert "was built from other inputs (context changed)" in err


def test_changing_one_payload_file_rebuilds_bert_only(project: CliRun) -> None:
    assert project("build", "hello")[0] == 0 and project("push", "hello")[0] == 0
    code, out, _ = project("plan", "bert", "hello", "--json")
    assert [i["action"] for i in json.loads(out)["data"]["images"]] == ["up to date"] * 2

    payload = project.folder / "images/bert/trainer/bert_trainer/__init__.py"
    original = payload.read_text()
    payload.write_text(original + "# a change\n")
    try:
        code, out, _ = project("plan", "bert", "hello", "--json")
        plan = {i["image"]: i for i in json.loads(out)["data"]["images"]}
        assert plan["bert"]["action"] == "build"
        assert plan["bert"]["reason"] == "changed: context"
        assert plan["hello"]["action"] == "up to date"
        code, out, err = project("build", "bert", "hello", "--json")
        assert code == 0, err[-2000:]
        actions = {i["image"]: i["action"] for i in json.loads(out)["data"]["images"]}
        assert actions["bert"] == "built" and actions["hello"] == "up to date"
    finally:
        payload.write_text(original)
    # Back to the pushed inputs: up to date again.
    code, out, _ = project("plan", "bert", "--json")
    assert json.loads(out)["data"]["images"][0]["action"] == "up to date"


def test_ignored_files_do_not_change_the_hash(project: CliRun) -> None:
    cache = project.folder / "images/bert/trainer/bert_trainer/__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "x.cpython-311.pyc").write_bytes(b"junk")
    code, out, _ = project("plan", "bert", "--json")
    assert json.loads(out)["data"]["images"][0]["action"] == "up to date"


def test_build_arg_or_base_change_the_hash(project: CliRun, base_image: str) -> None:
    code, out, _ = project("plan", "bert", "--build-arg", "TORCH_VERSION=2.14.1", "--json")
    item = json.loads(out)["data"]["images"][0]
    assert item["action"] == "build" and item["reason"] == "changed: build_args"

    other_base = "imgpipe-test/other-base:1"
    subprocess.run([services.DOCKER, "tag", _hello_tag(project), other_base], check=True)
    code, out, _ = project("plan", "bert", "--base", other_base, "--json")
    item = json.loads(out)["data"]["images"][0]
    assert item["action"] == "build"
    assert "base" in item["reason"].split(": ")[1].split(", ")


def _hello_tag(project: CliRun) -> str:
    entry = lock_of(project)["images"]["hello"]["cpu"]
    return f"{entry['repository']}:{entry['tags'][0]}"


@pytest.mark.slow
def test_build_secrets_reach_no_layer_history_or_log(project: CliRun) -> None:
    os.environ["NGC_API_KEY"] = NGC_SECRET
    try:
        code, out, err = project("build", "secretive", "--force")
    finally:
        del os.environ["NGC_API_KEY"]
    assert code == 0, err[-3000:]
    assert NGC_SECRET not in out + err and PIP_SECRET not in out + err
    code, out, err = project("selftest", "secretive", "--json")
    assert code == 0, err
    # The RUN step really read the secret (it recorded its length, nothing more).
    assert json.loads(out)["data"]["result"] == str(len(NGC_SECRET))

    records = json.loads((project.folder / "build/state/builds.json").read_text())
    for key in ("secretive/cpu", "bert/cpu"):
        image_id = records[key]["image_id"]
        history = subprocess.run([services.DOCKER, "history", "--no-trunc", image_id],
                                 capture_output=True, text=True, check=True).stdout
        assert NGC_SECRET not in history and PIP_SECRET not in history
        scanned = 0
        for path, data in services.image_layer_files(image_id):
            scanned += 1
            assert NGC_SECRET.encode() not in data, path
            assert PIP_SECRET.encode() not in data, path
        assert scanned > 1000  # every layer's files really were read
    assert PIP_SECRET not in (project.folder / "imgpipe.lock").read_text()


def test_unknown_image_name(project: CliRun) -> None:
    before = (project.folder / "imgpipe.lock").read_bytes()
    code, out, err = project("build", "bret")
    assert code == 2
    assert err.strip().splitlines() == [
        "error: unknown image 'bret' (the catalog has bert, hello, secretive) "
        "(hint: image names are the folders under images/)"]
    assert (project.folder / "imgpipe.lock").read_bytes() == before


def test_broken_dockerfile_is_one_line_and_keeps_the_lock(project: CliRun) -> None:
    before = (project.folder / "imgpipe.lock").read_bytes()
    dockerfile = project.folder / "images/hello/Dockerfile"
    original = dockerfile.read_text()
    dockerfile.write_text(original + "RUN echo about to fail && exit 3\n")
    try:
        code, out, err = project("build", "hello")
    finally:
        dockerfile.write_text(original)
    assert code == 1
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: build of 127.0.0.1:")
    assert "exit code: 3" in line or "exit 3" in line or "returned a non-zero code: 3" in line
    assert "Traceback" not in err
    assert (project.folder / "imgpipe.lock").read_bytes() == before


def test_missing_base_image(project: CliRun) -> None:
    before = (project.folder / "imgpipe.lock").read_bytes()
    code, _, err = project("build", "hello", "--base", "imgpipe-test/no-such-base:1")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: base image imgpipe-test/no-such-base:1 of hello/cpu is neither in the Docker "
        "engine nor reachable in its registry (hint: pull or mirror it (imgpipe mirror), make "
        "one (imgpipe base-image), or pass --base)")
    assert (project.folder / "imgpipe.lock").read_bytes() == before


def test_a_platform_without_its_base_is_one_line_before_any_build(project: CliRun) -> None:
    """An index build on a host that has the amd64 base and not the arm64 one: refused
    before the amd64 build starts, in one line naming the platform and `imgpipe base-image`
    (BuildKit would otherwise look for the base on Docker Hub, after building amd64)."""
    spec = project.folder / "images" / "hello" / "image.yaml"
    original = spec.read_text()
    nowhere = "imgpipe-test/no-such-base:arm64"
    changed = json.loads(original)
    changed["flavors"]["cpu"]["platform_bases"] = {"linux/arm64": nowhere}
    spec.write_text(json.dumps(changed))
    lock = project.folder / "imgpipe.lock"
    before = lock.read_bytes() if lock.exists() else None
    try:
        code, _, err = project("build", "hello", "--platform", "linux/amd64,linux/arm64")
    finally:
        spec.write_text(original)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: base image {nowhere} (linux/arm64) of hello/cpu is neither in the Docker "
        "engine nor reachable in its registry (hint: make it: imgpipe base-image --platform "
        f"linux/arm64 --tag {nowhere}; or pull or mirror it (imgpipe mirror), or build "
        "without linux/arm64 (--platform))"]
    assert (lock.read_bytes() if lock.exists() else None) == before


def test_unreachable_registry_on_push_keeps_the_lock(project: CliRun) -> None:
    assert project("build", "hello", "--force", "--build-arg", "UNUSED=1")[0] == 0
    before = (project.folder / "imgpipe.lock").read_bytes()
    config = project.folder / "imgpipe.yaml"
    original = config.read_text()
    settings = json.loads(original)
    settings["registry"]["port"] = services.free_port()
    config.write_text(json.dumps(settings))
    try:
        code, _, err = project("push", "hello")
    finally:
        config.write_text(original)
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("error: cannot reach the registry at ")
    assert (project.folder / "imgpipe.lock").read_bytes() == before


def test_ci_builds_selftests_pushes_then_does_nothing(tmp_path, registry_server, base_image,
                                                      capsys) -> None:
    _image(tmp_path / "images", "tiny", HELLO_DOCKERFILE, {"hello.txt": "hi\n"}, [],
           ["cat", "/hello.txt"])
    cli = CliRun(tmp_path, capsys)
    cli.write_config({"registry": {"port": registry_server.port}})
    code, out, err = cli("ci", "--json")
    assert code == 0, err[-2000:]
    data = json.loads(out)["data"]
    assert [b["action"] for b in data["built"]] == ["built"]
    [pushed] = data["pushed"]
    entry = lock_of(cli)["images"]["tiny"]["cpu"]
    assert entry["digest"] == pushed["digest"]
    code, out, _ = cli("ci", "--json")
    assert code == 0 and json.loads(out)["data"] == {"built": [], "pushed": []}


def test_ci_stops_on_a_failing_selftest_and_keeps_the_lock(tmp_path, registry_server,
                                                           base_image, capsys) -> None:
    _image(tmp_path / "images", "flaky", HELLO_DOCKERFILE, {"hello.txt": "hi\n"}, [],
           ["sh", "-c", "echo self-test says no >&2; exit 4"])
    cli = CliRun(tmp_path, capsys)
    cli.write_config({"registry": {"port": registry_server.port}})
    code, _, err = cli("ci")
    assert code == 1
    assert err.strip().splitlines()[-1].startswith(
        "error: self-test of flaky/cpu failed (exit 4): self-test says no")
    assert not (tmp_path / "imgpipe.lock").exists()
