"""Node-local squashfs caches, one registry read per job: the recipes' stage_image (the
batch host's importer gets the image, Slurm's sbcast copies it, every node's importer checks
the copy against the pin) on a 5-host sandbox whose hosts each have their own /var/tmp.

The registry's own access log counts what it served.  Jobs run as a non-root user, with
Charliecloud (the squashfs every node took is what ch-run mounts).  The bad cases each
cost one line and the job still starts: a corrupt copy on one node, sbcast missing or
failing, a node the requeued job gets later.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from imgpipe.enroot.published.pins import PINS_ENV
from imgpipe.recipes.runtimes import prelude
from imgpipe.recipes.staging import stage_function
from tests import services
from tests.cluster import USERS, owned_by, shared_folder, system_imgpipe, wait_until
from tests.published_image import REPO, ci_publish, hello_origin

pytestmark = pytest.mark.slow

ALICE, BOB = USERS
NODE_CACHE = "/var/tmp/imgpipe-squashfs"  # node-local: each sandbox host has its own tmpfs
REPOSITORY = "fanout/hello"


@pytest.fixture(scope="module")
def hosts(registry_server):
    """Five compute hosts (node-local /var/tmp each), the head serving the test registry."""
    from imgpipe.recipes.sandbox import SandboxSpec, running
    from tests.cluster import ensure_users

    ensure_users()
    spec = SandboxSpec(shared_folder("imgpipe-fanout-"), name="imgpf", subnet="10.213.13",
                       compute_nodes=5, cpus=2, gpus=0)
    with running(spec, registry_storage=registry_server.root / "data") as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def hello(tmp_path_factory, registry_server, base_image) -> dict:
    origin = hello_origin(tmp_path_factory.mktemp("fanout-origin"), registry_server.port,
                          REPOSITORY)
    published = ci_publish(origin, tmp_path_factory.mktemp("fanout-ci") / "a")
    head = services.plain_session().head(
        f"{registry_server.url}/v2/{REPOSITORY}/blobs/{published['pin']}", timeout=10)
    return {**published, "size": int(head.headers["Content-Length"])}


@pytest.fixture(scope="module")
def site(hosts, hello) -> dict:
    """The nodes' imgpipe (system venv), their config (node-local cache, sbcast), each
    node's cache made by root as a node's boot would (`node-config --make-cache`)."""
    bin_dir = system_imgpipe(REPO)
    folder = shared_folder("imgpipe-fanout-site-")
    config = folder / "imgpipe.yaml"
    config.write_text(yaml.safe_dump({
        "registry": {"host": "head", "port": 5000},
        "outputs": {"squashfs_dir": NODE_CACHE},
        "enroot": {"distribution": "sbcast", "importer_path": str(bin_dir /
                                                                   "imgpipe-pyxis-importer")}}))
    config.chmod(0o644)
    made = hosts.run(["srun", "-N5", "--ntasks-per-node=1", str(bin_dir / "imgpipe"),
                      "--config", str(config), "node-config", "--make-cache", NODE_CACHE],
                     timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    outputs = folder / "out"
    outputs.mkdir()
    owned_by(ALICE, outputs)
    return {"bin": bin_dir, "config": config, "folder": folder, "out": outputs,
            "uri": f"head:5000#{REPOSITORY}@{hello['digest']}",
            "pins": f"{hello['digest']}={hello['pin']}"}


def _script(site: dict, name: str, extra: str = "") -> Path:
    """A job as the recipes write it: the runtime's functions, stage_image, then one task
    per node in the image."""
    importer = str(site["bin"] / "imgpipe-pyxis-importer")
    text = "\n".join([
        "#!/bin/bash", "set -euo pipefail", f"CONT={site['uri']}",
        'echo "run ${SLURM_RESTART_COUNT:-0}"', extra,
        prelude("charliecloud"), stage_function("charliecloud", "sbcast", importer, 8, "8M"),
        "WORKDIR=/  # the hello image has no /workspace", 'step=(--ntasks-per-node=1)',
        'launch /bin/sh -c \'echo "$(hostname): $(cat /hello.txt)"\'',
        ""])
    path = site["folder"] / f"{name}.sh"
    path.write_text(text)
    path.chmod(0o755)
    return path


def _sbatch(hosts, site: dict, script: Path, *args: str, env: dict | None = None,
            wait: bool = True) -> tuple[str, str]:
    """Submit as the job user; (job id, its output once done)."""
    out = site["out"] / f"{script.stem}-%j.out"
    done = hosts.run(["sbatch", "--parsable", *(["--wait"] if wait else []), "-o", str(out),
                      *args, str(script)], user=ALICE, cwd="/tmp", timeout=600,
                     env={"IMGPIPE_CONFIG": str(site["config"]), PINS_ENV: site["pins"],
                          **(env or {})})
    job = done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
    assert job, done.stdout + done.stderr
    text = Path(str(out).replace("%j", job)).read_text() if wait else ""
    assert not wait or done.returncode == 0, text + done.stderr
    return job, text


def _clear_caches(hosts, site: dict) -> None:
    """Every node's entries of the image go (as their owner), so a job starts cold."""
    done = hosts.run(["srun", "-N5", "--ntasks-per-node=1", "/bin/sh", "-c",
                      f"rm -f {NODE_CACHE}/fanout+hello+*"], user=ALICE, cwd="/tmp")
    assert done.returncode == 0, done.stderr


