"""Real services for the tests: the Docker engine, registries, a token endpoint.

Each starts on 127.0.0.1 (or a Unix socket), is polled until a deadline
rather than slept for, and is stopped by whoever started it.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
import yaml

DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
BASE_IMAGE = "imgpipe/debian-python:bookworm"  # what `imgpipe base-image` makes
DEBIAN_MIRROR = os.environ.get("IMGPIPE_TEST_MIRROR", "http://deb.debian.org/debian")


PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    PORTS_HANDED_OUT.add(port)
    return port


def untag_images_of(ports: set[int]) -> int:
    """Remove the engine's tags for registries the tests started (``127.0.0.1:PORT/...``):
    those registries are gone when the run ends, and their images would fill the disk run
    after run.  An image another tag still names stays.  Returns how many tags went."""
    listed = subprocess.run(["docker", "images", "--format",
                             "{{.Repository}}\t{{.Tag}}\t{{.ID}}"],
                            capture_output=True, text=True, check=False)
    prefixes = tuple(f"127.0.0.1:{port}/" for port in ports)
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    ours = [row for row in rows if len(row) == 3 and row[0].startswith(prefixes)]
    names = [f"{repository}:{tag}" for repository, tag, _ in ours if tag != "<none>"]
    untagged = sorted({image for _, tag, image in ours if tag == "<none>"})
    for chunk in (names[i:i + 50] for i in range(0, len(names), 50)):
        subprocess.run(["docker", "image", "rm", *chunk], capture_output=True, check=False)
    if untagged:
        subprocess.run(["docker", "image", "rm", *untagged], capture_output=True, check=False)
    return len(names)


def wait_for(predicate, deadline_s: float, what: str, interval: float = 0.1) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready within {deadline_s:.0f} s")


def engine_answers() -> bool:
    try:
        return subprocess.run([DOCKER, "version"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def docker_engine() -> Iterator[None]:
    """Use the engine that answers, or start dockerd for the session and stop it after."""
    if engine_answers():
        yield
        return
    log = open(tempfile.mktemp(prefix="imgpipe-dockerd-", suffix=".log"), "wb")
    proc = subprocess.Popen(
        ["dockerd", "--bridge=none", "--iptables=false", "--host=unix:///var/run/docker.sock"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_for(lambda: proc.poll() is None and engine_answers(), 60, "dockerd")
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def image_present(tag: str) -> bool:
    return subprocess.run([DOCKER, "image", "inspect", tag], capture_output=True).returncode == 0


def ensure_base_image() -> str:
    """A Debian bookworm image with Python, made by debootstrap once per machine."""
    from imgpipe.pipeline.baseimage import ensure_base_image as make

    return make(BASE_IMAGE, mirror=DEBIAN_MIRROR)[0]


@dataclass
class RegistryProcess:
    """A docker-registry process on 127.0.0.1 with its data and config in ``root``."""

    root: Path
    port: int
    proc: subprocess.Popen
    scheme: str = "http"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    @property
    def data(self) -> Path:
        return self.root / "data"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_registry(root: Path, extra: dict | None = None, scheme: str = "http",
                   ca: str | None = None) -> RegistryProcess:
    """Start Debian's docker-registry with deletion on; ``extra`` merges into its config."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(root / "data")},
                    "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    for key, value in (extra or {}).items():
        config[key] = value
    config["http"]["addr"] = f"127.0.0.1:{port}"
    (root / "config.yml").write_text(yaml.safe_dump(config))
    log = open(root / "registry.log", "wb")
    proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = RegistryProcess(root, port, proc, scheme)

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError((root / "registry.log").read_text())
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, 20, "docker-registry")
    return server


# -- pushing through the API (fast: no engine involved) ----------------------------------------


def tar_layer(files: dict[str, bytes]) -> bytes:
    """An uncompressed layer tarball holding ``files``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def push_blob(session: requests.Session, url: str, repo: str, data: bytes) -> str:
    digest = digest_of(data)
    start = session.post(f"{url}/v2/{repo}/blobs/uploads/", timeout=30)
    assert start.status_code == 202, start.text
    location = start.headers["Location"]
    if location.startswith("/"):
        location = url + location
    sep = "&" if "?" in location else "?"
    done = session.put(f"{location}{sep}digest={digest}", data=data, timeout=60,
                       headers={"Content-Type": "application/octet-stream"})
    assert done.status_code == 201, done.text
    return digest


def diff_id_of(layer: bytes) -> str:
    """The digest of a layer's uncompressed tar (what an image config lists)."""
    import gzip
    import zlib

    if layer[:2] == b"\x1f\x8b":
        try:
            return digest_of(gzip.decompress(layer))
        except (OSError, EOFError, zlib.error):
            return digest_of(layer)  # a broken layer: refused before its diff_id matters
    return digest_of(layer)


