"""The recipes' own runtime, for real: Pyxis 0.24.0 and Enroot 4.1.2 as `./setup.sh` builds
them, loaded by every compute host of a 3-host sandbox through the plugstack line
`imgpipe node-config` renders for a site (imgpipe's importer, job scope, squashfuse).

Every job here is a user's `srun --container-image=head:5000#REPO@DIGEST`: Pyxis runs the
importer as the job's user on each node, takes the squashfs path it prints and starts the
container with Enroot.  The importer's own lines reach no one on success (Pyxis keeps them
for failures), so what happened is read where it shows: the shared cache's entries, the head
registry's access log, the container's root mount and Pyxis's own lines.
"""

from __future__ import annotations

import hashlib
import pwd
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from imgpipe.enroot.published.pins import PINS_ENV
from imgpipe.recipes.runtimes import prelude
from imgpipe.recipes.staging import stage_function
from tests.cluster import USERS, node_cache, owned_by, shared_folder, system_imgpipe
from tests.published_image import ci_publish, hello_origin, sha256_file

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ALICE, BOB = USERS
REPOSITORY = "pyxis/hello"
NODE_CACHE = "/var/tmp/imgpipe-squashfs"  # node-local: each sandbox host has its own /var/tmp
SHOW = 'echo "$(hostname) $(id -un) $(cat /hello.txt)"'


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    """imgpipe in a venv of the system Python that every job user can run (the importer)."""
    return system_imgpipe(REPO)


@pytest.fixture(scope="module")
def pyxis_cluster(registry_server, bin_dir: Path):
    from imgpipe.commands.builds.sandbox import with_pyxis
    from imgpipe.recipes.sandbox import SandboxSpec, running
    from tests.cluster import ensure_users

    ensure_users()
    spec = with_pyxis(SandboxSpec(shared_folder("imgpipe-pyxis-"), name="imgpy",
                                  subnet="10.213.21", compute_nodes=3, cpus=4, gpus=0),
                      importer=str(bin_dir / "imgpipe-pyxis-importer"))
    with running(spec, registry_storage=registry_server.root / "data") as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def hello(tmp_path_factory: pytest.TempPathFactory, registry_server, base_image: str) -> dict:
    """A small image built, pushed and published with its squashfs by `imgpipe ci
    --squashfs`: {"digest", "pin", "uri"}."""
    origin = hello_origin(tmp_path_factory.mktemp("pyxis-origin"), registry_server.port,
                          REPOSITORY)
    published = ci_publish(origin, tmp_path_factory.mktemp("pyxis-ci") / "a")
    return {**published, "uri": f"head:5000#{REPOSITORY}@{published['digest']}"}


def _srun(cluster, user: str, config: Path, image: str, program: str, *options: str,
          env: dict[str, str] | None = None, timeout: float = 600
          ) -> subprocess.CompletedProcess[str]:
    return cluster.run(["srun", *options, f"--container-image={image}", "/bin/sh", "-c",
                        program], user=user, env={"IMGPIPE_CONFIG": str(config), **(env or {})},
                       timeout=timeout, cwd="/tmp")


def _entries(squashfs: Path, digest: str) -> list[Path]:
    return sorted(squashfs.glob(f"{REPOSITORY.replace('/', '+')}+{digest.replace(':', '-')}*"
                                ".sqsh"))


