"""Grace beside x86: one image built for linux/amd64 and linux/arm64 on this x86 machine
(arm64 under emulation), pushed as one OCI index, self-tested on both platforms, converted
here for both (nothing of arm64 runs), published beside each platform's manifest, and run
from one run.sub on a mixed sandbox: an x86 host and an arm64 one (its Slurm node has the
arm64 feature, its jobs run arm64 bytes under qemu-user-static), each its own platform.

The image stands in for bert (the recipes are bert's) with what a platform check needs:
Debian's static busybox on a base of each platform, a RUN step that records the machine it
ran on, and ``uname -m`` as its self-test.  Building bert itself for arm64 under emulation
takes far longer than this suite may (bench/bench_platforms.py measures it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from tests import platforms, services
from tests.cluster import (
    ensure_users,
    node_cache,
    prepare_node_devices,
    shared_folder,
    system_imgpipe,
)

pytestmark = pytest.mark.e2e

ALICE = "imgpipe-alice"
IMAGE_YAML = {
    "name": "bert", "repository": "test/uname", "version": "1.0.0",
    "description": "stands in for bert where a platform check needs only uname -m",
    "platforms": ["linux/amd64", "linux/arm64"],
    "flavors": {"cpu": {"base": platforms.base_tag("amd64"),
                        "platform_bases": {"linux/arm64": platforms.base_tag("arm64")}}},
    "selftest": ["uname", "-m"],
}
DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN uname -m > /etc/built-on
COPY hello.txt /hello.txt
"""
MACHINE = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}


