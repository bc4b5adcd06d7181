"""Python packages installed by pip on the build host for each platform of an index build
(image.yaml's ``python:``), then copied into that platform's image: what bert's cpu flavor
does for torch.  The image here stands in for bert with one package whose wheel differs per
machine (each says which it is), on the busybox base of each platform (tests/platforms.py):
it needs no Python in the image, and no network (the wheels are the test's, offered with
--wheels, the pip configuration a build secret that names no index).

Checked through the CLI against the real engine and registry: each platform's image holds
its own platform's wheel (the self-test reads it, arm64 under emulation), the build names
the wheel each platform took, the lock and each platform's config label pin it by file and
sha256 (and `imgpipe lock pull` reads it back from the registry), and the pip configuration
reaches no layer, label or log.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from tests import platforms, services
from tests.wheels import make_wheel

SENTINEL = "pip-config-sentinel-5d1f"
IMAGE_YAML = {
    "name": "pyimg", "repository": "test/pyimg", "version": "1.0.0",
    "platforms": ["linux/amd64", "linux/arm64"],
    "flavors": {"cpu": {"base": platforms.base_tag("amd64"),
                        "platform_bases": {"linux/arm64": platforms.base_tag("arm64")},
                        "build_args": {"PAYLOAD_VERSION": "1.0"},
                        "python": {"version": "3.11", "glibc": "2.36",
                                   "requirements": ["payload==${PAYLOAD_VERSION}"]}}},
    "secrets": ["pip_config"],
    "selftest": ["cat", "/opt/venv/lib/python3.11/site-packages/payload/machine.txt"],
}
DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY .python/packages/ /opt/venv/
COPY .python/projects/ /opt/venv/
"""


def imgpipe(project: Path, *argv: str) -> str:
    done = subprocess.run([sys.executable, "-c", "import sys; from imgpipe.cli.main import "
                           "main; sys.exit(main(sys.argv[1:]))", *argv], cwd=project,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, registry_server: services.RegistryProcess,
          docker_engine: None) -> dict:
    for arch in platforms.ARCHES:
        platforms.busybox_base(arch)
    root = tmp_path_factory.mktemp("host-wheels")
    offered = root / "wheels"
    offered.mkdir()
    for machine in ("x86_64", "aarch64"):
        make_wheel(offered, "payload", "1.0", f"py3-none-manylinux_2_17_{machine}",
                   files={"payload/machine.txt": f"{machine}\n"})
    pip_conf = root / "pip.conf"
    pip_conf.write_text(f"# {SENTINEL}\n[global]\nno-index = true\n")
    project = root / "project"
    image = project / "images" / "pyimg"
    image.mkdir(parents=True)
    (image / "image.yaml").write_text(yaml.safe_dump(IMAGE_YAML))
    (image / "Dockerfile").write_text(DOCKERFILE)
    (project / "imgpipe.yaml").write_text(yaml.safe_dump({
        "registry": {"port": registry_server.port}, "default_flavor": "cpu"}))
    said = imgpipe(project, "build", "pyimg", "--wheels", str(offered), "--secret",
                   f"pip_config={pip_conf}")
    tested = imgpipe(project, "selftest", "pyimg")
    pushed = imgpipe(project, "push", "pyimg")
    lock = json.loads((project / "imgpipe.lock").read_text())["images"]["pyimg"]["cpu"]
    return {"project": project, "offered": offered, "said": said + tested + pushed,
            "selftest": tested, "lock": lock, "registry": registry_server}


def test_each_platform_image_holds_its_own_platform_wheel(built: dict) -> None:
    assert "linux/amd64: x86_64" in built["selftest"], built["selftest"]
    assert "linux/arm64: aarch64" in built["selftest"]
    said = built["said"]
    assert "pip for pyimg/cpu linux/arm64, on this host: payload==${PAYLOAD_VERSION}" in said
    assert "pip for pyimg/cpu linux/arm64: 1 wheels" in said
    # pip ran here: the arm64 build ran no step under emulation at all
    arm64 = said.split("build pyimg/cpu for linux/arm64", 1)[1]
    assert "RUN" not in arm64.split("built pyimg/cpu", 1)[0]


def test_the_lock_and_each_platform_label_pin_the_wheel_it_took(built: dict) -> None:
    lock, registry = built["lock"], built["registry"]
    for platform, machine in (("linux/amd64", "x86_64"), ("linux/arm64", "aarch64")):
        wheel = built["offered"] / f"payload-1.0-py3-none-manylinux_2_17_{machine}.whl"
        pin = lock["platforms"][platform]["python_wheels"]["payload"]
        assert pin == {"file": wheel.name,
                       "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
        config = lock["platforms"][platform]["config_digest"]
        blob = requests.get(f"{registry.url}/v2/test/pyimg/blobs/{config}", timeout=30).json()
        label = json.loads(blob["config"]["Labels"]["org.imgpipe.python-wheels"])
        assert label == {"payload": pin}
    assert lock["python_wheels"] == {}  # an index build keeps them per platform

    # a clone with no lock learns them from the registry
    clone = built["project"].parent / "clone"
    shutil.copytree(built["project"] / "images", clone / "images")
    shutil.copy(built["project"] / "imgpipe.yaml", clone / "imgpipe.yaml")
    imgpipe(clone, "lock", "pull", "pyimg", "--flavor", "cpu")
    pulled = json.loads((clone / "imgpipe.lock").read_text())["images"]["pyimg"]["cpu"]
    assert {p: pin["python_wheels"] for p, pin in pulled["platforms"].items()} == \
        {p: pin["python_wheels"] for p, pin in lock["platforms"].items()}


def test_the_pip_configuration_reaches_no_layer_label_or_log(built: dict) -> None:
    assert SENTINEL not in built["said"]
    assert SENTINEL not in (built["project"] / "imgpipe.lock").read_text()
    for pin in built["lock"]["platforms"].values():
        image = pin["config_digest"]
        scanned = 0
        for path, data in services.image_layer_files(image):
            scanned += 1
            assert SENTINEL.encode() not in data, path
        assert scanned > 5
        inspected = subprocess.run([services.DOCKER, "image", "inspect", image],
                                   capture_output=True, text=True, check=True).stdout
        assert SENTINEL not in inspected
