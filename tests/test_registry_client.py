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

pytestmark = pytest.mark.e2e


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
