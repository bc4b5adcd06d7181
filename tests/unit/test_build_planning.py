"""The build subsystem's decisions without an engine: which files make the context
(.dockerignore), what the input hash covers, when a build is skipped and why, what the
catalog accepts, and the lock file's reading and serialized updates."""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from imgpipe.base.errors import ConfigError
from imgpipe.pipeline.catalog import load_image, select
from imgpipe.pipeline.context import context_files, is_excluded, parse_dockerignore
from imgpipe.pipeline.lock import LockEntry, LockFile, read_lock, updating_lock
from imgpipe.pipeline.plan import INPUT_NAMES, plan_image


def make_image(root: Path, name: str = "bert", **extra: object) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    spec = {"name": name, "repository": f"imgpipe/{name}", "version": "0.1.0",
            "flavors": {"cpu": {"base": "debian:12", "tag_suffix": "-cpu"}}}
    spec.update(extra)
    (folder / "image.yaml").write_text(yaml.safe_dump(spec))
    (folder / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM $BASE_IMAGE\nCOPY app /app\n")
    (folder / "app").mkdir()
    (folder / "app" / "main.py").write_text("print('hi')\n")
    return folder


def plan(folder: Path, lock: LockFile, **kwargs: object):
    defaults: dict = {"overrides": {}, "base_override": None, "wheels_dir": None,
                      "resolve_base": lambda ref: "sha256:" + "b" * 64}
    return plan_image(load_image(folder), "cpu", lock, **{**defaults, **kwargs})


def pushed(item) -> LockFile:
    entry = LockEntry(repository="head:5000/imgpipe/bert", tags=["0.1.0-cpu"],
                      digest="sha256:" + "d" * 64, config_digest="sha256:" + "c" * 64,
                      input_hash=item.input_hash, inputs=item.inputs, flavor="cpu",
                      base="debian:12", pushed_at="2026-11-24T00:00:00Z")
    return LockFile(images={"bert": {"cpu": entry}})


def test_dockerignore_excludes_and_exceptions() -> None:
    rules = parse_dockerignore("# comment\n*.pyc\nbuild/\n!build/keep.txt\n**/secret*\n")
    assert is_excluded("a.pyc", rules)
    assert is_excluded("build/out.o", rules)
    assert not is_excluded("build/keep.txt", rules)
    assert is_excluded("deep/down/secret.key", rules)
    assert not is_excluded("src/main.py", rules)


def test_context_files_follow_dockerignore_and_record_links(tmp_path: Path) -> None:
    folder = make_image(tmp_path)
    (folder / ".dockerignore").write_text("*.log\n")
    (folder / "debug.log").write_text("noise")
    (folder / "app" / "link").symlink_to("main.py")
    listed = {f.path: f for f in context_files(folder)}
    assert "debug.log" not in listed
    assert {"Dockerfile", "image.yaml", "app/main.py", "app/link"} <= set(listed)
    assert listed["app/link"].link == "main.py"


def test_an_unchanged_image_is_up_to_date_and_each_change_is_named(tmp_path: Path) -> None:
    folder = make_image(tmp_path)
    first = plan(folder, LockFile())
    assert (first.action, first.reason) == ("build", "never pushed")
    lock = pushed(first)
    again = plan(folder, lock)
    assert again.action == "up to date" and again.input_hash == first.input_hash
    (folder / "app" / "main.py").write_text("print('changed')\n")
    assert plan(folder, lock).reason == "changed: context"
    assert plan(folder, lock, resolve_base=lambda ref: "sha256:" + "e" * 64
                ).reason == "changed: context, base"
    assert plan(folder, lock, force=True).reason == "--force"


def test_build_args_and_wheels_are_inputs(tmp_path: Path) -> None:
    folder = make_image(tmp_path)
    lock = pushed(plan(folder, LockFile()))
    assert plan(folder, lock, overrides={"X": "1"}).reason == "changed: build_args"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0-cp311-none-linux_x86_64.whl").write_bytes(b"w" * 10)
    assert plan(folder, lock, wheels_dir=wheels).reason == "changed: wheels"
    assert set(plan(folder, lock).inputs) == set(INPUT_NAMES)


def test_catalog_refuses_mismatched_names_and_unknown_images(tmp_path: Path) -> None:
    folder = make_image(tmp_path, "bert")
    (folder / "image.yaml").write_text(yaml.safe_dump({
        "name": "other", "repository": "imgpipe/other", "version": "1",
        "flavors": {"cpu": {"base": "debian:12"}}}))
    with pytest.raises(ConfigError, match="but the folder is 'bert'"):
        load_image(folder)
    good = load_image(make_image(tmp_path / "b", "nccl"))
    with pytest.raises(ConfigError, match="unknown image 'bart'"):
        select({"nccl": good}, ["bart"])
    assert select({"nccl": good}, ["nccl", "nccl"]) == [good]
    with pytest.raises(ConfigError, match="has no flavor 'gpu'"):
        good.flavor("gpu")


def test_a_broken_lock_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "imgpipe.lock"
    assert read_lock(path) == LockFile()
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable lock file"):
        read_lock(path)
    path.write_text(json.dumps({"images": {"bert": {"cpu": {"digest": 1}}}}))
    with pytest.raises(ConfigError, match="not a valid imgpipe lock file"):
        read_lock(path)


def _add_entry(path: str, number: int) -> None:
    with updating_lock(Path(path)) as lock:
        entry = LockEntry(repository="h:1/r", tags=[], digest=f"sha256:{number:064d}",
                          config_digest="x", input_hash="x", inputs={}, flavor="cpu",
                          base="b", pushed_at="now")
        lock.images[f"image{number}"] = {"cpu": entry}


def test_concurrent_lock_updates_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "imgpipe.lock"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.starmap(_add_entry, [(str(path), n) for n in range(16)])
    assert sorted(read_lock(path).images) == sorted(f"image{n}" for n in range(16))


def test_the_lock_pins_its_squashfs_file_only_while_it_is_one(tmp_path: Path) -> None:
    from imgpipe.base.files import SquashfsPath
    from imgpipe.registry.reference import Reference

    made = tmp_path / "bert.sqsh"
    entry = LockEntry(repository="head:5000/imgpipe/bert", tags=["0.1.0"],
                      digest="sha256:" + "d" * 64, config_digest="c", input_hash="h",
                      inputs={}, flavor="cpu", base="b", pushed_at="now", squashfs=str(made))
    assert entry.squashfs_file() is None  # not there
    made.write_bytes(b"not a squashfs")
    assert entry.squashfs_file() is None
    made.write_bytes(b"hsqs" + bytes(92))
    assert entry.squashfs_file() == SquashfsPath(made)
    made.rename(tmp_path / "real.sqsh")
    made.symlink_to(tmp_path / "real.sqsh")
    assert entry.squashfs_file() is None  # a link planted where the file was
    assert entry.reference == Reference.parse(f"head:5000/imgpipe/bert@sha256:{'d' * 64}")
    with pytest.raises(ConfigError, match="no pushed nccl/cpu to convert"):
        LockFile(images={"bert": {"cpu": entry}}).require("nccl", "cpu", "to convert")


def test_a_flavor_that_needs_a_cpu_torch_wheel_is_never_built_without_one(tmp_path: Path
                                                                          ) -> None:
    """bert's cpu flavor pins torch==VERSION+cpu: without the wheel offered (or a pip config
    naming an index), the build is refused in one line before the engine is called, rather
    than pulling PyPI's 5 GB CUDA torch under the cpu tags."""
    from imgpipe.base.config import Settings
    from imgpipe.base.platforms import parse_platforms
    from imgpipe.pipeline.builds import require_wheels

    folder = make_image(tmp_path / "images", flavors={"cpu": {
        "base": "debian:12", "required_wheels": ["torch-*+cpu-*.whl"]}})
    item = plan(folder, LockFile())
    settings = Settings(root=tmp_path)
    with pytest.raises(ConfigError, match=r"bert/cpu needs a wheel matching torch-\*\+cpu-\*"
                       r"\.whl \(x86_64\) and none is offered \(no --wheels folder\)"):
        require_wheels(settings, item, None, {})
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"cuda")
    with pytest.raises(ConfigError, match="none is offered in"):
        require_wheels(settings, item, wheels, {})
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"cpu")
    require_wheels(settings, item, wheels, {})
    require_wheels(settings, item, None, {"pip_config": tmp_path / "pip.conf"})
    # Built for Grace too: the x86 wheel does not serve aarch64 (PyPI's aarch64 torch is
    # the CUDA build as well)
    both = replace(item, platforms=parse_platforms("linux/amd64,linux/arm64"))
    with pytest.raises(ConfigError, match=r"bert/cpu for linux/arm64 needs a wheel matching "
                       r"torch-\*\+cpu-\*\.whl \(aarch64\)"):
        require_wheels(settings, both, wheels, {})
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_aarch64.whl").write_bytes(b"arm")
    require_wheels(settings, both, wheels, {})


