"""The threat model's second round, played with real accounts: root's own commands on a path a
user prepared, names that fool a text listing, a pusher that would fail every fresh pinned job,
pruning and the writer beside other users, unreadable blobs, a hostile front answering 100 MB,
terminal escapes in file names, hard links and folders at shared names.

Each attack ends with the victim getting the genuine bytes or one refusal line, and nothing of
root's or the victim's changed.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from tests.cluster import shared_folder
from tests.tenants import (
    ALICE,
    BOB,
    CAROL,
    PUSHER,
    REPO,
    SERVICE,
    as_user,
    ensure_user,
    genuine,
    get,
    image,
    own_config,
    publish_as_pusher,
    sha256,
)


def _root(site, *argv: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    """An imgpipe command as root, as an admin types it."""
    return subprocess.run([str(site["bin"] / "imgpipe"), *argv], capture_output=True,
                          text=True, timeout=300, cwd="/tmp",
                          env={**os.environ, "IMGPIPE_CONFIG": str(config or site["config"])})


def _snapshot(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Owner, mode and bytes of everything under ``folder`` (itself included)."""
    found = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        info = path.lstat()
        found[str(path.relative_to(folder))] = (
            info.st_uid, info.st_mode, path.read_text() if path.is_file() else "")
    return found


def test_make_cache_never_acts_on_a_path_a_user_prepared(site) -> None:
    """A scratch folder every job user may write (1777, root's, as /tmp is): bob plants the
    cache path as a link to a root-owned stand-in for /etc, as a folder of his own, and puts
    the cache below a folder of his.  Root's make-cache refuses each in one line and the
    stand-in keeps its owner, mode and files; an empty path is made as the threat model says."""
    scratch = shared_folder("imgpipe-scratch-")
    os.chmod(scratch, 0o1777)
    etc = shared_folder("imgpipe-etc-")  # root's, 0755, with a file: what /etc is
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    before = _snapshot(etc)
    done = as_user(site, BOB, f"ln -s {etc} {scratch}/cache && mkdir {scratch}/bobs && "
                   f"mkdir -m 777 {scratch}/bobs/below")
    assert done.returncode == 0, done.stderr
    for path, refusal in ((scratch / "cache", f"{scratch}/cache is a symbolic link"),
                          (scratch / "cache" / "sub", f"{scratch}/cache is a symbolic link"),
                          (scratch / "bobs", f"{scratch}/bobs was made by uid "
                           f"{site['uid'][BOB]} ({BOB}), a job user"),
                          (scratch / "bobs" / "below" / "cache",
                           f"{scratch}/bobs belongs to uid {site['uid'][BOB]} ({BOB})"),
                          (etc, "already holds other files (passwd): it is not an imgpipe "
                           "cache")):
        done = _root(site, "node-config", "--make-cache", str(path))
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert refusal in line, line
        assert _snapshot(etc) == before
    fresh = scratch / "fresh"
    done = _root(site, "node-config", "--make-cache", str(fresh))
    assert done.returncode == 0, done.stderr
    assert fresh.stat().st_uid == 0 and fresh.stat().st_mode & 0o7777 == 0o1777
    assert _root(site, "node-config", "--make-cache", str(fresh)).returncode == 0  # idempotent
    # root's prune and doctor through the planted link: refused, nothing of root's touched
    (etc / "x+sha256-" f"{'1' * 64}+zstd-f2.sqsh").write_text("root's\n")
    before = _snapshot(etc)
    config = site["config"].parent / "root-through-link.yaml"
    config.write_text(json.dumps({"outputs": {"squashfs_dir": str(scratch / "cache")}}))
    done = _root(site, "cache", "prune", "--max-size", "0", config=config)
    assert done.returncode == 1 and f"{scratch}/cache is a symbolic link" in done.stderr
    done = _root(site, "doctor", config=config)
    assert f"{scratch}/cache is a symbolic link" in done.stdout + done.stderr
    assert _snapshot(etc) == before
    shutil.rmtree(scratch)
    shutil.rmtree(etc)