def _copies(hosts, hello: dict, since: int) -> float:
    """Copies of the pinned squashfs the registry served since ``since`` (a fetch may be
    several ranges: bytes, not requests, count)."""
    return sum(hosts.registry_served(hello["pin"], since)) / hello["size"]


def _ran_everywhere(text: str, nodes: list[str]) -> None:
    ran = sorted(re.findall(r"^(node\d): hello from CI$", text, re.M))
    assert ran == sorted(nodes), text


def test_a_four_node_job_reads_the_registry_once(hosts, site, hello) -> None:
    _clear_caches(hosts, site)
    since = hosts.registry_log_size()
    job, text = _sbatch(hosts, site, _script(site, "once"), "-N4", "-w", "node[1-4]")
    _ran_everywhere(text, ["node1", "node2", "node3", "node4"])
    assert _copies(hosts, hello, since) == 1, text  # the batch host's fetch alone
    took = re.findall(r"imgpipe: (node\d): took the sbcast copy (sha256:[0-9a-f]+)", text)
    assert sorted(node for node, _ in took) == ["node2", "node3", "node4"], text
    assert all(hello["pin"].startswith(digest) for _, digest in took)
    # every node now holds the pinned bytes as this user's own entry, nothing left staged
    listed = hosts.run(["srun", "-N4", "-w", "node[1-4]", "--ntasks-per-node=1", "/bin/sh",
                        "-c", f"sha256sum {NODE_CACHE}/fanout+hello+squashfs-*.sqsh; "
                        f"ls {NODE_CACHE}/.imgpipe/tmp"], user=ALICE, cwd="/tmp")
    hashed = [line for line in listed.stdout.splitlines() if line.endswith(".sqsh")]
    assert len(hashed) == 4 and all(line.startswith(hello["pin"][7:] + " ") for line in hashed)
    assert "sbcast." not in listed.stdout, listed.stdout

    # The next job on the same nodes: every node has it; the registry serves nothing.
    since = hosts.registry_log_size()
    _, text = _sbatch(hosts, site, _script(site, "again"), "-N4", "-w", "node[1-4]")
    _ran_everywhere(text, ["node1", "node2", "node3", "node4"])
    assert hosts.registry_served(hello["pin"], since) == [], text
    assert "took the sbcast copy" not in text and "fetching" not in text, text


def test_a_copy_corrupted_on_one_node_is_refused_and_fetched_there(hosts, site, hello
                                                                   ) -> None:
    """Bit rot on node3's copy between sbcast and the check (an importer wrapper flips a byte
    of the staged file there first): node3 refuses it in one line and fetches for itself."""
    _clear_caches(hosts, site)
    wrapper = site["folder"] / "rotting-importer"
    real = site["bin"] / "imgpipe-pyxis-importer"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = take ] && [ "$(hostname)" = node3 ] && [ -f "$4" ]; then\n'
        '  printf X | dd of="$4" bs=1 seek=4096 conv=notrunc status=none\n'
        "fi\n"
        f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    since = hosts.registry_log_size()
    _, text = _sbatch(hosts, site, _script(site, "rot"), "-N4", "-w", "node[1-4]",
                      env={"IMGPIPE_IMPORTER": str(wrapper)})
    _ran_everywhere(text, ["node1", "node2", "node3", "node4"])
    refused = [line for line in text.splitlines() if "refused the sbcast copy" in line]
    assert len(refused) == 1 and refused[0].startswith("imgpipe: node3: "), text
    assert "fetching it from the registry" in refused[0]
    assert _copies(hosts, hello, since) == 2, text  # batch host, node3