def test_a_platform_whose_base_is_nowhere_is_refused_before_the_build(tmp_path: Path
                                                                      ) -> None:
    """An index build for a platform whose base the engine and the registry lack (an amd64
    host never made the arm64 one) stops before anything is built, in one line naming the
    platform and the command that makes its base, rather than in BuildKit's page about
    Docker Hub after the amd64 build.  The missing base is looked up for real: the engine's
    answer for a name it cannot have (or no engine at all), as the build would see it."""
    import os

    from imgpipe.base.config import Settings
    from imgpipe.base.platforms import parse_platforms
    from imgpipe.commands.shared.wiring import registry_for
    from imgpipe.pipeline.builds import BaseResolver, require_bases

    nowhere = f"imgpipe-test/no-such-base-{os.getpid()}:arm64"
    folder = make_image(tmp_path / "images", flavors={"cpu": {
        "base": "imgpipe/debian-python:bookworm", "platform_bases": {"linux/arm64": nowhere}}})
    settings = Settings(root=tmp_path)
    looked_up = BaseResolver(settings, registry_for(settings))
    made = {"imgpipe/debian-python:bookworm": "image-id:sha256:" + "a" * 64}  # amd64's

    def engine(ref: str) -> str | None:
        return made.get(ref) or looked_up(ref)

    amd64 = plan(folder, LockFile(), resolve_base=engine,
                 platforms=parse_platforms("linux/amd64"))
    require_bases(amd64)  # its base is there: nothing to say
    both = plan(folder, LockFile(), resolve_base=engine,
                platforms=parse_platforms("linux/amd64,linux/arm64"))
    assert both.platform_base_digests == {"linux/amd64": made["imgpipe/debian-python:bookworm"],
                                          "linux/arm64": None}
    with pytest.raises(ConfigError) as refused:
        require_bases(both)
    assert refused.value.message == (
        f"base image {nowhere} (linux/arm64) of bert/cpu is neither in the Docker engine nor "
        "reachable in its registry")
    assert refused.value.hint == (
        f"make it: imgpipe base-image --platform linux/arm64 --tag {nowhere}; or pull or "
        "mirror it (imgpipe mirror), or build without linux/arm64 (--platform)")
    # The repository's bert: its arm64 base is the one `imgpipe base-image --platform
    # linux/arm64` makes under its default tag, so the command needs no --tag
    bert = load_image(Path(__file__).resolve().parents[2] / "images" / "bert")
    item = plan_image(bert, "cpu", LockFile(), overrides={}, base_override=None,
                      wheels_dir=None, resolve_base=made.get,
                      platforms=parse_platforms("linux/amd64,linux/arm64"))
    with pytest.raises(ConfigError) as refused:
        require_bases(item)
    line = str(refused.value)  # as the CLI prints it after "error: "
    assert "\n" not in line and "imgpipe/debian-python:bookworm-arm64 (linux/arm64)" in line
    assert "make it: imgpipe base-image --platform linux/arm64; or pull" in line