@pytest.mark.parametrize("name", ['usr/bin/k \\" 0644 x', "usr/bin/new\nline"])
def test_a_name_cannot_pass_a_set_uid_file_as_another_mode(site, registry_server, tmp_path,
                                                          name: str) -> None:
    """The pusher's squashfs holds a set-uid root file whose name reads, in rdsquashfs's
    text listing, as mode 0644 (or breaks the listing's line): bob, who opted in to unpinned
    files, is refused it in one line and converts the genuine layers."""
    digest = image(registry_server, f"forged-name-{len(name)}")
    blob = publish_as_pusher(site, registry_server, digest, {name: (0o4755, 0)}, tmp_path)
    config = own_config(site, BOB, published_unpinned=True)
    done = get(site, BOB, f"docker://head:5000#{REPO}@{digest}", config=config)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    escaped = name.replace("\\", "\\\\").replace("\n", "\\n")
    assert (f"refused published squashfs {blob[:19]}: the published squashfs has a set-id "
            f"file /{escaped} (mode 4755) that the image's layers do not have") in done.stderr, \
        done.stderr
    got = Path(done.stdout.strip())
    assert sha256(got) != blob and "squash with" in done.stderr


def _forge_artifact(site, registry_server, digest: str, blob: str, size: int) -> None:
    """The pusher lists a second artifact under ``digest`` naming the genuine ``blob`` with
    another size (the newest listed, so the one a naive reader picks)."""
    script = (
        "import json\n"
        "from imgpipe.registry.client import RegistryClient\n"
        "from imgpipe.registry.referrers import attach\n"
        "from imgpipe.registry.transfer import push_bytes, put_manifest\n"
        "from imgpipe.enroot.published import artifact as a\n"
        f"client = RegistryClient({registry_server.url!r})\n"
        f"subject = client.manifest({REPO!r}, {digest!r})\n"
        f"empty = push_bytes(client, {REPO!r}, a.EMPTY_JSON)\n"
        "notes = {a.COMPRESSION: 'zstd', a.FORMAT_KEY: a.FORMAT, a.ENTRIES: '3'}\n"
        "body = {'schemaVersion': 2, 'mediaType': 'application/vnd.oci.image.manifest.v1+json',"
        " 'artifactType': a.ARTIFACT_TYPE, 'config': {'mediaType': a.EMPTY_MEDIA_TYPE, "
        "'digest': empty, 'size': 2}, 'layers': [{'mediaType': a.SQUASHFS_MEDIA_TYPE, "
        f"'digest': {blob!r}, 'size': {size}}}], 'subject': {{'mediaType': subject.media_type, "
        "'digest': subject.digest, 'size': len(subject.raw)}, 'annotations': notes}\n"
        "raw = json.dumps(body).encode()\n"
        f"made = put_manifest(client, {REPO!r}, 'forged-{size}', raw, "
        "'application/vnd.oci.image.manifest.v1+json')\n"
        f"attach(client, {REPO!r}, subject.digest, {{'mediaType': "
        "'application/vnd.oci.image.manifest.v1+json', 'digest': made, 'size': len(raw), "
        "'artifactType': a.ARTIFACT_TYPE, 'annotations': notes})\n")
    done = subprocess.run(["runuser", "-u", PUSHER, "--", str(site["bin"] / "python"), "-c",
                           script], capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert done.returncode == 0, done.stderr


def test_a_second_artifact_of_the_pinned_blob_does_not_fail_a_fresh_job(
        site, registry_server, tmp_path) -> None:
    """The genuine squashfs is published and pinned; the pusher lists another artifact of
    the same blob with size 1 after it.  A user with no copy yet fetches the pinned bytes."""
    digest, path = genuine(site, registry_server, "pinned-twice")
    publisher = shared_folder("imgpipe-publish-") / "genuine.sqsh"
    shutil.copy(path, publisher)
    os.chmod(publisher, 0o644)
    blob = publish_as_pusher(site, registry_server, digest, {}, tmp_path, squashfs=publisher)
    _forge_artifact(site, registry_server, digest, blob, 1)
    done = get(site, CAROL, f"docker://head:5000#{REPO}@{digest}",
               env={"IMGPIPE_SQUASHFS_PINS": f"{digest}={blob}"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    got = Path(done.stdout.strip())
    assert sha256(got) == blob and f"fetched published squashfs {blob}" in done.stderr
    assert got.stat().st_uid == site["uid"][CAROL]


def test_a_small_cache_limit_on_a_shared_cache_never_fails_a_get(site, registry_server
                                                                 ) -> None:
    """alice converts; carol, whose config keeps the cache under 1 KiB, converts another
    image: her get succeeds, alice's files stay, one line says what carol could not prune."""
    _, alices = genuine(site, registry_server, "limit-first")
    config = own_config(site, CAROL, cache_max_size="1K")
    digest = image(registry_server, "limit-second")
    done = get(site, CAROL, f"docker://head:5000#{REPO}@{digest}", config=config)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert Path(done.stdout.strip()).is_file()  # not pruned: the entry it just made
    assert alices.is_file()
    assert "that other users own" in done.stderr and f"({ALICE})" in done.stderr
    [line] = [x for x in done.stderr.splitlines() if "other users own" in x]
    assert "prune them as their owner or as root" in line


def test_an_unreadable_blob_is_bypassed_naming_its_owner(site, registry_server) -> None:
    """bob writes a 0600 file of his at a fresh image's layer name: carol's conversion uses a
    copy of her own and says whose file it is; root's doctor lists it."""
    digest = image(registry_server, "unreadable")
    manifest = requests.get(f"{registry_server.url}/v2/{REPO}/manifests/{digest}", timeout=30,
                            headers={"Accept": "application/vnd.docker.distribution.manifest"
                                     ".v2+json"}).json()
    layer = site["cache"] / ".imgpipe" / "blobs" / "sha256" / \
        manifest["layers"][0]["digest"].split(":")[1]
    assert as_user(site, BOB, f"umask 077 && echo mine > {layer}").returncode == 0
    done = get(site, CAROL, f"docker://head:5000#{REPO}@{digest}")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (f"belongs to uid {site['uid'][BOB]} ({BOB}) and this user cannot read it "
            "(mode 0600)") in done.stderr, done.stderr
    doctor = _root(site, "doctor")
    assert f"{layer}: other users cannot read it (mode 0600" in doctor.stdout + doctor.stderr
    layer.unlink()


class _HostileFront(BaseHTTPRequestHandler):
    """In front of the registry: every request passed through, except the referrers API,
    answered with 100 MB of JSON."""

    upstream = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if "/referrers/" in self.path:
            chunk = b'{"mediaType": "x", "digest": "sha256:' + b"0" * 64 + b'", "size": 1},'
            count = (100 << 20) // len(chunk)
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.oci.image.index.v1+json")
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            body_start, body_end = b'{"schemaVersion": 2, "manifests": [', b"{}]}"
            self.send_header("Content-Length", str(len(body_start) + count * len(chunk)
                                                   + len(body_end)))
            self.end_headers()
            try:
                self.wfile.write(body_start)
                for _ in range(count // 1024):
                    self.wfile.write(chunk * 1024)
                self.wfile.write(chunk * (count % 1024) + body_end)
            except OSError:
                pass  # the reader stopped at its cap: as it should
            return
        self._pass()

    def do_HEAD(self) -> None:  # noqa: N802
        self._pass()

    def _pass(self) -> None:
        answer = requests.request(self.command, self.upstream + self.path, timeout=60,
                                  headers={k: v for k, v in self.headers.items()
                                           if k.lower() in ("accept", "range")}, stream=True)
        self.send_response(answer.status_code)
        for key, value in answer.headers.items():
            if key.lower() not in ("transfer-encoding", "connection"):
                self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            for part in answer.raw.stream(1 << 20, decode_content=False):
                self.wfile.write(part)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _front(upstream: str) -> Iterator[int]:
    handler = type("Front", (_HostileFront,), {"upstream": upstream})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_100_mb_referrers_answer_is_skipped_in_one_line(site, registry_server,
                                                          tmp_path) -> None:
    digest = image(registry_server, "hostile-front")
    with _front(registry_server.url) as port:
        config = tmp_path / "imgpipe.yaml"
        config.write_text(json.dumps({"registry": {"host": "127.0.0.1", "port": port},
                                      "outputs": {"squashfs_dir": str(tmp_path / "sqsh")}}))
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        done = subprocess.run(["/usr/bin/time", "-f", "peak %M", str(site["bin"] / "imgpipe"),
                               "--config", str(config), "convert",
                               f"127.0.0.1:{port}/{REPO}@{digest}"],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [skipped] = [line for line in done.stderr.splitlines() if "skipped" in line]
    assert "the answer is over 4194304 bytes" in skipped, skipped
    peak_kib = int(done.stderr.strip().splitlines()[-1].split()[-1])
    assert peak_kib < 200 * 1024, f"{peak_kib} KiB: the answer was read whole ({before})"


def test_names_another_user_chose_reach_roots_terminal_escaped(site) -> None:
    """bob names a file in the shared cache with terminal escapes: root's doctor, cache ls
    and cache prune show them escaped."""
    cache: Path = site["cache"]
    done = as_user(site, BOB, f"name=$(printf 'evil\\033]0;pwned\\007+sha256-{'2' * 64}"
                   f"+zstd-f2.sqsh') && echo x > \"{cache}/$name\"")
    assert done.returncode == 0, done.stderr
    for argv in (["doctor"], ["cache", "ls"], ["cache", "prune", "--max-size", "0",
                                               "--dry-run"]):
        done = _root(site, *argv)
        shown = done.stdout + done.stderr
        assert "\x1b" not in shown and "\x07" not in shown, argv
        assert "evil\\x1b]0;pwned\\x07+sha256-" in shown, (argv, shown)
    next(cache.glob("evil*")).unlink()


@contextmanager
def _hardlinks_unprotected() -> Iterator[None]:
    """fs.protected_hardlinks=0, the kernel's own default, for the length of a test."""
    setting = Path("/proc/sys/fs/protected_hardlinks")
    before = setting.read_text().strip()
    setting.write_text("0")
    try:
        yield
    finally:
        setting.write_text(before)


def test_a_hard_link_at_a_shared_name_is_never_served(site, shared_writer, registry_server
                                                      ) -> None:
    """With fs.protected_hardlinks=0 bob links the writer's entry of image Y at image X's
    shared name: carol's job of X gets X's own bytes, and root's doctor names the setting."""
    config = shared_writer["config"]
    digest_y = image(registry_server, "link-y")
    done = get(site, ALICE, f"docker://head:5000#{REPO}@{digest_y}", config=config)
    assert done.returncode == 0, done.stderr
    entry_y = Path(done.stdout.strip())
    digest_x = image(registry_server, "link-x")
    name_x = entry_y.parent / f"tenants+img+sha256-{digest_x[7:]}+zstd-f2.sqsh"
    with _hardlinks_unprotected():
        assert as_user(site, BOB, f"ln {entry_y} {name_x}").returncode == 0
        doctor = _root(site, "doctor", config=config)
        assert "fs.protected_hardlinks is not 1" in doctor.stdout + doctor.stderr
    done = get(site, CAROL, f"docker://head:5000#{REPO}@{digest_x}", config=config)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"ignored {name_x.name}: it has 2 hard links" in done.stderr, done.stderr
    got = Path(done.stdout.strip())
    assert sha256(got) != sha256(entry_y)
    mine = get(site, ALICE, f"docker://head:5000#{REPO}@{digest_x}")  # alice's own: genuine
    assert sha256(Path(mine.stdout.strip())) == sha256(got)


def test_the_writer_turns_a_planted_folder_and_a_tight_umask_into_safe_results(
        site, shared_writer, registry_server) -> None:
    """bob makes a folder at the shared name of a fresh image: the writer fails in one line
    and alice converts for herself.  alice's umask 077 never reaches the shared entries: the
    writer's files are readable by every user."""
    config = shared_writer["config"]
    digest = image(registry_server, "writer-folder")
    shared = shared_writer["cache"] / f"tenants+img+sha256-{digest[7:]}+zstd-f2.sqsh"
    assert as_user(site, BOB, f"mkdir {shared}").returncode == 0
    done = get(site, ALICE, f"docker://head:5000#{REPO}@{digest}", config=config)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "the cache writer did not convert it" in done.stderr, done.stderr
    assert Path(done.stdout.strip()).stat().st_uid == site["uid"][ALICE]
    shared.rmdir()
    digest = image(registry_server, "writer-umask")
    cluster = site["cluster"]
    done = cluster.run(["/bin/sh", "-c", f"umask 077 && {site['bin']}/imgpipe-pyxis-importer "
                        f"get docker://head:5000#{REPO}@{digest}"], user=ALICE,
                       env={"IMGPIPE_CONFIG": str(config)}, host=cluster.spec.nodes[0],
                       timeout=300, cwd="/tmp")
    assert done.returncode == 0, done.stderr
    entry = Path(done.stdout.strip())
    assert entry.stat().st_uid == shared_writer["uid"] and entry.stat().st_mode & 0o777 == 0o644
    blobs = shared_writer["cache"] / ".imgpipe" / "blobs" / "sha256"
    assert all(path.stat().st_mode & 0o044 == 0o044 for path in blobs.iterdir())
    assert SERVICE in done.stderr  # "asking imgpipe-cache to convert"
    # enroot.cache_max_size: the writer prunes the shared entries nobody uses any more
    original = config.read_text()
    settings = json.loads(original)
    settings["enroot"]["cache_max_size"] = "1"
    config.write_text(json.dumps(settings))
    try:
        done = cluster.run([str(site["bin"] / "imgpipe-pyxis-importer"), "release"],
                           user=ALICE, env={"IMGPIPE_CONFIG": str(config)},
                           host=cluster.spec.nodes[0], timeout=120, cwd="/tmp")
        assert done.returncode == 0, done.stderr
        done = get(site, BOB, f"docker://head:5000#{REPO}@{image(registry_server, 'pruned')}",
                   config=config)
        assert done.returncode == 0, done.stderr
        assert Path(done.stdout.strip()).is_file() and not entry.exists()
    finally:
        config.write_text(original)


def test_a_cache_root_cannot_write_is_made_and_kept_by_the_service_account(
        site, registry_server) -> None:
    """Lustre or NFS with root squash: root cannot write in the squashfs folder, the cache's
    service account can.  The file system's admin gives the service account the folder; it
    makes the layout itself (no root on the way), job users convert into it as ever, and it
    prunes it: nothing needs root's rights there."""
    service = ensure_user(SERVICE)
    top = shared_folder("imgpipe-rootsquash-")
    (top / "lustre").mkdir()
    os.chown(top / "lustre", service, -1)  # what the file system's admin does, once
    cache = top / "lustre" / "squashfs"
    config = top / "imgpipe.yaml"
    config.write_text(json.dumps({"registry": {"host": "head", "port": 5000},
                                  "outputs": {"squashfs_dir": str(cache)},
                                  "enroot": {"cache_owner": SERVICE}}))
    config.chmod(0o644)
    imgpipe = str(site["bin"] / "imgpipe")

    def as_service(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", SERVICE, "--", imgpipe, "--config",
                               str(config), *args], capture_output=True, text=True,
                              timeout=120, cwd="/tmp")

    made = as_service("node-config", "--make-cache")
    assert made.returncode == 0, made.stderr
    assert {p.stat().st_uid for p in (cache, cache / ".imgpipe", cache / ".imgpipe/VERSION")
            } == {service}
    digest = image(registry_server, "rootsquash")
    done = get(site, ALICE, f"docker://head:5000#{REPO}@{digest}", config=config)
    assert done.returncode == 0, done.stderr
    entry = Path(done.stdout.strip())
    assert entry.parent == cache and entry.stat().st_uid == site["uid"][ALICE]
    assert as_service("node-config", "--make-cache").returncode == 0  # idempotent
    released = site["cluster"].run([str(site["bin"] / "imgpipe-pyxis-importer"), "release"],
                                   user=ALICE, env={"IMGPIPE_CONFIG": str(config)},
                                   host=site["cluster"].spec.nodes[0], cwd="/tmp")
    assert released.returncode == 0, released.stderr  # the step is over: no use is left
    pruned = as_service("cache", "prune", "--max-size", "0")
    assert pruned.returncode == 0, pruned.stderr
    assert not entry.exists()  # the layout's owner may prune every user's entries
