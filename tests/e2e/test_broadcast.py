"""``enroot.distribution: broadcast`` on a 5-host sandbox (node-local /var/tmp each): the
recipes' stage_image runs one ``srun --mpi=pmix`` step; the batch host fetches the pinned
squashfs once and streams each chunk its ranged fetch checked to the nodes that lack it,
every node writing and hashing as it receives (commands.node.broadcast).

The image is a real squashfs of random bytes (40 MiB of data: six chunks of 8 MiB, published
with their digests), so the batch host's fetch is ranged and the stream follows it.  The
registry's access log counts what it served.  Jobs run as a non-root user; after
stage_image one host task per node hashes the entry Charliecloud's CONT names.  Each bad
case costs one line and the job still starts: a broken chunk on one node (fetched again
there from that chunk on), a node that holds the image (receives nothing), another user's
bytes sent in the batch host's place (refused: not a pin, or not hashing to it).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from imgpipe.enroot.published.artifact import publish
from imgpipe.enroot.published.pins import PINS_ENV
from imgpipe.recipes.runtimes import prelude
from imgpipe.recipes.staging import stage_function
from imgpipe.registry.client import RegistryClient
from tests import services
from tests.cluster import USERS, owned_by, shared_folder, system_imgpipe
from tests.published_image import REPO, sha256_file

pytestmark = pytest.mark.slow

ALICE, BOB = USERS
NODE_CACHE = "/var/tmp/imgpipe-squashfs"  # node-local: each sandbox host has its own tmpfs
REPOSITORY = "broadcast/random"
CHUNK = 8 << 20


def _random_squashfs(folder: Path, size: int, name: str) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("random.bin")
        info.size, info.mode = size, 0o644
        tar.addfile(info, io.BytesIO(os.urandom(size)))
    out = folder / name
    subprocess.run(["tar2sqfs", "--quiet", "--no-skip", "--compressor", "zstd", str(out)],
                   input=buffer.getvalue(), check=True, capture_output=True, timeout=120)
    out.chmod(0o644)
    return out


@pytest.fixture(scope="module")
def hosts(registry_server):
    from imgpipe.recipes.sandbox import SandboxSpec, running
    from tests.cluster import ensure_users

    ensure_users()
    spec = SandboxSpec(shared_folder("imgpipe-bcast-"), name="imgpb", subnet="10.213.14",
                       compute_nodes=5, cpus=2, gpus=0)
    with running(spec, registry_storage=registry_server.root / "data") as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def image(tmp_path_factory, registry_server) -> dict:
    """A small image with a 40 MiB squashfs (six chunks of 8 MiB, the last short) published
    beside it with their digests, and a
    squashfs of bob's (as large) that is no pin."""
    folder = tmp_path_factory.mktemp("bcast-image")
    squashfs = _random_squashfs(folder, 40 << 20, "image.sqsh")
    client = RegistryClient(registry_server.url, allow_http=True)
    layer = services.tar_layer({"etc/os-release": b"ID=bcast\n"})
    digest = services.push_image(services.plain_session(), registry_server.url, REPOSITORY,
                                 "1", [layer])
    pin = sha256_file(squashfs)
    publish(client, REPOSITORY, client.manifest(REPOSITORY, digest), squashfs, pin, "zstd", 1,
            chunk_size=CHUNK)
    bobs = _random_squashfs(shared_folder("imgpipe-bcast-bob-"), 40 << 20, "bobs.sqsh")
    return {"digest": digest, "pin": pin, "size": squashfs.stat().st_size, "bobs": bobs,
            "uri": f"head:5000#{REPOSITORY}@{digest}"}