def test_the_wheels_are_an_input_by_content(tmp_path: Path) -> None:
    folder = make_image(tmp_path / "images")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"a" * 100)
    lock = pushed(plan(folder, LockFile(), wheels_dir=wheels))
    wheel.write_bytes(b"b" * 100)  # same name, same size: rebuilt
    assert plan(folder, lock, wheels_dir=wheels).reason == "changed: wheels"


def test_a_base_the_site_mirrors_is_built_from_the_mirror_where_its_registry_is_unreachable(
        tmp_path: Path) -> None:
    """registry.mirrors maps nvcr.io onto the site registry: an NGC flavor's base that the
    engine lacks and nvcr.io does not answer for is built from the site registry's copy (an
    air-gapped build host, CI included); a base the engine holds is built from as it is."""
    from imgpipe.base.config import Settings
    from imgpipe.pipeline.builds import make_plan

    make_image(tmp_path / "images", flavors={"ngc": {"base": "nvcr.io/nvidia/pytorch:24.05-py3"}})
    settings = Settings(root=tmp_path, registry={"host": "head", "port": 5000,
                                                 "mirrors": {"nvcr.io": ""}})
    image = load_image(tmp_path / "images" / "bert")
    mirror = "head:5000/nvidia/pytorch:24.05-py3"
    found = {mirror: "sha256:" + "b" * 64}
    [item] = make_plan(settings, [image], "ngc", LockFile(), overrides={}, base_override=None,
                       wheels_dir=None, resolver=found.get, force=False)  # type: ignore[arg-type]
    assert item.build_args["BASE_IMAGE"] == mirror and item.base_digest == found[mirror]
    found["nvcr.io/nvidia/pytorch:24.05-py3"] = "image-id:sha256:" + "c" * 64  # the engine's
    [item] = make_plan(settings, [image], "ngc", LockFile(), overrides={}, base_override=None,
                       wheels_dir=None, resolver=found.get, force=False)  # type: ignore[arg-type]
    assert item.build_args["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch:24.05-py3"
    plain = Settings(root=tmp_path, registry={"host": "head", "port": 5000})
    del found["nvcr.io/nvidia/pytorch:24.05-py3"]
    [item] = make_plan(plain, [image], "ngc", LockFile(), overrides={}, base_override=None,
                       wheels_dir=None, resolver=found.get, force=False)  # type: ignore[arg-type]
    assert item.build_args["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch:24.05-py3"