def test_two_users_start_a_new_digest_at_once_from_one_conversion(pyxis_cluster,
                                                                   hello: dict) -> None:
    """Alice's and Bob's jobs on two nodes each, started in the same second on a digest no
    node has: the importer converts it once under the digest's lock, every task starts in
    it through squashfuse (a read-only root whose lower layer is Enroot's squashfuse mount)."""
    squashfs, config = node_cache("imgpipe-pyxis-shared-")
    program = f"{SHOW}; awk '$2 == \"/\" {{print \"root:\", $1, $4}}' /proc/mounts"
    started = [subprocess.Popen(
        pyxis_cluster.on(None, ["srun", "-N2", f"--container-image={hello['uri']}",
                                "/bin/sh", "-c", program], user,
                         {"IMGPIPE_CONFIG": str(config)}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/tmp")
        for user in (ALICE, BOB)]
    outputs = [job.communicate(timeout=600) for job in started]
    for job, user, (out, err) in zip(started, (ALICE, BOB), outputs, strict=True):
        assert job.returncode == 0, out + err
        assert sorted(re.findall(r"^(node\d) (\S+) hello from CI$", out, re.M)) == [
            ("node1", user), ("node2", user)], out + err
        assert err.count(f"pyxis: imported docker image: {hello['uri']}") == 2, err
        roots = re.findall(r"^root: overlay (\S+)$", out, re.M)
        assert len(roots) == 2 and all(r.startswith("ro,") for r in roots), out
    # No cache writer here: each user trusts only their own conversion, made once for both
    # of that user's nodes (the digest's lock); conversion is deterministic: the bytes CI
    # published.
    entries = _entries(squashfs, hello["digest"])
    assert sorted(p.stat().st_uid for p in entries) == sorted(
        pwd.getpwnam(u).pw_uid for u in (ALICE, BOB)), [p.name for p in entries]
    for entry in entries:
        assert entry.name.endswith(f".u{entry.stat().st_uid}.sqsh")
        assert entry.stat().st_mode & 0o777 == 0o644
        assert sha256_file(entry) == hello["pin"]


def test_a_published_squashfs_is_fetched_instead_of_converted(pyxis_cluster,
                                                              hello: dict) -> None:
    squashfs, config = node_cache("imgpipe-pyxis-published-")
    since = pyxis_cluster.registry_log_size()
    done = _srun(pyxis_cluster, ALICE, config, hello["uri"], SHOW, "-N1", "-w", "node3",
                 env={PINS_ENV: f"{hello['digest']}={hello['pin']}"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "node3 imgpipe-alice hello from CI" in done.stdout
    assert f"pyxis: imported docker image: {hello['uri']}" in done.stderr
    [entry] = squashfs.glob(f"pyxis+hello+squashfs-sha256-{hello['pin'][7:]}*")
    assert sha256_file(entry) == hello["pin"]
    assert not _entries(squashfs, hello["digest"])  # nothing converted
    log = pyxis_cluster.registry_log.read_bytes()[since:].decode(errors="replace")
    served = re.findall(r'"GET /v2/[^ ]+/blobs/(sha256:[0-9a-f]{64})', log)
    assert set(served) == {hello["pin"]}, served  # the published blob alone, no layer
    assert sum(pyxis_cluster.registry_served(hello["pin"], since)) == entry.stat().st_size


def test_importer_failure_is_the_jobs_own_error_line_not_a_hang(pyxis_cluster,
                                                                hello: dict) -> None:
    _, config = node_cache("imgpipe-pyxis-missing-")
    missing = f"head:5000#{REPOSITORY}@sha256:{'0' * 64}"
    done = _srun(pyxis_cluster, BOB, config, missing, "true", "-N1", timeout=120)
    assert done.returncode != 0
    assert "pyxis: importer get failed with exit code 1" in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if "imgpipe: error:" in line]
    assert len(said) == 1 and "sha256:0000" in said[0], done.stderr
    assert "Traceback" not in done.stderr


def test_every_container_flag_the_job_scripts_pass(pyxis_cluster, hello: dict) -> None:
    """--container-mounts (read-only and read-write), --container-workdir,
    --no-container-mount-home, then --container-name (kept for the job's next step, which
    unpacks the image: no squashfuse; --container-writable, Enroot's root being read-only
    by default) and --container-save."""
    _, config = node_cache("imgpipe-pyxis-flags-")
    folder = shared_folder("imgpipe-pyxis-flags-")
    data, out = folder / "data", folder / "out"
    data.mkdir()
    (data / "input.txt").write_text("from the host\n")
    owned_by(ALICE, out)
    home = Path(pwd.getpwnam(ALICE).pw_dir)
    (home / ".imgpipe-home-mark").touch()  # what a mounted home would show
    saved = out / "saved.sqsh"
    mounts = f"--container-mounts={data}:/data:ro,{out}:/out"
    script = folder / "flags.sh"
    script.write_text("\n".join([
        "#!/bin/bash", "set -euo pipefail",
        f"srun -N1 --container-image={hello['uri']} {mounts} --container-workdir=/data "
        "--no-container-mount-home /bin/sh -c 'pwd; cat input.txt; "
        "touch input.txt 2>/dev/null || echo data read-only; echo written > /out/w.txt; "
        'test -e "$HOME/.imgpipe-home-mark" && echo home mounted || echo no home\'',
        f"srun -N1 --container-image={hello['uri']} --container-name=kept "
        "--container-writable /bin/sh -c 'echo kept > /kept.txt'",
        f"srun -N1 --container-name=kept --container-save={saved} "
        "/bin/sh -c 'cat /kept.txt /hello.txt'", ""]))
    script.chmod(0o755)
    log = out / "flags-%j.out"
    done = pyxis_cluster.run(["sbatch", "--parsable", "--wait", "-N1", "-o", str(log),
                              str(script)], user=ALICE, env={"IMGPIPE_CONFIG": str(config)},
                             timeout=600, cwd="/tmp")
    job = done.stdout.strip().splitlines()[0]
    text = Path(str(log).replace("%j", job)).read_text()
    assert done.returncode == 0, text + done.stderr
    assert "/data" in text.splitlines(), text  # the working directory
    for said in ("from the host", "data read-only", "no home", "kept", "hello from CI"):
        assert said in text.splitlines(), (said, text)
    assert (out / "w.txt").read_text() == "written\n"
    listed = subprocess.run(["unsquashfs", "-l", str(saved)], capture_output=True, text=True,
                            check=True).stdout
    assert "squashfs-root/kept.txt" in listed and "squashfs-root/hello.txt" in listed


@pytest.fixture(scope="module")
def node_local(pyxis_cluster, bin_dir: Path, hello: dict) -> dict:
    """Node-local caches (made by root on each node) and a config naming them."""
    folder = shared_folder("imgpipe-pyxis-local-")
    made = pyxis_cluster.run(["srun", "-N3", "--ntasks-per-node=1", str(bin_dir / "imgpipe"),
                              "node-config", "--make-cache", NODE_CACHE], timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    out = folder / "out"
    owned_by(ALICE, out)
    return {"folder": folder, "out": out}


@pytest.mark.parametrize("distribution", ["sbcast", "broadcast"])
def test_node_local_staging_is_what_pyxis_takes(pyxis_cluster, bin_dir: Path, hello: dict,
                                                node_local: dict, distribution: str) -> None:
    """stage_image as the Pyxis recipes render it, then the job's container step on three
    nodes: Pyxis's own `get` on each node takes the staged copy (one registry copy of the
    squashfs for the whole job, no node fetching for itself)."""
    importer = str(bin_dir / "imgpipe-pyxis-importer")
    config = node_local["folder"] / f"{distribution}.yaml"
    config.write_text(yaml.safe_dump({
        "registry": {"host": "head", "port": 5000}, "outputs": {"squashfs_dir": NODE_CACHE},
        "enroot": {"distribution": distribution, "importer_path": importer}}))
    config.chmod(0o644)
    cleared = pyxis_cluster.run(["srun", "-N3", "--ntasks-per-node=1", "/bin/sh", "-c",
                                 f"rm -f {NODE_CACHE}/pyxis+hello+*"], user=ALICE, cwd="/tmp")
    assert cleared.returncode == 0, cleared.stderr
    script = node_local["folder"] / f"{distribution}.sh"
    script.write_text("\n".join([
        "#!/bin/bash", "set -euo pipefail", f"CONT={hello['uri']}", prelude("pyxis"),
        stage_function("pyxis", distribution, importer, 2, "4M"),
        f"srun --ntasks-per-node=1 --container-image=\"$CONT\" /bin/sh -c '{SHOW}'", ""]))
    script.chmod(0o755)
    since = pyxis_cluster.registry_log_size()
    log = node_local["out"] / f"{distribution}-%j.out"
    done = pyxis_cluster.run(["sbatch", "--parsable", "--wait", "-N3", "-o", str(log),
                              str(script)], user=ALICE, cwd="/tmp", timeout=600,
                             env={"IMGPIPE_CONFIG": str(config),
                                  PINS_ENV: f"{hello['digest']}={hello['pin']}"})
    job = done.stdout.strip().splitlines()[0]
    text = Path(str(log).replace("%j", job)).read_text()
    assert done.returncode == 0, text + done.stderr
    assert sorted(re.findall(r"^(node\d) imgpipe-alice hello from CI$", text, re.M)) == [
        "node1", "node2", "node3"], text
    assert text.count(f"pyxis: imported docker image: {hello['uri']}") == 3, text
    assert "fetching for themselves" not in text and "refused" not in text, text
    size = sum(pyxis_cluster.registry_served(hello["pin"], since))
    held = pyxis_cluster.run(["srun", "-N3", "--ntasks-per-node=1", "/bin/sh", "-c",
                              f"sha256sum {NODE_CACHE}/pyxis+hello+*.sqsh"], user=ALICE,
                             cwd="/tmp")
    sums = {line.split()[0] for line in held.stdout.splitlines()}
    assert sums == {hello["pin"][7:]} and len(held.stdout.splitlines()) == 3, held.stdout
    assert size == _pin_size(pyxis_cluster, hello), (size, text)  # one registry copy


def _pin_size(cluster, hello: dict) -> int:
    done = cluster.run(["srun", "-N1", "-w", "node1", "/bin/sh", "-c",
                        f"stat -c %s {NODE_CACHE}/pyxis+hello+*.sqsh"], user=ALICE, cwd="/tmp")
    return int(done.stdout.split()[0])


# What Enroot's import writes itself, which imgpipe's converter writes its own way: /etc/rc and
# /etc/rc.local (Enroot's wording and its 0644; imgpipe's 0755, labels as `key=value`), and
# imgpipe's empty /etc/hosts (a mount point Enroot's hooks bind the node's file onto).
ENROOT_OWN = {"/etc/rc", "/etc/rc.local", "/etc/hosts"}


def _tree(squashfs: Path, into: Path) -> dict[str, tuple[str, ...]]:
    """Every entry of ``squashfs``: path -> (type and mode, owner, link target or content
    hash); folders without their size, which depends on the squashfs's own index."""
    subprocess.run(["unsquashfs", "-no-xattrs", "-q", "-d", str(into), str(squashfs)],
                   check=True, capture_output=True, timeout=300)
    listed = subprocess.run(["unsquashfs", "-lln", str(squashfs)], capture_output=True,
                            text=True, check=True, timeout=120).stdout
    tree: dict[str, tuple[str, ...]] = {}
    for line in listed.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("squashfs-root"):
            continue
        path = fields[5][len("squashfs-root"):].split(" -> ")[0] or "/"
        kind = fields[0]
        if kind.startswith("-"):
            content = hashlib.sha256((into / path.lstrip("/")).read_bytes()).hexdigest()
        elif kind.startswith("l"):
            content = fields[5].split(" -> ", 1)[1]
        else:
            content = ""
        tree[path] = (kind, fields[1], content)
    return tree


def test_the_converters_file_is_enroots_tree_and_both_start_with_enroot(
        pyxis_cluster, hello: dict) -> None:
    """`enroot import` of the image, by a user on a node (Enroot's own import: its layers,
    whiteouts, permissions and mksquashfs), beside the squashfs imgpipe's converter made of
    the same digest: the same tree but for what Enroot writes itself (ENROOT_OWN); each
    starts with `enroot start` as that user."""
    squashfs, config = node_cache("imgpipe-pyxis-enroot-")
    got = _srun(pyxis_cluster, ALICE, config, hello["uri"], "true", "-N1", "-w", "node2")
    assert got.returncode == 0, got.stderr
    [ours] = _entries(squashfs, hello["digest"])
    folder = shared_folder("imgpipe-pyxis-import-")
    owned_by(ALICE, folder / "out")
    theirs = folder / "out" / "enroot.sqsh"
    imported = pyxis_cluster.run(
        ["srun", "-N1", "-w", "node1", "enroot", "import", "-o", str(theirs),
         f"docker://{hello['uri']}"], user=ALICE, timeout=600, cwd="/tmp")
    assert imported.returncode == 0, imported.stdout[-2000:] + imported.stderr[-2000:]
    ours_tree = _tree(ours, folder / "ours")
    theirs_tree = _tree(theirs, folder / "theirs")
    differ = {path for path in ours_tree.keys() | theirs_tree.keys()
              if ours_tree.get(path) != theirs_tree.get(path)}
    assert differ == ENROOT_OWN, sorted(differ)[:20]
    assert len(ours_tree) > 1000  # a whole Debian tree, not an empty one
    for name, path in (("imgpipe", ours), ("enroot", theirs)):
        started = pyxis_cluster.run(
            ["srun", "-N1", "-w", "node1", "enroot", "start", str(path), "/bin/sh", "-c",
             f"echo {name}: $(cat /hello.txt)"], user=ALICE, timeout=300, cwd="/tmp")
        assert started.returncode == 0, started.stderr
        assert f"{name}: hello from CI" in started.stdout, started.stdout


def test_an_air_gapped_node_runs_an_nvcr_reference_from_the_site_mirror(
        pyxis_cluster, hello: dict, registry_server, tmp_path: Path) -> None:
    """The sandbox's hosts route nothing but their own range: no nvcr.io.  A stand-in for
    nvcr.io (a second registry only the head reaches) holds the image; the admin copies it
    into the site registry (`imgpipe mirror`) and maps nvcr.io there (registry.mirrors).  A
    user's `--container-image=nvcr.io#nvidia/pytorch:TAG` then runs from the mirror, and the
    same job without the mapping fails in one line that names the mirror command."""
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.mirror import Side, copy_image
    from tests import services

    standin = services.start_registry(tmp_path / "nvcr")
    try:
        copy_image(Side(RegistryClient(registry_server.url), REPOSITORY), hello["digest"],
                   Side(RegistryClient(standin.url), "nvidia/pytorch"), "24.05-py3",
                   tmp_path)
        (tmp_path / "head").mkdir()
        (tmp_path / "head" / "imgpipe.yaml").write_text(
            yaml.safe_dump({"registry": {"port": registry_server.port}}))
        mirrored = subprocess.run(
            [str(REPO / ".venv/bin/imgpipe"), "mirror",
             f"{standin.address}/nvidia/pytorch:24.05-py3", "nvidia/pytorch:24.05-py3"],
            cwd=tmp_path / "head", capture_output=True, text=True, timeout=300)
        assert mirrored.returncode == 0, mirrored.stderr
    finally:
        standin.stop()
    image = "nvcr.io#nvidia/pytorch:24.05-py3"
    squashfs, config = node_cache("imgpipe-pyxis-mirror-")
    plain = config.read_text()
    settings = yaml.safe_load(plain)
    settings["registry"]["mirrors"] = {"nvcr.io": ""}
    config.write_text(yaml.safe_dump(settings))
    done = _srun(pyxis_cluster, ALICE, config, image, SHOW, "-N1", "-w", "node2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "node2 imgpipe-alice hello from CI" in done.stdout, done.stdout + done.stderr
    assert f"pyxis: imported docker image: {image}" in done.stderr, done.stderr
    [entry] = squashfs.glob(f"nvidia+pytorch+{hello['digest'].replace(':', '-')}*.sqsh")
    assert entry.stat().st_uid == pwd.getpwnam(ALICE).pw_uid
    # without the mapping: Enroot's own import, which cannot reach nvcr.io from a node
    config.write_text(plain)
    failed = _srun(pyxis_cluster, ALICE, config, image, "true", "-N1", "-w", "node2",
                   timeout=300)
    assert failed.returncode != 0
    said = [line for line in failed.stderr.splitlines() if "imgpipe: error:" in line]
    assert len(said) == 1, failed.stderr
    assert "imgpipe mirror nvcr.io/nvidia/pytorch:24.05-py3" in said[0], said[0]
    assert "Traceback" not in failed.stderr