def imgpipe(project: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, in the project folder."""
    return subprocess.run([sys.executable, "-c", "import sys; from imgpipe.cli.main import "
                           "main; sys.exit(main(sys.argv[1:]))", *argv], cwd=project,
                          capture_output=True, text=True, timeout=900)


def ok(project: Path, *argv: str) -> str:
    done = imgpipe(project, *argv)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def pushed(registry_server: services.RegistryProcess, docker_engine: None) -> dict:
    """The two-platform image built, self-tested and pushed: the project and its lock entry."""
    for arch in platforms.ARCHES:
        platforms.busybox_base(arch)
    project = shared_folder("imgpipe-platforms-")
    image = project / "images" / "bert"
    image.mkdir(parents=True)
    (image / "image.yaml").write_text(yaml.safe_dump(IMAGE_YAML))
    (image / "Dockerfile").write_text(DOCKERFILE)
    (image / "hello.txt").write_text("hello from every platform\n")
    squashfs = shared_folder("imgpipe-platforms-squashfs-")
    (project / "imgpipe.yaml").write_text(yaml.safe_dump({
        "registry": {"port": registry_server.port}, "default_flavor": "cpu",
        "outputs": {"squashfs_dir": str(squashfs)}}))
    built = ok(project, "build", "bert")
    tested = ok(project, "selftest", "bert")
    ok(project, "push", "bert")
    entry = json.loads((project / "imgpipe.lock").read_text())["images"]["bert"]["cpu"]
    return {"project": project, "entry": entry, "built": built, "selftest": tested,
            "registry": registry_server}


def _manifest(registry: services.RegistryProcess, reference: str) -> requests.Response:
    return requests.get(f"{registry.url}/v2/test/uname/manifests/{reference}", timeout=30,
                        headers={"Accept": "application/vnd.oci.image.index.v1+json, "
                                 "application/vnd.docker.distribution.manifest.v2+json"})


def test_one_tag_one_index_one_selftested_manifest_per_platform(pushed) -> None:
    entry, registry = pushed["entry"], pushed["registry"]
    assert "linux/arm64 (emulated: binfmt qemu-aarch64)" in pushed["built"], pushed["built"]
    assert "linux/amd64 (native)" in pushed["built"]
    assert "linux/amd64: x86_64" in pushed["selftest"], pushed["selftest"]
    assert "linux/arm64: aarch64" in pushed["selftest"]
    index = _manifest(registry, "1.0.0")
    assert index.headers["Docker-Content-Digest"] == entry["digest"]
    body = index.json()
    assert body["mediaType"] == "application/vnd.oci.image.index.v1+json"
    listed = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"]
              for m in body["manifests"]}
    assert listed == {p: pin["digest"] for p, pin in entry["platforms"].items()}
    assert set(listed) == {"linux/amd64", "linux/arm64"}
    for tag in entry["tags"]:  # every tag names the index
        assert _manifest(registry, tag).headers["Docker-Content-Digest"] == entry["digest"]
    for platform, digest in listed.items():
        config = _manifest(registry, digest).json()["config"]["digest"]
        blob = requests.get(f"{registry.url}/v2/test/uname/blobs/{config}", timeout=30).json()
        assert f"{blob['os']}/{blob['architecture']}" == platform
        assert entry["platforms"][platform]["config_digest"] == config
    # change detection per platform: nothing changed, nothing to build; a platform less is a
    # change
    assert "up to date" in ok(pushed["project"], "plan", "bert")
    fewer = ok(pushed["project"], "plan", "bert", "--platform", "linux/amd64")
    assert "changed: platforms" in fewer, fewer


def test_converted_here_for_each_platform_each_tree_as_docker_export_gives_it(pushed) -> None:
    project, entry = pushed["project"], pushed["entry"]
    for platform, machine in MACHINE.items():
        done = imgpipe(project, "convert", "bert", "--platform", platform, "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        data = json.loads(done.stdout)["data"]
        digest = entry["platforms"][platform]["digest"]
        assert data["digest"] == digest
        path = Path(data["squashfs"])
        assert digest.split(":")[1] in path.name  # keyed by the platform's manifest
        squashed = platforms.squashfs_listing(path)
        # the engine holds each platform's image by its ID (its config digest)
        exported = platforms.export_listing(entry["platforms"][platform]["config_digest"],
                                            platform)
        for name in ENGINE_ONLY | ENROOT_ONLY:
            squashed.pop(name, None)
            exported.pop(name, None)
        exported = {k: v for k, v in exported.items() if not k.startswith("dev/")}
        assert squashed == exported, platform
        built_on = squashed["etc/built-on"]
        assert built_on[1] == len(machine) + 1  # the RUN step ran on that platform's CPU
    lock = json.loads((project / "imgpipe.lock").read_text())["images"]["bert"]["cpu"]
    assert all(pin["squashfs"] for pin in lock["platforms"].values())


ENGINE_ONLY = {".dockerenv", "etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/mtab",
               "dev", "proc", "sys"}
ENROOT_ONLY = {"etc/environment", "etc/rc", "etc/rc.local", "etc/fstab"}


@pytest.fixture(scope="module")
def mixed_cluster(registry_server: services.RegistryProcess):
    """node1 x86, node2 arm64 (emulated), the head serving the test registry."""
    from imgpipe.recipes.sandbox import SandboxSpec, running

    ensure_users()
    prepare_node_devices()
    spec = SandboxSpec(shared_folder("imgpipe-mixed-"), name="imgpm", subnet="10.213.15",
                       cpus=4, gpus=0, platforms="node2=linux/arm64")
    with running(spec, registry_storage=registry_server.root / "data") as sandbox:
        yield sandbox


def test_one_run_sub_runs_each_node_its_own_platform(pushed, mixed_cluster) -> None:
    project, entry = pushed["project"], pushed["entry"]
    ok(project, "push", "bert", "--squashfs")  # each platform's beside its own manifest
    lock = json.loads((project / "imgpipe.lock").read_text())["images"]["bert"]["cpu"]
    published = {p: pin["squashfs_digests"]["zstd"] for p, pin in lock["platforms"].items()}
    assert len(set(published.values())) == 2, published
    for platform in MACHINE:
        ok(project, "convert", "bert", "--platform", platform)
    recipes = shared_folder("imgpipe-mixed-recipes-")
    ok(project, "recipes", "render", "--profile", "local", "--nodes", "1", "--runtime",
       "charliecloud", "-o", str(recipes / "bundle"))
    run_sub = (recipes / "bundle" / "run.sub").read_text()
    assert 'case "$node_platform" in' in run_sub
    jobs = recipes / "jobs"
    jobs.mkdir()
    os.chown(jobs, *_ids(ALICE))
    lock = json.loads((project / "imgpipe.lock").read_text())["images"]["bert"]["cpu"]
    for feature, platform in (("arm64", "linux/arm64"), ("amd64", "linux/amd64")):
        done = mixed_cluster.run(
            ["bash", "-c", f"SELFTEST=only sbatch --parsable --wait -N1 --constraint={feature}"
             f" {recipes / 'bundle' / 'run.sub'}"], user=ALICE, timeout=300, cwd=jobs)
        job = done.stdout.strip().split(";")[0]
        output = (jobs / f"bert-pretrain-{job}.out").read_text()
        assert done.returncode == 0, f"{done.stderr}\n{output}"
        assert output.strip().splitlines()[-1] == MACHINE[platform], output
        assert f"self-test of {lock['platforms'][platform]['squashfs']}" in output, output

    # The importer on each node resolves the one index digest to its own platform, and
    # takes the squashfs published beside that platform's manifest (the recipes' pins).
    bin_dir = system_imgpipe(Path(__file__).resolve().parents[2])
    squashfs, config = node_cache("imgpipe-mixed-importer-")
    pins = " ".join(f"{lock['platforms'][p]['digest']}={d}" for p, d in published.items())
    uri = f"docker://head:5000#test/uname@{entry['digest']}"
    for node, platform in (("node2", "linux/arm64"), ("node1", "linux/amd64")):
        got = mixed_cluster.run(
            ["srun", "-w", node, "-N1", "-n1", str(bin_dir / "imgpipe-pyxis-importer"), "get",
             uri], user=ALICE, timeout=300, cwd="/tmp",
            env={"IMGPIPE_CONFIG": str(config), "IMGPIPE_SQUASHFS_PINS": pins})
        assert got.returncode == 0, (node, got.stderr)
        path = Path(got.stdout.strip())
        assert published[platform].split(":")[1] in path.name, (node, path)
        assert path.parent == squashfs
        again = mixed_cluster.run(  # warm: the same file, without the network's full path
            ["srun", "-w", node, "-N1", "-n1", str(bin_dir / "imgpipe-pyxis-importer"), "get",
             uri], user=ALICE, timeout=300, cwd="/tmp",
            env={"IMGPIPE_CONFIG": str(config), "IMGPIPE_SQUASHFS_PINS": pins})
        assert again.returncode == 0 and again.stdout.strip() == str(path), again.stderr


def _ids(user: str) -> tuple[int, int]:
    import pwd

    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def test_a_platform_named_in_build_builders_is_built_and_pushed_by_that_engine(
        pushed, tmp_path: Path) -> None:
    """build.builders names the engine that builds a platform (a Grace host's, over ssh or
    tcp); here this machine's own engine stands in for it through its socket address, so
    the build goes through that DOCKER_HOST and the push comes from it."""
    project = pushed["project"]
    config = yaml.safe_load((project / "imgpipe.yaml").read_text())
    socket_host = "unix:///var/run/docker.sock"
    other = tmp_path / "project"
    shutil.copytree(project / "images", other / "images")
    (other / "images" / "bert" / "hello.txt").write_text("built by the named engine\n")
    (other / "imgpipe.yaml").write_text(yaml.safe_dump(
        {**config, "build": {"builders": {"linux/arm64": socket_host}}}))
    doctor = imgpipe(other, "doctor")
    assert f"native builder {socket_host}" in doctor.stdout, doctor.stdout
    built = ok(other, "build", "bert")
    assert f"bert/cpu for linux/arm64 (native builder {socket_host})" in built, built
    ok(other, "push", "bert")
    entry = json.loads((other / "imgpipe.lock").read_text())["images"]["bert"]["cpu"]
    assert set(entry["platforms"]) == {"linux/amd64", "linux/arm64"}
    assert entry["digest"] != pushed["entry"]["digest"]  # new bytes, a new index
