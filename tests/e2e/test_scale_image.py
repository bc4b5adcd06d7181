"""The scale bench's generated image (bench/ngc_image.py), small: what it promises is there.

The bench measures conversion on an NGC-shaped image made from a seed; this checks, at a few
MB, that the shape holds through a real registry and a real conversion: the same manifest
digest from an empty state, whiteouts and the opaque folder applied, links kept, the
replaced library's new bytes, and a killed push resumed without sending a finished layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CliRun

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ngc_image  # noqa: E402

SIZE, LAYERS, SEED = 48 << 20, 7, 7


@pytest.fixture(scope="module")
def generated(registry_server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    state = tmp_path_factory.mktemp("ngc") / "state.json"
    said: list[str] = []
    made = ngc_image.generate(registry_server.address, "scale/small", "a", SIZE, LAYERS, SEED,
                              state, say=said.append)
    return {**made, "state": state, "said": said}


def test_the_same_seed_gives_the_same_image(generated: dict, registry_server,
                                            tmp_path: Path) -> None:
    again = ngc_image.generate(registry_server.address, "scale/again", "b", SIZE, LAYERS, SEED,
                               tmp_path / "state.json", say=lambda _: None)
    assert again["digest"] == generated["digest"]
    assert generated["layers"] == LAYERS and generated["files"] > 200


def test_a_second_run_sends_no_finished_layer(generated: dict, registry_server) -> None:
    said: list[str] = []
    again = ngc_image.generate(registry_server.address, "scale/small", "a", SIZE, LAYERS, SEED,
                               generated["state"], say=said.append)
    assert again["digest"] == generated["digest"]
    assert len(said) == LAYERS and all("in the registry already" in line for line in said)


def test_the_converted_tree_has_the_shape_the_bench_promises(generated: dict, cli: CliRun,
                                                            registry_server,
                                                            tmp_path: Path) -> None:
    import json

    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(tmp_path / "sqsh")}})
    code, out, err = cli("convert", generated["reference"], "--json")
    assert code == 0, err
    squashfs = json.loads(out)["data"]["squashfs"]
    tree = tmp_path / "tree"
    subprocess.run(["unsquashfs", "-q", "-no-xattrs", "-d", str(tree), squashfs], check=True,
                   capture_output=True, timeout=300)
    plan = ngc_image.plan(SIZE, LAYERS, SEED)
    # whiteouts: the deleted sources are gone, no .wh. file is left
    removed = [e.path.replace(".wh.", "") for e in plan[-1].entries
               if e.kind == "whiteout" and not e.path.endswith(".wh..wh..opq")]
    assert removed and not any((tree / p).exists() for p in removed)
    assert not [p for p in tree.rglob(".wh.*")]
    # the opaque folder: the lower layer's files hidden, the new one there
    assert sorted(os.listdir(tree / "opt" / "legacy")) == ["NEW"]
    # links
    assert os.readlink(tree / "usr" / "bin" / "python3") == "python3.10"
    assert (tree / "usr/bin/python3.10").stat().st_ino == (
        tree / "usr/bin/python3.10-config").stat().st_ino
    # the replaced library holds the upper layer's bytes
    [replacement] = plan[-2].entries
    expected = hashlib.sha256(ngc_image.Content(replacement.seed, replacement.size).read())
    assert hashlib.sha256((tree / replacement.path).read_bytes()).digest() == expected.digest()
    big = int(SIZE * 0.15)
    assert (tree / "opt/weights/a.bin").stat().st_size == big
    # a task starts in it: the 8-node bench runs /usr/bin/true with ch-run, as a job's user
    import shutil

    from tests.cluster import USERS, ensure_users, prepare_node_devices, shared_folder

    ensure_users()
    prepare_node_devices()
    shared = shared_folder("imgpipe-scale-")
    try:
        image = shutil.copy(squashfs, shared / "image.sqsh")
        os.chmod(image, 0o644)
        started = subprocess.run(["runuser", "-u", USERS[0], "--", "ch-run", str(image), "--",
                                  "/usr/bin/true"], capture_output=True, text=True,
                                 timeout=120, cwd="/tmp")
        assert started.returncode == 0, started.stderr
    finally:
        shutil.rmtree(shared)


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A cgroup v1 memory group of this test's own (root only; no systemd here)."""
    group = Path("/sys/fs/cgroup/memory") / f"imgpipe-test-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        group.rmdir()


def test_a_login_node_with_little_memory_and_small_tmp_converts_it(
        registry_server, tmp_path: Path, memory_cgroup: Path) -> None:
    """A login node limits memory and /tmp, and /dev/shm is small: conversion streams, so
    a 300 MB image converts under a 160 MiB memory limit (page cache included) with 16 MiB
    tmpfs as /tmp and /dev/shm, into the same bytes as without any limit."""
    import json

    limit = 160 << 20
    made = ngc_image.generate(registry_server.address, "scale/login", "a", 300 << 20, 8, SEED,
                              tmp_path / "state.json", say=lambda _: None)
    folders = {}
    for name in ("free", "limited"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "imgpipe.yaml").write_text(json.dumps({
            "registry": {"port": registry_server.port},
            "outputs": {"squashfs_dir": str(folder / "sqsh")}}))
        folders[name] = folder
    imgpipe = str(Path(sys.executable).parent / "imgpipe")
    convert = [imgpipe, "convert", str(made["reference"]), "--json"]
    free = subprocess.run(convert, cwd=folders["free"], capture_output=True, text=True,
                          timeout=600)
    assert free.returncode == 0, free.stderr
    (memory_cgroup / "memory.limit_in_bytes").write_text(str(limit))
    small_tmp = tmp_path / "small-tmp"
    small_tmp.mkdir()
    script = ("set -e; mount -t tmpfs -o size=16m tmpfs /dev/shm; "
              f"mount -t tmpfs -o size=16m tmpfs {small_tmp}; "
              f"echo $$ > {memory_cgroup}/cgroup.procs; exec \"$@\"")
    limited = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                              "sh", *convert], cwd=folders["limited"], capture_output=True,
                             text=True, timeout=600, env={**os.environ, "TMPDIR": str(small_tmp)})
    assert limited.returncode == 0, limited.stderr[-2000:]
    peak = int((memory_cgroup / "memory.max_usage_in_bytes").read_text())
    assert peak <= limit
    paths = [json.loads(done.stdout)["data"]["squashfs"] for done in (free, limited)]
    digests = {hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}
    assert len(digests) == 1, paths
