"""What the build host's pip is told and what it leaves behind, with no pip run
(imgpipe.pipeline.hostpip, hostresolve, context): the manylinux tags each platform's base
runs, the requirements with the flavor's build args, each wheel pinned by file and sha256 in
the lock and the image label, a kept context changed only where it differs.  pip's own
choices (the +cpu wheel where one is offered, else the index's CUDA build; an index fetched
once into the cache; the image's projects as wheels) run pip for real:
tests/e2e/test_host_pip.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from imgpipe.base.errors import ConfigError
from imgpipe.base.platforms import Platform
from imgpipe.pipeline.catalog import PythonPackages, load_image
from imgpipe.pipeline.context import context_files, sync_context
from imgpipe.pipeline.hostpip import platform_tags
from imgpipe.pipeline.hostresolve import requirements
from imgpipe.pipeline.lock import LockEntry, WheelPin
from imgpipe.pipeline.remote import _wheels

AMD64, ARM64 = Platform.parse("linux/amd64"), Platform.parse("linux/arm64")


def test_pip_is_given_every_manylinux_tag_the_base_runs() -> None:
    arm = platform_tags(ARM64, "2.36")
    assert arm[0] == "manylinux_2_36_aarch64" and arm[-1] == "manylinux2014_aarch64"
    assert {"manylinux_2_28_aarch64", "manylinux_2_18_aarch64", "manylinux_2_17_aarch64"
            } <= set(arm)
    assert not any("x86_64" in tag or "manylinux1" in tag for tag in arm)
    amd = platform_tags(AMD64, "2.28")
    assert amd[0] == "manylinux_2_28_x86_64" and amd[-1] == "manylinux1_x86_64"
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64"} <= set(amd)


def test_requirements_take_the_flavor_build_args(tmp_path: Path) -> None:
    spec = PythonPackages(version="3.11", glibc="2.36",
                          requirements=["torch==${TORCH_VERSION}", "./trainer"])
    assert requirements(spec, {"TORCH_VERSION": "2.14.1"}) == ["torch==2.14.1", "./trainer"]
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM scratch\n")
    (folder / "image.yaml").write_text(yaml.safe_dump({
        "name": "bert", "repository": "imgpipe/bert", "version": "1",
        "flavors": {"cpu": {"base": "debian:12", "python": {
            "version": "3.11", "glibc": "2.36", "requirements": ["torch==${TORCH}"]}}}}))
    with pytest.raises(ConfigError, match=r"image.yaml: flavors.cpu: .*\$\{TORCH\} is not a "
                       "build arg of the flavor"):
        load_image(folder)


def test_the_lock_and_the_image_label_pin_each_wheel() -> None:
    pin = WheelPin(file="torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl",
                   sha256="a" * 64)
    entry = LockEntry(repository="h:5000/imgpipe/bert", tags=[], digest="sha256:" + "d" * 64,
                      config_digest="c", input_hash="h", inputs={}, flavor="cpu", base="b",
                      pushed_at="now", python_wheels={"torch": pin})
    again = LockEntry.model_validate(json.loads(json.dumps(entry.model_dump(mode="json"))))
    assert again.python_wheels["torch"] == pin
    label = json.dumps({"torch": pin.model_dump()})
    assert _wheels({"org.imgpipe.python-wheels": label}) == {"torch": pin}
    assert _wheels({"org.imgpipe.python-wheels": "[1, 2]"}) == {}
    assert _wheels({}) == {}


def test_a_kept_context_changes_only_what_differs(tmp_path: Path) -> None:
    folder = tmp_path / "image"
    (folder / "pkg").mkdir(parents=True)
    (folder / "pkg" / "a.py").write_text("a\n")
    (folder / "pkg" / "b.py").write_text("b\n")
    (folder / "Dockerfile").write_text("FROM scratch\n")
    dest = tmp_path / "kept"
    sync_context(folder, context_files(folder), None, dest)
    (dest / ".python" / "packages").mkdir()
    kept = (dest / "pkg" / "a.py").stat().st_mtime_ns
    (folder / "pkg" / "b.py").write_text("changed\n")
    (folder / "pkg" / "a.py").touch()  # a new time, the same bytes
    (folder / "gone.txt").write_text("x")
    sync_context(folder, context_files(folder), None, dest)
    (folder / "gone.txt").unlink()
    sync_context(folder, context_files(folder), None, dest)
    assert (dest / "pkg" / "a.py").stat().st_mtime_ns == kept
    assert (dest / "pkg" / "b.py").read_text() == "changed\n"
    assert not (dest / "gone.txt").exists()
    assert (dest / ".python" / "packages").is_dir()  # hostpip's, left alone
