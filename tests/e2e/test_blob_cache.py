"""The blob cache tier (issue #45): `imgpipe registry cache up` runs a real nginx in front of
a real registry; clients fetch blobs through it, digest-checked, and from the registry when it
is down or hostile.  Everything binds 127.0.0.1 and is stopped at the end."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from imgpipe.base.config import Settings
from imgpipe.base.configlayers import parse_settings
from imgpipe.commands.shared.wiring import registry_client
from tests import services
from tests.conftest import CliRun

BLOB_MIB = 40  # three 16 MiB slices, the last one partial
SLICE = 16 << 20


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.RegistryProcess]:
    """A registry of this module's own, logging every request (its access log is counted)."""
    server = services.start_registry(tmp_path_factory.mktemp("tier-registry"),
                                     extra={"log": {"level": "info"}})
    yield server
    server.stop()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """The cache's state folder, reachable by nginx's workers (nobody, when run as root):
    pytest's own folders are private to their owner."""
    folder = Path(tempfile.mkdtemp(prefix="imgpipe-blob-cache-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def configure(cli: CliRun, registry: services.RegistryProcess, state: Path,
              blob_cache: str | None = None, port: int | None = None) -> tuple[Settings, int]:
    port = port or services.free_port()
    path = cli.write_config({"registry": {
        "port": registry.port,
        "blob_cache": blob_cache or f"http://127.0.0.1:{port}",
        "cache_server": {"port": port, "state_dir": str(state), "max_size": "1G"}}})
    return parse_settings(path), port


@pytest.fixture
def tier(cli: CliRun, registry: services.RegistryProcess, state_dir: Path
         ) -> Iterator[tuple[CliRun, Settings]]:
    """`imgpipe registry cache up` on a free port, stopped (`down`) at the end."""
    settings, _ = configure(cli, registry, state_dir)
    code, out, err = cli("registry", "cache", "up")
    assert code == 0, err
    assert "blob cache started" in out
    yield cli, settings
    assert cli("registry", "cache", "down")[0] == 0


def push(registry: services.RegistryProcess, mib: int = BLOB_MIB) -> tuple[str, bytes]:
    data = os.urandom(mib << 20)
    return services.push_blob(services.plain_session(), registry.url, "tier/blob", data), data


def registry_sent(registry: services.RegistryProcess, digest: str, at_least: int = 0
                  ) -> tuple[int, int]:
    """(GET requests, body bytes) the registry's access log records for ``digest``, once it
    records ``at_least`` bytes (a server logs a request after its client has the bytes)."""
    pattern = re.compile(rf'"GET /v2/[^ ]+/blobs/{digest} HTTP/1.1" 20[06] (\d+)')

    def sent() -> list[int]:
        text = (registry.root / "registry.log").read_text()
        return [int(m[1]) for m in pattern.finditer(text)]

    services.wait_for(lambda: sum(sent()) >= at_least, 10, "the registry's access log")
    return len(sent()), sum(sent())


def logged(path: Path, digest: str, count: int, status: str = "") -> list[str]:
    """The lines of nginx's access log naming ``digest`` (answered ``status``, if given),
    once there are ``count``."""
    def lines() -> list[str]:
        return [line for line in path.read_text().splitlines() if digest in line
                and (not status or line.split('"')[2].split()[0] == status)]

    services.wait_for(lambda: len(lines()) >= count, 10, "nginx's access log")
    return lines()


def test_many_fetches_at_once_cost_the_registry_one_copy(tier, registry, tmp_path) -> None:
    cli, settings = tier
    digest, data = push(registry)
    assert cli("registry", "cache", "up")[1].startswith("blob cache already running")

    def fetch(index: int) -> str:
        dest = tmp_path / f"blob-{index}"
        registry_client(settings).fetch_blob("tier/blob", digest, dest)  # digest-checked
        return hashlib.sha256(dest.read_bytes()).hexdigest()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(fetch, range(8)))
    assert set(results) == {digest.split(":")[1]}
    requests_made, sent = registry_sent(registry, digest, len(data))
    assert sent == len(data)  # each slice once: collapsed by proxy_cache_lock, then cached
    assert requests_made == -(-len(data) // SLICE)
    assert len(logged(state_dir_of(settings) / "access.log", digest, 8)) == 8

    code, out, _ = cli("registry", "cache", "status", "--json")
    status = json.loads(out)["data"]
    assert code == 0 and status["running"] and status["answers"]
    assert status["cache_bytes"] >= len(data)


def test_ranges_through_the_cache_answer_206_with_the_right_bytes(tier, registry) -> None:
    _, settings = tier
    digest, data = push(registry)
    client = registry_client(settings)
    path = f"/v2/tier/blob/blobs/{digest}"
    ranges = ((SLICE + 5, SLICE + 104), (2 * SLICE - 10, 2 * SLICE + 9), (len(data) - 7, None))
    for first, last in ranges:
        wanted = f"bytes={first}-{'' if last is None else last}"
        reply = client.request("GET", path, ok={206}, headers={"Range": wanted})
        assert reply.url.startswith(settings.registry.blob_cache + "/")
        assert reply.content == data[first:None if last is None else last + 1]
        end = len(data) - 1 if last is None else last
        assert reply.headers["Content-Range"] == f"bytes {first}-{end}/{len(data)}"
    # A range on a miss costs the registry only the slices it covers: the 2nd and 3rd here.
    assert registry_sent(registry, digest, len(data) - SLICE) == (2, len(data) - SLICE)


def test_errors_are_not_cached_and_existence_is_the_registrys(tier, registry) -> None:
    """A blob asked for before it was pushed is served once it is: a 404 is never stored.
    HEAD (does it exist?) goes to the registry itself, never to the cache."""
    _, settings = tier
    data = os.urandom(1 << 20)
    digest = services.digest_of(data)
    client = registry_client(settings)
    path = f"/v2/tier/blob/blobs/{digest}"
    missing = client.request("GET", path, ok={200, 404})
    assert missing.status_code == 404 and missing.url.startswith(settings.registry.blob_cache)
    services.push_blob(services.plain_session(), registry.url, "tier/blob", data)
    reply = client.request("GET", path)
    assert reply.url.startswith(settings.registry.blob_cache + "/") and reply.content == data
    head = client.request("HEAD", path)
    assert head.url.startswith(registry.url + "/")


def test_a_cache_that_is_down_costs_one_line_and_the_fetch_works(
        tier, registry, tmp_path, capsys) -> None:
    cli, settings = tier
    digest, data = push(registry, 2)
    assert cli("registry", "cache", "down")[1].strip() == "blob cache stopped"
    capsys.readouterr()
    for index in range(3):
        registry_client(settings).fetch_blob("tier/blob", digest, tmp_path / f"b{index}")
        assert (tmp_path / f"b{index}").read_bytes() == data
    err = capsys.readouterr().err
    url = settings.registry.blob_cache
    assert err.splitlines() == [f"imgpipe: the blob cache at {url} does not answer (cannot "
                                "connect): fetching from the registry"]
    code, out, _ = cli("registry", "cache", "status")
    assert code == 1 and "running:    no" in out
    assert cli("registry", "cache", "down")[1].strip() == "blob cache was not running"


class Hostile:
    """A tiny server that answers every blob request with garbage (and says it is a
    registry), recording the paths it was asked for."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                seen.append(self.path)
                body = b"not the blob you asked for" * 100
                self.send_response(200)
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_hostile_cache_is_refused_by_the_digest_and_bypassed(
        cli, registry, state_dir, tmp_path, capsys) -> None:
    hostile = Hostile()
    try:
        settings, _ = configure(cli, registry, state_dir, blob_cache=hostile.url)
        session = services.plain_session()
        layer = services.tar_layer({"hello.txt": b"hello"})
        manifest = services.push_image(session, registry.url, "tier/image", "v1", [layer])
        client = registry_client(settings)
        image = client.manifest("tier/image", "v1")
        assert image.digest == manifest and hostile.seen == []  # manifests: the registry's
        capsys.readouterr()
        config = client.image_config("tier/image", image.body["config"]["digest"])
        assert config["rootfs"]["diff_ids"]
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"imgpipe: the blob cache at {hostile.url} "
                                                   "served config sha256:")
        assert err[0].endswith("with bytes that do not match it: fetching from the registry")
        asked = len(hostile.seen)
        assert asked == 1
        client.fetch_blob("tier/image", image.body["layers"][0]["digest"], tmp_path / "layer")
        assert (tmp_path / "layer").read_bytes() == layer
        assert len(hostile.seen) == asked and capsys.readouterr().err == ""  # bypassed now
    finally:
        hostile.stop()


def test_a_hostile_cache_serving_a_blob_is_bypassed_too(cli, registry, state_dir, tmp_path,
                                                         capsys) -> None:
    hostile = Hostile()
    try:
        settings, _ = configure(cli, registry, state_dir, blob_cache=hostile.url)
        digest, data = push(registry, 1)
        registry_client(settings).fetch_blob("tier/blob", digest, tmp_path / "blob")
        assert (tmp_path / "blob").read_bytes() == data and len(hostile.seen) == 1
        [line] = capsys.readouterr().err.splitlines()
        assert f"served blob {digest[:19]} with bytes that do not match it" in line
    finally:
        hostile.stop()


def test_the_cache_passes_blobs_only(tier, registry) -> None:
    _, settings = tier
    services.push_image(services.plain_session(), registry.url, "tier/image", "v2",
                        [services.tar_layer({"a": b"a"})])
    base = settings.registry.blob_cache
    session = services.plain_session()
    for path in ("/v2/", "/v2/tier/image/manifests/v2", "/v2/tier/image/tags/list",
                 "/v2/_catalog", "/token?scope=repository:tier/image:pull"):
        assert session.get(base + path, timeout=10).status_code == 404, path
    reply = session.post(base + "/v2/tier/image/blobs/uploads/", timeout=10)
    assert reply.status_code == 404


def test_bad_input_is_one_line(cli, registry, state_dir, monkeypatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        configure(cli, registry, state_dir, port=port)
        code, out, err = cli("registry", "cache", "up")
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"port {port} on 127.0.0.1 is in use by another program" in err

    configure(cli, registry, state_dir)
    monkeypatch.setenv("PATH", str(state_dir))  # no nginx on it
    code, _, err = cli("registry", "cache", "up")
    assert code == 1 and err.strip().splitlines() == [
        "error: nginx is not installed (hint: install nginx-light)"]
    monkeypatch.undo()

    if os.geteuid() == 0:  # pytest's own folders are closed to nginx's workers (nobody)
        configure(cli, registry, cli.folder / "closed")
        code, _, err = cli("registry", "cache", "up")
        assert code == 1 and len(err.strip().splitlines()) == 1
        assert "nginx's workers run as nobody and cannot reach" in err
        assert "is closed to them (hint: choose a registry.cache_server.state_dir" in err
        assert not (cli.folder / "closed").exists()  # nothing left behind

    cli.write_config({"registry": {"blob_cache": "rack1:5080"}})
    code, _, err = cli("registry", "cache", "status")
    assert code == 2 and len(err.strip().splitlines()) == 1  # a config error: as usage
    assert "imgpipe.yaml: registry.blob_cache: 'rack1:5080' is not a URL" in err


def test_a_registry_with_a_login_decides_on_every_miss(cli, state_dir, tmp_path_factory,
                                                       tmp_path, capsys) -> None:
    """threat-model: "a cached blob is served only to a client the registry would serve".
    Token auth through the cache: the client's Authorization reaches the registry on every
    read and is never stored; a 401 is not cached; no login, or another repository's name,
    reads nothing cached (401)."""
    from imgpipe.registry.auth import Credentials
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.errors import AuthError
    from imgpipe.registry.transfer import push_bytes

    root = tmp_path_factory.mktemp("tier-token-registry")
    tokens = services.start_token_server(root, "alice", "s3cret-Pa55word")
    server = services.start_registry(root, extra={
        "auth": {"token": {"realm": tokens.url, "service": tokens.service,
                           "issuer": tokens.issuer, "rootcertbundle": str(tokens.cert_file)}}})
    try:
        settings, _ = configure(cli, server, state_dir)
        assert cli("registry", "cache", "up")[0] == 0
        cache = settings.registry.blob_cache
        client = RegistryClient(server.url, Credentials("alice", "s3cret-Pa55word"),
                                allow_http=True, blob_cache=cache)
        data = os.urandom(3 << 20)
        digest = push_bytes(client, "tier/secret", data)
        url = f"{cache}/v2/tier/secret/blobs/{digest}"
        anonymous = services.plain_session().get(url, timeout=10)
        assert anonymous.status_code == 401 and "Bearer" in anonymous.headers["WWW-Authenticate"]

        client.fetch_blob("tier/secret", digest, tmp_path / "blob")
        assert (tmp_path / "blob").read_bytes() == data
        assert logged(state_dir / "access.log", digest, 1, "401")  # the anonymous one
        assert logged(state_dir / "access.log", digest, 1, "200")  # the client's
        token = (client._authorization or "").removeprefix("Bearer ")
        assert token and tokens.requests_seen[-1]["authorized"]
        for path in state_dir.rglob("*"):
            if path.is_file():
                text = path.read_bytes()
                assert token.encode() not in text and b"s3cret" not in text, path

        # Cached now, yet the registry still decides (docs/threat-model.md, "the blob
        # cache"): no login, or the digest named under another repository, reads nothing.
        for path in (url, f"{cache}/v2/tier/other/blobs/{digest}",
                     f"{cache}/v2/library/x/blobs/{digest}"):
            again = services.plain_session().get(path, timeout=10)
            assert again.status_code == 401 and "Bearer" in again.headers["WWW-Authenticate"]
            assert data[:4096] not in again.content
        client.fetch_blob("tier/secret", digest, tmp_path / "again")  # alice: from the cache
        assert (tmp_path / "again").read_bytes() == data
        assert any("cache=HIT" in line for line in logged(state_dir / "access.log", digest, 2,
                                                          "200"))

        other = os.urandom(1 << 20)
        other_digest = push_bytes(client, "tier/secret", other)
        wrong = RegistryClient(server.url, Credentials("alice", "wrong"), allow_http=True,
                               blob_cache=cache)
        capsys.readouterr()
        with pytest.raises(AuthError, match="refused the credentials"):
            wrong.fetch_blob("tier/secret", other_digest, tmp_path / "other")
        assert "blob cache" not in capsys.readouterr().err  # a login problem is no cache's
    finally:
        cli("registry", "cache", "down")
        server.stop()
        tokens.stop()


def test_the_importer_starts_a_job_through_the_cache_and_without_it(tier, registry,
                                                                    tmp_path) -> None:
    """The Pyxis importer on a node whose config names the cache: its blobs come through
    it; with the cache down the job still starts, with one line said."""
    import subprocess
    import sys

    cli, settings = tier
    layer = services.tar_layer({"srv/data.bin": os.urandom(2 << 20), "etc/hello": b"hi\n"})
    services.push_image(services.plain_session(), registry.url, "tier/job", "v1", [layer])
    importer = Path(sys.executable).parent / "imgpipe-pyxis-importer"
    uri = f"docker://127.0.0.1:{registry.port}#tier/job:v1"

    def start_job(name: str) -> subprocess.CompletedProcess[str]:
        config = tmp_path / f"{name}.yaml"
        config.write_text(json.dumps({
            "registry": {"port": registry.port, "blob_cache": settings.registry.blob_cache},
            "outputs": {"squashfs_dir": str(tmp_path / name)}}))
        env = {**os.environ, "IMGPIPE_CONFIG": str(config), "SLURM_JOB_ID": "7",
               "SLURM_STEP_ID": "0", "XDG_RUNTIME_DIR": str(tmp_path)}
        return subprocess.run([str(importer), "get", uri], capture_output=True, text=True,
                              env=env, timeout=300)

    through = start_job("node-a")
    assert through.returncode == 0, through.stderr
    assert Path(through.stdout.strip()).is_file() and "blob cache" not in through.stderr
    assert logged(state_dir_of(settings) / "access.log", services.digest_of(layer), 1)

    assert cli("registry", "cache", "down")[0] == 0
    without = start_job("node-b")
    assert without.returncode == 0, without.stderr
    assert Path(without.stdout.strip()).is_file()
    said = [line for line in without.stderr.splitlines() if "blob cache" in line]
    assert said == [f"imgpipe: the blob cache at {settings.registry.blob_cache} does not "
                    "answer (cannot connect): fetching from the registry"]


def state_dir_of(settings: Settings) -> Path:
    return settings.path(settings.registry.cache_server.state_dir)


def test_a_hostile_cache_serving_a_published_squashfs_is_bypassed(cli, registry, state_dir,
                                                                   tmp_path, capsys) -> None:
    """The importer's ranged fetch of a published squashfs: the cache's bytes fail the digest,
    the cache is bypassed in one line and the registry's bytes are what is kept."""
    import io
    import subprocess
    import tarfile

    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.published.artifact import fetch, publish

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        payload = os.urandom(3 << 20)
        info = tarfile.TarInfo("data.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    squashfs = tmp_path / "image.sqsh"
    subprocess.run(["tar2sqfs", "--quiet", "--compressor", "zstd", str(squashfs)],
                   input=buffer.getvalue(), check=True, capture_output=True, timeout=60)
    blob = "sha256:" + hashlib.sha256(squashfs.read_bytes()).hexdigest()
    session = services.plain_session()
    services.push_image(session, registry.url, "tier/sqsh", "v1",
                        [services.tar_layer({"a": b"a"})])
    hostile = Hostile()
    try:
        settings, _ = configure(cli, registry, state_dir, blob_cache=hostile.url)
        plain = registry_client(configure(cli, registry, state_dir)[0])
        published, _ = publish(plain, "tier/sqsh", plain.manifest("tier/sqsh", "v1"), squashfs,
                               blob, "zstd", 1, chunk_size=1 << 20)
        cli.write_config({"registry": {"port": registry.port, "blob_cache": hostile.url}})
        cache = Storage(tmp_path / "cache")
        cache.prepare()
        capsys.readouterr()
        final = tmp_path / "cache" / "got.sqsh"
        fetch(registry_client(settings), cache, published, final, None, connections=4)
        assert hashlib.sha256(final.read_bytes()).digest().hex() == blob[7:]
        refused = [line for line in capsys.readouterr().err.splitlines()
                   if line.startswith(f"imgpipe: the blob cache at {hostile.url}")]
        assert len(refused) == 1 and "fetching from the registry" in refused[0], refused
        assert hostile.seen  # it was asked, and then no more
    finally:
        hostile.stop()