@pytest.fixture(scope="module")
def site(hosts, image) -> dict:
    """The nodes' imgpipe (system venv), config (node-local cache, broadcast), each node's
    cache made by root as a node's boot would."""
    bin_dir = system_imgpipe(REPO)
    folder = shared_folder("imgpipe-bcast-site-")
    config = folder / "imgpipe.yaml"
    config.write_text(yaml.safe_dump({
        "registry": {"host": "head", "port": 5000},
        "outputs": {"squashfs_dir": NODE_CACHE},
        "enroot": {"distribution": "broadcast",
                   "importer_path": str(bin_dir / "imgpipe-pyxis-importer")}}))
    config.chmod(0o644)
    made = hosts.run(["srun", "-N5", "--ntasks-per-node=1", str(bin_dir / "imgpipe"),
                      "--config", str(config), "node-config", "--make-cache", NODE_CACHE],
                     timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    outputs = folder / "out"
    outputs.mkdir()
    owned_by(ALICE, outputs)
    return {"bin": bin_dir, "config": config, "folder": folder, "out": outputs,
            "env": {"IMGPIPE_CONFIG": str(config),
                    PINS_ENV: f"{image['digest']}={image['pin']}"}}


def _script(site: dict, image: dict, name: str) -> Path:
    """stage_image as the recipes render it (Charliecloud: CONT becomes the entry), then
    one host task per node that hashes the entry."""
    importer = str(site["bin"] / "imgpipe-pyxis-importer")
    text = "\n".join([
        "#!/bin/bash", "set -euo pipefail", f"CONT={image['uri']}",
        prelude("charliecloud"), stage_function("charliecloud", "broadcast", importer, 4, "8M"),
        'srun --ntasks-per-node=1 /bin/sh -c \'echo "$(hostname): $(sha256sum < "$0")"\' '
        '"$CONT"', ""])
    path = site["folder"] / f"{name}.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path


def _sbatch(hosts, site: dict, image: dict, name: str, nodes: str = "node[1-4]",
            env: dict | None = None) -> str:
    out = site["out"] / f"{name}-%j.out"
    done = hosts.run(["sbatch", "--parsable", "--wait", "-o", str(out), "-N4", "-w", nodes,
                      str(_script(site, image, name))], user=ALICE, cwd="/tmp", timeout=600,
                     env={**site["env"], **(env or {})})
    job = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    assert job, done.stdout + done.stderr
    text = Path(str(out).replace("%j", job)).read_text()
    assert done.returncode == 0, text + done.stderr
    return text


def _clear(hosts) -> None:
    done = hosts.run(["srun", "-N5", "--ntasks-per-node=1", "/bin/sh", "-c",
                      f"rm -f {NODE_CACHE}/broadcast+random+* "
                      f"{NODE_CACHE}/.imgpipe/tmp/u$(id -u)/sqsh-*"], user=ALICE, cwd="/tmp")
    assert done.returncode == 0, done.stderr


def _copies(hosts, image: dict, since: int) -> float:
    return round(sum(hosts.registry_served(image["pin"], since)) / image["size"], 2)


def _every_node_holds_the_pin(text: str, image: dict, nodes: list[str]) -> None:
    hashed = dict(re.findall(r"^(node\d): ([0-9a-f]{64})", text, re.M))
    assert sorted(hashed) == nodes, text
    assert set(hashed.values()) == {image["pin"][7:]}, text


def _sent_to(text: str) -> list[str]:
    said = re.findall(r"imgpipe: node1: broadcast sha256:[0-9a-f]{12}… \([^)]*\) in [0-9.]+ s:"
                      r" \d+ node\(s\) took it \(([^)]*)\)", text)
    assert len(said) == 1, text
    return said[0].split(", ")


def test_four_nodes_take_one_registry_copy(hosts, site, image) -> None:
    _clear(hosts)
    since = hosts.registry_log_size()
    text = _sbatch(hosts, site, image, "once")
    _every_node_holds_the_pin(text, image, ["node1", "node2", "node3", "node4"])
    assert _sent_to(text) == ["node2", "node3", "node4"], text
    assert _copies(hosts, image, since) == 1.0, text
    assert "sbcast" not in text and "refused" not in text, text
    # the batch host's fetch began with the job, and the step's first task sent what it
    # checked (issue #61), not a fetch of its own
    assert re.search(r"broadcast sha256:[0-9a-f]{12}… \([^)]*, fetched since the job's "
                     r"start\) in", text), text


def test_a_node_that_holds_the_image_receives_nothing(hosts, site, image) -> None:
    _clear(hosts)
    done = hosts.run(["srun", "-w", "node3", "-N1", str(site["bin"] / "imgpipe-pyxis-importer"),
                      "get", f"docker://{image['uri']}"], user=ALICE, env=site["env"],
                     cwd="/tmp", timeout=300)
    assert done.returncode == 0, done.stderr
    entry = done.stdout.strip()
    before = hosts.run(["srun", "-w", "node3", "-N1", "stat", "-c", "%i %Y", entry],
                       user=ALICE, cwd="/tmp").stdout
    since = hosts.registry_log_size()
    text = _sbatch(hosts, site, image, "holder")
    _every_node_holds_the_pin(text, image, ["node1", "node2", "node3", "node4"])
    assert _sent_to(text) == ["node2", "node4"], text  # node3 took no part
    assert _copies(hosts, image, since) == 1.0, text
    after = hosts.run(["srun", "-w", "node3", "-N1", "/bin/sh", "-c",
                       f"stat -c '%i %Y' {entry}; ls {NODE_CACHE}/.imgpipe/tmp/u$(id -u)"],
                      user=ALICE, cwd="/tmp").stdout
    assert after.startswith(before) and "sqsh-" not in after, after  # nothing written there


def test_a_broken_chunk_on_one_node_is_fetched_again_there(hosts, site, image) -> None:
    """Bytes that arrive broken on node3 (a byte of the third unit flipped on its way to the
    disk, before the hash): node3 says so in one line, keeps the chunks before it and
    fetches the rest; every other node takes the copy; the job starts everywhere."""
    _clear(hosts)
    python = site["bin"] / "python"
    wrapper = site["folder"] / "breaking-importer"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = broadcast ] && [ "$(hostname)" = node3 ]; then\n'
        f'  exec {python} -c "$(cat <<\'EOF\'\n'
        "import sys\n"
        "from imgpipe.enroot.published import relay\n"
        "put = relay.Receiver.put\n"
        "def broken(self, buffer, length):\n"
        "    if self.queued == 2 * relay.UNIT:\n"
        "        buffer[100] ^= 0xFF\n"
        "    put(self, buffer, length)\n"
        "relay.Receiver.put = broken\n"
        "from imgpipe.cli.importer import run\n"
        "sys.argv[0] = 'imgpipe-pyxis-importer'\n"
        "run()\n"
        "EOF\n"
        ')" "$@"\n'
        "fi\n"
        f'exec {site["bin"] / "imgpipe-pyxis-importer"} "$@"\n')
    wrapper.chmod(0o755)
    since = hosts.registry_log_size()
    text = _sbatch(hosts, site, image, "broken", env={"IMGPIPE_IMPORTER": str(wrapper)})
    _every_node_holds_the_pin(text, image, ["node1", "node2", "node3", "node4"])
    refused = [line for line in text.splitlines() if "refused the broadcast copy" in line]
    assert len(refused) == 1 and refused[0].startswith("imgpipe: node3: "), text
    last = -(-image["size"] // CHUNK) - 1
    assert f"keeping chunks 0-1, fetching chunks 2-{last} from the registry" in refused[0], text
    assert _sent_to(text) == ["node2", "node4"], text
    assert "fetching for themselves: node3" in text, text
    # the batch host's copy, and node3's chunks from the third on
    assert _copies(hosts, image, since) == pytest.approx(
        1.0 + (image["size"] - 2 * CHUNK) / image["size"], abs=0.01), text


@pytest.mark.parametrize("claims, said", [
    ("bobs", "is not a pin of this job"),
    ("pin", "the bytes hash to sha256:"),
])
def test_another_users_bytes_in_the_batch_hosts_place_are_refused(
        hosts, site, image, claims: str, said: str) -> None:
    """bob's bytes reach alice's nodes through the job's broadcast in place of the batch
    host's (a sender that is not hers: the chain trusts whoever says the token), naming
    his own blob or alice's pin: every node refuses them in one line, fetches for itself
    and holds the pinned bytes; nothing of bob's becomes an entry."""
    _clear(hosts)
    python = site["bin"] / "python"
    blob = sha256_file(image["bobs"]) if claims == "bobs" else image["pin"]
    wrapper = site["folder"] / f"bobs-sender-{claims}"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = broadcast ] && [ "$(hostname)" = node1 ]; then\n'
        f'  exec {python} -c "$(cat <<\'EOF\'\n'
        "import os, sys\n"
        "from pathlib import Path\n"
        "from imgpipe.commands.node import chainstep as b\n"
        "from imgpipe.enroot.published.relay import Header, Prefix\n"
        "def bobs(mpi, team, fetch, pins, here, toward):\n"
        f"    source = Path({str(image['bobs'])!r})\n"
        f"    header = Header({blob!r}, source.stat().st_size)\n"
        "    b.bcast_header(mpi, team, header)\n"
        "    prefix = Prefix()\n"
        "    prefix.finish(source)\n"
        "    _, out = b.make_chain(mpi, team, toward)\n"
        "    b.send_units(out, header, os.open(source, os.O_RDONLY), prefix, False)\n"
        "    b.after_the_rest(mpi, team)\n"
        "    names = bytearray(b.NAME * team.Get_size())\n"
        "    team.Gather([bytearray(b.NAME), mpi.BYTE], [names, mpi.BYTE], root=0)\n"
        "    return fetch.result()\n"
        "b.send_from_batch_host = bobs\n"
        "from imgpipe.cli.importer import run\n"
        "sys.argv[0] = 'imgpipe-pyxis-importer'\n"
        "run()\n"
        "EOF\n"
        ')" "$@"\n'
        "fi\n"
        f'exec {site["bin"] / "imgpipe-pyxis-importer"} "$@"\n')
    wrapper.chmod(0o755)
    text = _sbatch(hosts, site, image, f"bob-{claims}", env={"IMGPIPE_IMPORTER": str(wrapper)})
    _every_node_holds_the_pin(text, image, ["node1", "node2", "node3", "node4"])
    refused = [line for line in text.splitlines() if "refused the broadcast copy" in line]
    assert sorted(line.split(":")[1].strip() for line in refused) == [
        "node2", "node3", "node4"], text
    assert all(said in line for line in refused), text
    bobs_hex = hashlib.sha256(image["bobs"].read_bytes()).hexdigest()
    assert bobs_hex not in text
