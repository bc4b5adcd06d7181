"""Convert once, run anywhere: CI publishes the squashfs beside its image, nodes fetch it.

Clone A runs what CI runs (`imgpipe ci --squashfs`): build, self-test, push, convert once,
publish the squashfs as an OCI artifact whose subject is the image, and pin its digest in
imgpipe.lock and the rendered recipes.  On the sandbox cluster (the head's registry serves
the same storage, read-only) a non-root user's job on another host with an empty cache gets
the image through the Pyxis importer without converting anything, and runs it.  A second
clone verifies the published file byte for byte and from then on fetches it too.  Someone
who replaces the artifact is refused by every pinned reader; `imgpipe verify` names both
digests.  And the registry's lifecycle commands treat the artifact as part of its image.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import requests
import yaml

from imgpipe.base.directio import ALIGN
from imgpipe.enroot.published.artifact import ARTIFACT_TYPE, find_published, publish
from imgpipe.enroot.published.pins import PINS_ENV
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import DigestMismatchError
from imgpipe.registry.referrers import referrers, referrers_tag
from imgpipe.registry.transfer import fetch_resumable
from tests import services
from tests.cluster import USERS, node_cache, system_imgpipe
from tests.conftest import CliRun
from tests.published_image import ci_publish, git, hello_origin, sha256_file

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ALICE, BOB = USERS
@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory, registry_server) -> Path:
    return hello_origin(tmp_path_factory.mktemp("published-origin"), registry_server.port,
                        "published/hello")


@pytest.fixture(scope="module")
def published(origin: Path, tmp_path_factory: pytest.TempPathFactory, base_image: str) -> dict:
    """Clone A runs `imgpipe ci --flavor cpu --squashfs` as the workflow does."""
    return ci_publish(origin, tmp_path_factory.mktemp("ci-runner") / "a")


def _job(cluster, user: str, node: str, config: Path, digest: str, pins: str | None,
         program: str = "cat /hello.txt") -> subprocess.CompletedProcess[str]:
    """A one-node job as ``user``: the importer's get (what Pyxis runs first), then the
    program inside the squashfs it printed (ch-run mounts it as that user)."""
    importer = system_imgpipe(REPO) / "imgpipe-pyxis-importer"
    uri = f"docker://head:5000#published/hello@{digest}"
    script = (f'squashfs=$({importer} get {uri}) || exit 1; echo "got $squashfs"; '
              f'ch-run "$squashfs" -- /bin/sh -c "{program}"')
    env = {"IMGPIPE_CONFIG": str(config), **({PINS_ENV: pins} if pins else {})}
    return cluster.run(["srun", "-w", node, "-N1", "-n1", "/bin/sh", "-c", script], user=user,
                       env=env, timeout=300, cwd="/tmp")


def _got(done: subprocess.CompletedProcess[str]) -> Path:
    return Path(next(line for line in done.stdout.splitlines()
                     if line.startswith("got "))[4:])


def test_a_node_runs_the_published_squashfs_without_converting(cluster, published: dict,
                                                               capsys) -> None:
    clone = CliRun(published["folder"], capsys)
    code, out, err = clone("recipes", "render", "--profile", "local", "--nodes", "1", "-o",
                           "rendered", "--image", f"{published['entry']['repository']}@"
                           f"{published['digest']}")
    assert code == 0, out + err
    pins = f"{published['digest']}={published['pin']}"
    assert f"export {PINS_ENV}={pins}\n" in (clone.folder / "rendered" / "run.sub").read_text()
    code, out, err = clone("registry", "ls")
    # tags sort as text: the commit's short hash may come before 1.0.0 (07601681a5c5, 1.0.0)
    [listed] = [line for line in out.splitlines() if line.startswith("published/hello  ")]
    assert code == 0 and "1.0.0" in listed.split("  ")[1].split(", "), out + err
    assert "[squashfs published: " in listed and "1.0.0 (zstd)" in listed, out

    squashfs, config = node_cache("imgpipe-published-")
    done = _job(cluster, ALICE, "node2", config, published["digest"], pins)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hello from CI" in done.stdout
    assert f"fetched published squashfs {published['pin']}" in done.stderr, done.stderr
    assert "squash with" not in done.stderr and "merge" not in done.stderr, done.stderr
    fetched = _got(done)
    assert fetched.parent == squashfs and sha256_file(fetched) == published["pin"]
    assert fetched.stat().st_mode & 0o777 == 0o644
    assert not list((squashfs / ".imgpipe" / "tmp").rglob("*.part"))  # nothing half-written

    # No pin, no site opt-in: the published file is not trusted; an empty cache on another
    # host converts, and the bytes equal the published ones (conversion is deterministic).
    squashfs2, config2 = node_cache("imgpipe-unpinned-")
    done = _job(cluster, BOB, "node1", config2, published["digest"], None)
    assert done.returncode == 0 and "hello from CI" in done.stdout, done.stderr
    assert "is not pinned: converting" in done.stderr and "squash with" in done.stderr
    assert sha256_file(_got(done)) == published["pin"]


def test_a_second_clone_verifies_then_fetches(origin: Path, published: dict, tmp_path: Path,
                                              capsys) -> None:
    git("clone", "-q", str(origin), str(tmp_path / "b"), cwd=origin.parent)
    second = CliRun(tmp_path / "b", capsys)
    image = f"{published['entry']['repository']}@{published['digest']}"
    code, out, err = second("recipes", "render", "--profile", "local", "--nodes", "1", "-o",
                            "before", "--image", image)
    assert code == 0 and "that imgpipe.lock does not pin" in err, out + err
    assert PINS_ENV not in (second.folder / "before" / "run.sub").read_text()
    code, out, err = second("verify", "hello")
    assert code == 0, out + err
    assert f"published squashfs {published['pin']} (zstd) equals a local conversion" in out
    lock = json.loads((second.folder / "imgpipe.lock").read_text())["images"]["hello"]["cpu"]
    assert lock["squashfs_digests"] == {"zstd": published["pin"]}
    assert not list((second.folder / "build" / "squashfs").glob("*.sqsh"))  # private compare
    code, out, err = second("recipes", "render", "--profile", "local", "--nodes", "1", "-o",
                            "after", "--image", image)
    assert code == 0 and "does not pin" not in err, out + err
    assert f"export {PINS_ENV}={published['digest']}={published['pin']}\n" in (
        second.folder / "after" / "run.sub").read_text()
    code, out, err = second("convert", "hello")
    assert code == 0, out + err
    assert f"fetched published squashfs {published['pin'][:19]}" in out, out + err
    assert "squash with" not in out + err
    lock = json.loads((second.folder / "imgpipe.lock").read_text())["images"]["hello"]["cpu"]
    assert lock["squashfs_sha256"] == published["pin"]
    code, out, err = second("convert", "hello", "--no-published", "--compression", "lz4")
    assert code == 0 and "squash with lz4" in err, out + err
    code, out, err = second("push", "hello", "--squashfs")  # idempotent: nothing new to send
    assert code == 0, out + err
    assert f"hello/cpu: squashfs {published['pin']} (zstd) published already" in out


def test_lz4_conversions_are_reproducible_and_verify(origin: Path, published: dict,
                                                    registry_server, tmp_path: Path,
                                                    capsys) -> None:
    """mksquashfs's files (lz4 here; lzo-enroot and none likewise) carry no run's time: two
    empty caches convert one digest to equal bytes, and a published lz4 file verifies."""
    git("clone", "-q", str(origin), str(tmp_path / "c"), cwd=origin.parent)
    clone = CliRun(tmp_path / "c", capsys)
    made = []
    for cache in ("first", "second"):
        clone.write_config({"registry": {"port": registry_server.port}, "default_flavor": "cpu",
                            "outputs": {"squashfs_dir": str(tmp_path / cache)},
                            "enroot": {"publish_compressions": ["lz4"]}})
        code, out, err = clone("convert", "hello", "--no-published", "--compression", "lz4",
                               "--json")
        assert code == 0, out + err
        made.append(sha256_file(Path(json.loads(out)["data"]["squashfs"])))
    assert made[0] == made[1]
    code, out, err = clone("push", "hello", "--squashfs")
    assert code == 0 and f"hello/cpu: squashfs {made[0]} (lz4)" in out, out + err
    git("clone", "-q", str(origin), str(tmp_path / "d"), cwd=origin.parent)
    checker = CliRun(tmp_path / "d", capsys)
    code, out, err = checker("verify", "hello", "--compression", "lz4")
    assert code == 0, out + err
    assert f"published squashfs {made[0]} (lz4) equals a local conversion" in out


def test_a_broken_fetch_resumes_and_a_wrong_start_is_thrown_away(registry_server,
                                                                  published: dict,
                                                                  tmp_path: Path) -> None:
    client = RegistryClient(f"http://{registry_server.address}")
    pin = published["pin"]
    whole = requests.get(f"http://{registry_server.address}/v2/published/hello/blobs/{pin}",
                         timeout=60).content
    partial = tmp_path / "squashfs.part"
    partial.write_bytes(whole[:len(whole) // 2])  # what a transfer broken half-way kept
    os.chmod(partial, 0o600)
    received = fetch_resumable(client, "published/hello", pin, partial)
    kept = len(whole) // 2 - len(whole) // 2 % ALIGN  # resumed from an aligned offset
    assert received == len(whole) - kept and 0 < kept and sha256_file(partial) == pin
    partial.write_bytes(b"not the blob's start" * (ALIGN // 10))
    with pytest.raises(DigestMismatchError):
        fetch_resumable(client, "published/hello", pin, partial)
    assert partial.stat().st_size == 0  # thrown away: the next run starts over
    assert fetch_resumable(client, "published/hello", pin, partial) == len(whole)
    partial.unlink()
    partial.symlink_to(tmp_path / "elsewhere")  # planted by someone sharing the folder
    with pytest.raises(OSError):
        fetch_resumable(client, "published/hello", pin, partial)
    assert not (tmp_path / "elsewhere").exists()


def _other_squashfs(folder: Path) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        payload = b"hello from someone else\n"
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    out = folder / "planted.sqsh"
    subprocess.run(["tar2sqfs", "--quiet", "--compressor", "zstd", str(out)],
                   input=buffer.getvalue(), check=True, capture_output=True, timeout=60)
    return out


def test_a_replaced_artifact_is_refused(cluster, registry_server, published: dict,
                                        tmp_path: Path, capsys) -> None:
    """Anyone who may push attaches another squashfs to the digest and deletes the real one:
    a pinned job converts instead (one line naming both digests), and verify fails."""
    client = RegistryClient(f"http://{registry_server.address}")
    digest = published["digest"]
    [genuine] = find_published(client, "published/hello", digest, "zstd")
    planted = _other_squashfs(tmp_path)
    planted_digest = sha256_file(planted)
    publish(client, "published/hello", client.manifest("published/hello", digest), planted,
            planted_digest, "zstd", 1)
    client.delete_manifest("published/hello", genuine.artifact)
    assert [p.blob for p in find_published(client, "published/hello", digest, "zstd")] == [
        planted_digest]

    _, config = node_cache("imgpipe-tampered-")
    pins = f"{digest}={published['pin']}"
    done = _job(cluster, BOB, "node1", config, digest, pins)
    assert done.returncode == 0 and "hello from CI" in done.stdout, done.stderr
    refusal = [line for line in done.stderr.splitlines() if "refused published" in line]
    assert len(refusal) == 1 and planted_digest in refusal[0], done.stderr
    assert published["pin"] in refusal[0] and "squash with" in done.stderr
    assert sha256_file(_got(done)) == published["pin"]

    clone = CliRun(published["folder"], capsys)
    code, out, err = clone("verify", "hello")
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in err, out + err
    assert planted_digest in error and published["pin"] in error and "refused" in error


def test_registry_rm_and_gc_treat_the_squashfs_as_part_of_its_image(managed_registry
                                                                    ) -> None:
    cli = managed_registry
    port = yaml.safe_load((cli.folder / "imgpipe.yaml").read_text())["registry"]["port"]
    url = f"http://127.0.0.1:{port}"
    session, client = services.plain_session(), RegistryClient(url)
    squashfs = _other_squashfs(cli.folder)
    kept, gone = [services.push_image(session, url, "life/img", tag,
                                      [services.tar_layer({"f": tag.encode()})])
                  for tag in ("kept", "gone")]
    for digest in (kept, gone):
        publish(client, "life/img", client.manifest("life/img", digest), squashfs,
                sha256_file(squashfs), "zstd", 1)
    code, out, _ = cli("registry", "ls")
    assert "[squashfs published: gone (zstd), kept (zstd)]" in out, out
    # Deleted by another tool: its artifact has no subject any more and goes at gc.
    client.delete_manifest("life/img", gone)
    code, out, err = cli("registry", "gc")
    assert code == 0, out + err
    assert f"deleted 1 artifact(s) of life/img@{gone[:19]}, which is gone" in out
    assert client.manifest_digest("life/img", referrers_tag(gone)) is None
    [artifact] = referrers(client, "life/img", kept, ARTIFACT_TYPE)
    assert artifact["artifactType"] == ARTIFACT_TYPE
    blob = find_published(client, "life/img", kept)[0].blob
    assert requests.get(f"{url}/v2/life/img/blobs/{blob}", timeout=30).status_code == 200
    code, out, err = cli("registry", "rm", "life/img:kept")
    assert code == 0, out + err
    assert f"also removed 1 artifact(s) published beside it (its squashfs): " \
           f"{artifact['digest'][:19]}" in out
    assert client.manifest_digest("life/img", referrers_tag(kept)) is None
    assert "sha256-" not in cli("registry", "tags", "life/img")[1]