def push_image(session: requests.Session, url: str, repo: str, tag: str,
               layers: list[bytes], env: list[str] | None = None,
               diff_ids: list[str] | None = None, media_type: str | None = None) -> str:
    """Push a runnable-shaped image manifest (v2 schema 2); returns the manifest digest.
    ``diff_ids`` and ``media_type`` override what a correct image would say."""
    layer_descs = []
    computed = []
    for layer in layers:
        kind = media_type or ("application/vnd.docker.image.rootfs.diff.tar.gzip"
                              if layer[:2] == b"\x1f\x8b"
                              else "application/vnd.docker.image.rootfs.diff.tar")
        layer_descs.append({"mediaType": kind, "size": len(layer),
                            "digest": push_blob(session, url, repo, layer)})
        computed.append(diff_id_of(layer))
    diff_ids = diff_ids if diff_ids is not None else computed
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "created": dt.datetime(2026, 1, 1, tzinfo=dt.UTC).isoformat(),
        "config": {"Env": env or ["PATH=/usr/bin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "size": len(config), "digest": push_blob(session, url, repo, config)},
        "layers": layer_descs,
    }).encode()
    reply = session.put(f"{url}/v2/{repo}/manifests/{tag}", data=manifest, timeout=30,
                        headers={"Content-Type":
                                 "application/vnd.docker.distribution.manifest.v2+json"})
    assert reply.status_code == 201, reply.text
    return digest_of(manifest)


def plain_session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False
    return session


# -- a token endpoint for Bearer auth ----------------------------------------------------------


@dataclass
class TokenServer:
    """Docker token auth (distribution's spec) signing RS256 JWTs with an x5c header."""

    url: str
    cert_file: Path
    service: str
    issuer: str
    server: ThreadingHTTPServer
    requests_seen: list[dict]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_token_server(root: Path, username: str, password: str) -> TokenServer:
    import jwt
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "imgpipe test token signer")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file = root / "token-signer.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    x5c = [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()]
    service, issuer = "imgpipe-test-registry", "imgpipe-test-issuer"
    seen: list[dict] = []
    expected = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            from urllib.parse import parse_qs, urlparse

            query = parse_qs(urlparse(self.path).query)
            seen.append({"path": self.path, "authorized": "Authorization" in self.headers})
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.end_headers()
                return
            access = []
            for scope in query.get("scope", []):
                kind, _, rest = scope.partition(":")
                repo, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": repo, "actions": actions.split(",")})
            now_s = int(time.time())
            token = jwt.encode(
                {"iss": issuer, "sub": username, "aud": query.get("service", [""])[0],
                 "exp": now_s + 300, "nbf": now_s - 10, "iat": now_s,
                 "jti": os.urandom(8).hex(), "access": access},
                key, algorithm="RS256", headers={"x5c": x5c},
            )
            body = json.dumps({"token": token, "expires_in": 300}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/token"
    return TokenServer(url, cert_file, service, issuer, server, seen)


def htpasswd_file(path: Path, username: str, password: str) -> Path:
    """A bcrypt htpasswd file (the only hash registry:2 accepts), via apache2-utils."""
    line = subprocess.run(["htpasswd", "-Bin", username], input=password, capture_output=True,
                          text=True, check=True).stdout.strip()
    path.write_text(line + "\n")
    return path


REGISTRY_IMAGE = "imgpipe-test/registry:2"


def ensure_registry_image(base: str) -> str:
    """A registry:2-shaped image (entrypoint ``registry``, default ``serve`` config) built
    from the base image and Debian's docker-registry binary, since no public image can
    be pulled here."""
    if image_present(REGISTRY_IMAGE):
        return REGISTRY_IMAGE
    name = f"imgpipe-registry-build-{os.getpid()}"
    subprocess.run([DOCKER, "create", "--name", name, base], check=True, capture_output=True)
    try:
        subprocess.run([DOCKER, "cp", shutil.which("docker-registry"), f"{name}:/bin/registry"],
                       check=True, capture_output=True)
        subprocess.run([DOCKER, "commit",
                        "--change", 'ENTRYPOINT ["registry"]',
                        "--change", 'CMD ["serve", "/etc/docker/registry/config.yml"]',
                        "--change", "EXPOSE 5000", name, REGISTRY_IMAGE],
                       check=True, capture_output=True)
    finally:
        subprocess.run([DOCKER, "rm", "-f", name], capture_output=True)
    return REGISTRY_IMAGE


def torch_wheels_dir() -> Path:
    """The folder holding the CPU torch wheel this machine keeps (pip's find-links)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, timeout=60).stdout
    candidates = [Path("/opt/wheels")]
    for line in out.splitlines():
        if "find-links" in line:
            candidates += [Path(p) for p in line.split("=", 1)[1].strip("'\" ").split()]
    for folder in candidates:
        if list(folder.glob("torch-*cpu*.whl")):
            return folder
    looked = ", ".join(map(str, candidates))
    raise RuntimeError(f"no CPU torch wheel on this machine (looked in {looked}); "
                       "the cpu flavor cannot be built offline")


def image_layer_files(image: str) -> Iterator[tuple[str, bytes]]:
    """(path, content) of every regular file in every layer of ``image``, via docker save."""
    with tempfile.TemporaryDirectory(prefix="imgpipe-save-") as work:
        archive = Path(work) / "image.tar"
        subprocess.run([DOCKER, "save", "-o", str(archive), image], check=True, timeout=600)
        with tarfile.open(archive) as outer:
            for member in outer:
                if not member.isfile():
                    continue
                handle = outer.extractfile(member)
                assert handle is not None
                if member.name.endswith("layer.tar") or member.name.startswith("blobs/"):
                    try:
                        with tarfile.open(fileobj=handle) as layer:
                            for entry in layer:
                                if entry.isfile():
                                    data = layer.extractfile(entry)
                                    assert data is not None
                                    yield f"{member.name}:{entry.name}", data.read()
                        continue
                    except tarfile.ReadError:
                        handle = outer.extractfile(member)
                        assert handle is not None
                yield member.name, handle.read()
