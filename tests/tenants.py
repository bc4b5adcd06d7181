"""The accounts, the shared cache and the moves of tests/e2e/test_tenants*.py: the threat model
(docs/threat-model.md) played with real accounts on the sandbox cluster.

Three job users (alice, bob, carol) share one squashfs cache that root set up with
`imgpipe node-config --make-cache`; bob is the hostile one.  A fourth account, the pusher,
can push to the registry and nothing else; a fifth, the cache's service account, runs the
cache writer.
"""


from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests import services
from tests.cluster import USERS, node_cache, shared_folder, system_imgpipe

ALICE, BOB = USERS
CAROL, PUSHER = "imgpipe-carol", "imgpipe-pusher"
REPO = "tenants/img"


def ensure_user(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True,
                       capture_output=True)
        return pwd.getpwnam(name).pw_uid


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def image(registry_server, tag: str) -> str:
    """A small image of its own (fresh layer and config blobs): its manifest digest."""
    session = services.plain_session()
    stamp = f"{tag} {time.monotonic_ns()}\n".encode()
    layer = services.tar_layer({"etc/os-release": b"ID=tenants\n", "srv/stamp": stamp,
                                "usr/bin/tool": b"#!/bin/sh\necho genuine\n"})
    return services.push_image(session, registry_server.url, REPO, tag, [layer])


@pytest.fixture(scope="module")
def site(cluster, registry_server):
    """The shared cache (made by root), the nodes' config, the importer, and the accounts."""
    carol, pusher = ensure_user(CAROL), ensure_user(PUSHER)
    squashfs, config = node_cache("imgpipe-tenants-")
    bin_dir = system_imgpipe(Path(__file__).resolve().parents[1])
    return {"cache": squashfs, "config": config, "bin": bin_dir, "cluster": cluster,
            "uid": {ALICE: pwd.getpwnam(ALICE).pw_uid, BOB: pwd.getpwnam(BOB).pw_uid,
                    CAROL: carol, PUSHER: pusher}}


def get(site, user: str, uri: str, node: int = 0, env: dict | None = None,
         config: Path | None = None) -> subprocess.CompletedProcess[str]:
    cluster = site["cluster"]
    return cluster.run([str(site["bin"] / "imgpipe-pyxis-importer"), "get", uri], user=user,
                       env={"IMGPIPE_CONFIG": str(config or site["config"]), **(env or {})},
                       host=cluster.spec.nodes[node], timeout=300, cwd="/tmp")


def as_user(site, user: str, script: str, node: int = 0) -> subprocess.CompletedProcess[str]:
    """A shell command as ``user`` on a compute host: how the attacker works."""
    cluster = site["cluster"]
    return cluster.run(["/bin/sh", "-c", script], user=user, host=cluster.spec.nodes[node],
                       timeout=120, cwd="/tmp")


def genuine(site, registry_server, tag: str) -> tuple[str, Path]:
    """A fresh image, converted by alice: (its digest, alice's genuine squashfs)."""
    digest = image(registry_server, tag)
    done = get(site, ALICE, f"docker://head:5000#{REPO}@{digest}")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.stat().st_uid == site["uid"][ALICE]
    return digest, path


def publish_as_pusher(site, registry_server, digest: str, tree: dict[str, tuple[int, int]],
                      tmp_path: Path, xattr: bool = False, squashfs: Path | None = None) -> str:
    """The pusher attaches a squashfs of its own making to ``digest``: files of ``tree``
    ({path: (mode, uid)}), built here as root would, or ``squashfs`` as it is; returns the
    artifact's blob digest."""
    if squashfs is None:
        squashfs = _pushers_squashfs(tree, tmp_path, xattr)
    script = (
        "import hashlib, sys\nfrom pathlib import Path\n"
        "from imgpipe.registry.client import RegistryClient\n"
        "from imgpipe.enroot.published.artifact import publish\n"
        f"client = RegistryClient({registry_server.url!r})\n"
        f"path = Path({str(squashfs)!r})\n"
        "blob = 'sha256:' + hashlib.sha256(path.read_bytes()).hexdigest()\n"
        f"subject = client.manifest({REPO!r}, {digest!r})\n"
        f"publish(client, {REPO!r}, subject, path, blob, 'zstd', 3)\nprint(blob)\n")
    done = subprocess.run(["runuser", "-u", PUSHER, "--", str(site["bin"] / "python"), "-c",
                           script], capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _pushers_squashfs(tree: dict[str, tuple[int, int]], tmp_path: Path, xattr: bool) -> Path:
    root = tmp_path / f"tree-{time.monotonic_ns()}"
    for name, (mode, uid) in tree.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\necho pwned\n")
        os.chown(path, uid, 0)
        os.chmod(path, mode)
        if xattr:
            os.setxattr(path, "user.imgpipe-test", b"1")
    squashfs = shared_folder("imgpipe-evil-") / "evil.sqsh"  # where the pusher can read it
    subprocess.run(["mksquashfs", str(root), str(squashfs), "-noappend", "-quiet", "-comp",
                    "zstd"], check=True, capture_output=True)
    os.chmod(squashfs, 0o644)
    return squashfs


def own_config(site, user: str, **enroot) -> Path:
    """A user's own imgpipe.yaml: the site's cache and registry, with the user's opt-ins."""
    config = Path(f"/home/{user}/imgpipe.yaml")
    config.write_text(json.dumps({"registry": {"host": "head", "port": 5000},
                                  "outputs": {"squashfs_dir": str(site["cache"])},
                                  "enroot": enroot}))
    os.chown(config, site["uid"][user], -1)
    return config


SERVICE = "imgpipe-cache"


@pytest.fixture(scope="module")
def shared_writer(site):
    """The site's trusted writer: the service account owns the cache's layout, and every job
    user may run exactly the writer as it, through a sudoers line the test removes after."""
    from imgpipe.enroot.cache.layout import make_layout
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.cache.trust import CacheTrust

    service = ensure_user(SERVICE)
    folder = shared_folder("imgpipe-writer-")
    cache = folder / "squashfs"
    make_layout(Storage(cache, CacheTrust.of(SERVICE)))
    writer = site["bin"] / "imgpipe-cache-writer"
    config = folder / "imgpipe.yaml"
    config.write_text(json.dumps({
        "registry": {"host": "head", "port": 5000}, "outputs": {"squashfs_dir": str(cache)},
        "enroot": {"cache_owner": SERVICE, "cache_writer": f"{writer} --config {config}"}}))
    os.chmod(config, 0o644)
    sudoers = Path(f"/etc/sudoers.d/imgpipe-tests-{os.getpid()}")
    line = f"ALL ALL=({SERVICE}) NOPASSWD: {writer} --config {config} *\n"
    staged = folder / "sudoers"
    staged.write_text(line)
    subprocess.run(["visudo", "-cqf", str(staged)], check=True, capture_output=True)
    os.chmod(staged, 0o440)
    shutil.move(staged, sudoers)
    try:
        yield {"cache": cache, "config": config, "writer": writer, "uid": service}
    finally:
        sudoers.unlink()