@pytest.mark.parametrize("sbcast, said", [
    ("/nonexistent/sbcast", "/nonexistent/sbcast is not on this host's PATH"),
    ("/bin/false", "sbcast of "),
])
def test_without_a_working_sbcast_every_node_fetches_and_the_job_starts(
        hosts, site, hello, sbcast: str, said: str) -> None:
    _clear_caches(hosts, site)
    since = hosts.registry_log_size()
    _, text = _sbatch(hosts, site, _script(site, "nosbcast"), "-N3", "-w", "node[1-3]",
                      env={"IMGPIPE_SBCAST": sbcast})
    _ran_everywhere(text, ["node1", "node2", "node3"])
    assert sum(said in line for line in text.splitlines()) == 1, text
    missing = re.findall(r"imgpipe: (node\d): no sbcast copy arrived", text)
    assert sorted(missing) == ["node2", "node3"], text
    assert _copies(hosts, hello, since) == 3, text


def test_a_requeued_job_on_a_fresh_node_takes_the_copy(hosts, site, hello) -> None:
    """A 4-node job on node1-4, requeued and kept off node1: it starts again on node2-5;
    node5 (empty cache) takes the copy its new batch host sends, and the registry serves
    nothing (node2 has it since the first run)."""
    _clear_caches(hosts, site)
    job, text = _sbatch(hosts, site, _script(site, "requeue"), "-N4", "--requeue",
                        "--open-mode=append", "-x", "node5")
    _ran_everywhere(text, ["node1", "node2", "node3", "node4"])
    since = hosts.registry_log_size()
    for argv in (["scontrol", "requeue", job],
                 ["scontrol", "update", f"JobId={job}", "ExcNodeList=node1"]):
        done = hosts.run(argv, user=ALICE, cwd="/tmp")
        assert done.returncode == 0, done.stderr
    out = site["out"] / f"requeue-{job}.out"

    def finished() -> bool:
        state = hosts.run(["squeue", "-h", "-j", job, "-o", "%T"], cwd="/tmp").stdout.strip()
        return state == "" and out.read_text().count("hello from CI") == 8

    wait_until(finished, "the requeued job", 240, lambda: out.read_text())
    second = out.read_text().split("run 1\n", 1)[1]
    assert "imgpipe: node5: took the sbcast copy" in second, second
    assert hosts.registry_served(hello["pin"], since) == [], second
    assert sorted(re.findall(r"^(node\d): hello", second, re.M)) == [
        "node2", "node3", "node4", "node5"], second



def test_a_copy_another_user_planted_is_never_taken(hosts, site, hello) -> None:
    """bob (another job user on the node) plants the genuine bytes, and a link, under
    staging names with alice's prefix in the node's shared temporary folder: alice's take
    refuses both in one line each and fetches for herself; her entry is her own file."""
    _clear_caches(hosts, site)
    tmp = f"{NODE_CACHE}/.imgpipe/tmp"
    uid = hosts.run(["id", "-u", ALICE]).stdout.strip()
    planted, linked = f"{tmp}/sbcast.u{uid}.1.planted.sqsh", f"{tmp}/sbcast.u{uid}.1.link.sqsh"
    importer = str(site["bin"] / "imgpipe-pyxis-importer")
    env = {"IMGPIPE_CONFIG": str(site["config"]), PINS_ENV: site["pins"]}
    done = hosts.run(["srun", "-w", "node2", "-N1", "/bin/sh", "-c",
                      f"{importer} get docker://{site['uri']} >/dev/null && "
                      f"cp {NODE_CACHE}/fanout+hello+squashfs-*.u*.sqsh {planted} && "
                      f"ln -s {NODE_CACHE}/.imgpipe/VERSION {linked} && "
                      f"rm -f {NODE_CACHE}/fanout+hello+*"], user=BOB, env=env, cwd="/tmp",
                     timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for staged, said in ((planted, "is not a copy of yours alone"),
                         (linked, "the sbcast copy cannot be opened")):
        done = hosts.run(["srun", "-w", "node2", "-N1", importer, "take", site["uri"],
                          hello["pin"], staged, hello["digest"]], user=ALICE, env=env,
                         cwd="/tmp", timeout=300)
        assert done.returncode == 0, done.stderr
        lines = [line for line in done.stderr.splitlines() if "imgpipe: node2: " in line]
        assert len(lines) == 1 and said in lines[0], done.stderr
        assert "fetching it from the registry" in lines[0]
        entry = done.stdout.strip()
        owner = hosts.run(["srun", "-w", "node2", "-N1", "stat", "-c", "%U %i", entry,
                           planted], user=ALICE, cwd="/tmp").stdout.split("\n")
        assert owner[0].split()[0] == ALICE and owner[0].split()[1] != owner[1].split()[1]
        hosts.run(["srun", "-w", "node2", "-N1", "rm", "-f", entry], user=ALICE, cwd="/tmp")
