"""The registry client against a real registry:2 (Debian's docker-registry)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imgpipe.registry.client import (
    DOCKER_LIST,
    OCI_INDEX,
    Platform,
    RegistryClient,
    select_platform,
)
from imgpipe.registry.errors import DigestMismatchError, RegistryError
from tests import services


@pytest.fixture
def client(registry_server: services.RegistryProcess) -> RegistryClient:
    return RegistryClient(registry_server.url)


def test_catalog_pages_through_more_than_100_repositories(
    registry_server: services.RegistryProcess, client: RegistryClient
) -> None:
    session = services.plain_session()
    layer = services.tar_layer({"hello": b"world"})
    names = [f"paging/repo{i:03d}" for i in range(130)]
    for name in names:
        services.push_image(session, registry_server.url, name, "v1", [layer])
    catalog = client.catalog()
    assert set(names) <= set(catalog)
    assert len(catalog) == len(set(catalog))
    # Small pages exercise many Link hops; the registry answers 100 at most without n.
    assert [n for n in client.catalog(page_size=7) if n.startswith("paging/")] == sorted(names)


def test_tags_page_too(registry_server: services.RegistryProcess, client: RegistryClient) -> None:
    session = services.plain_session()
    layer = services.tar_layer({"t": b"t"})
    for i in range(12):
        services.push_image(session, registry_server.url, "paging/tags", f"t{i:02d}", [layer])
    assert sorted(client.tags("paging/tags", page_size=5)) == [f"t{i:02d}" for i in range(12)]


def test_manifest_digest_matches_bytes_and_head(
    registry_server: services.RegistryProcess, client: RegistryClient
) -> None:
    session = services.plain_session()
    digest = services.push_image(session, registry_server.url, "m/one", "1",
                                 [services.tar_layer({"a": b"1"}), services.tar_layer({"b": b"2"})])
    manifest = client.manifest("m/one", "1")
    assert manifest.digest == digest
    assert client.manifest_digest("m/one", "1") == digest
    assert len(manifest.layers) == 2
    assert client.manifest("m/one", digest).digest == digest
    assert client.manifest_digest("m/one", "missing") is None
    with pytest.raises(RegistryError, match="not found"):
        client.manifest("m/one", "missing")


def test_blob_fetch_verifies_and_publishes_atomically(
    registry_server: services.RegistryProcess, client: RegistryClient, tmp_path: Path
) -> None:
    session = services.plain_session()
    payload = os.urandom(3 * 1024 * 1024)
    digest = services.push_blob(session, registry_server.url, "blobs/good", payload)
    seen = []
    path = client.fetch_blob("blobs/good", digest, tmp_path / "blob", progress=seen.append)
    assert path.read_bytes() == payload
    assert sum(seen) == len(payload)


def test_corrupted_blob_on_disk_fails_verification(
    registry_server: services.RegistryProcess, client: RegistryClient, tmp_path: Path
) -> None:
    session = services.plain_session()
    payload = os.urandom(256 * 1024)
    digest = services.push_blob(session, registry_server.url, "blobs/bad", payload)
    hexdigest = digest.split(":")[1]
    on_disk = (registry_server.data / "docker/registry/v2/blobs/sha256" / hexdigest[:2]
               / hexdigest / "data")
    damaged = bytearray(on_disk.read_bytes())
    damaged[1000] ^= 0xFF
    on_disk.write_bytes(bytes(damaged))
    with pytest.raises(DigestMismatchError) as caught:
        client.fetch_blob("blobs/bad", digest, tmp_path / "blob")
    assert f"blob {digest} of blobs/bad failed verification" in caught.value.message
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary left


def test_delete_manifest_by_digest(registry_server: services.RegistryProcess,
                                   client: RegistryClient) -> None:
    session = services.plain_session()
    digest = services.push_image(session, registry_server.url, "del/me", "1",
                                 [services.tar_layer({"x": b"x"})])
    client.delete_manifest("del/me", digest)
    assert client.manifest_digest("del/me", "1") is None


def test_unreachable_registry_is_one_clear_error() -> None:
    client = RegistryClient(f"http://127.0.0.1:{services.free_port()}", retries=1)
    with pytest.raises(RegistryError) as caught:
        client.ping()
    assert caught.value.message.startswith("cannot reach the registry at http://127.0.0.1:")
    assert "imgpipe registry up" in caught.value.hint


@pytest.mark.parametrize("index_type", [DOCKER_LIST, OCI_INDEX])
def test_platform_selection_skips_attestations(index_type: str) -> None:
    index = {"mediaType": index_type, "manifests": [
        {"digest": "sha256:att", "platform": {"os": "unknown", "architecture": "unknown"}},
        {"digest": "sha256:arm", "platform": {"os": "linux", "architecture": "arm64",
                                               "variant": "v8"}},
        {"digest": "sha256:amd", "platform": {"os": "linux", "architecture": "amd64"}},
    ]}
    assert select_platform(index, Platform("linux", "amd64"))["digest"] == "sha256:amd"
    assert select_platform(index, Platform("linux", "arm64", "v8"))["digest"] == "sha256:arm"
    with pytest.raises(RegistryError, match="no image for linux/s390x"):
        select_platform(index, Platform("linux", "s390x"))


def test_index_pushed_to_the_registry_resolves_to_this_platform(
    registry_server: services.RegistryProcess, client: RegistryClient
) -> None:
    import json

    session = services.plain_session()
    url = registry_server.url
    amd = services.push_image(session, url, "multi/arch", "amd", [services.tar_layer({"a": b"a"})])
    arm = services.push_image(session, url, "multi/arch", "arm", [services.tar_layer({"r": b"r"})])
    sizes = {d: len(session.get(f"{url}/v2/multi/arch/manifests/{d}", timeout=10, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json"}).content)
        for d in (amd, arm)}
    entry = {"mediaType": "application/vnd.docker.distribution.manifest.v2+json"}
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {**entry, "digest": arm, "size": sizes[arm],
         "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
        {**entry, "digest": amd, "size": sizes[amd],
         "platform": {"os": "linux", "architecture": "amd64"}},
    ]}).encode()
    put = session.put(f"{url}/v2/multi/arch/manifests/both", data=index, timeout=10,
                      headers={"Content-Type": OCI_INDEX})
    assert put.status_code == 201, put.text
    assert client.manifest("multi/arch", "both", Platform("linux", "amd64")).digest == amd
    assert client.manifest("multi/arch", "both", Platform("linux", "arm64", "v8")).digest == arm


def test_missing_content_digest_header_falls_back_to_hashing() -> None:
    """A case a real registry:2 will not produce: a HEAD without Docker-Content-Digest."""
    import requests
    from requests.adapters import BaseAdapter

    body = b'{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json"}'

    class NoDigestHeader(BaseAdapter):
        def send(self, request, **kwargs):
            response = requests.Response()
            response.status_code = 200
            response._content = b"" if request.method == "HEAD" else body
            response.headers["Content-Type"] = OCI_MANIFEST_TYPE
            response.url = request.url
            response.request = request
            return response

        def close(self) -> None:
            pass

    client = RegistryClient("http://registry.invalid:5000")
    client.session.mount("http://", NoDigestHeader())
    expected = "sha256:" + __import__("hashlib").sha256(body).hexdigest()
    assert client.manifest_digest("x/y", "1") == expected
    assert client.manifest("x/y", "1").digest == expected


OCI_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
