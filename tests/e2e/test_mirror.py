"""``imgpipe mirror``: a multi-platform image copied from a second registry (a local stand-in
for nvcr.io, real docker-registry 2.8 processes on both sides) into the site registry by
digest: every platform, the same digests, resumed after a cut, and a blob whose bytes do not
match its digest refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from imgpipe.base.platforms import Platform
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.mediatypes import OCI_INDEX, OCI_MANIFEST
from imgpipe.registry.transfer import push_bytes, put_manifest
from tests import services
from tests.conftest import CliRun

PLATFORMS = [("linux", "amd64"), ("linux", "arm64")]
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclass
class Published:
    """What the stand-in registry holds: the index's digest, its platforms' manifests, and
    every blob (the layer both platforms share once)."""

    index: str
    manifests: list[str]
    blobs: dict[str, bytes]
    shared_layer: str


@pytest.fixture
def ngc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.RegistryProcess]:
    server = services.start_registry(tmp_path_factory.mktemp("ngc-standin"))
    yield server
    server.stop()


def _blob(client: RegistryClient, repository: str, data: bytes, blobs: dict[str, bytes]
          ) -> dict[str, object]:
    digest = push_bytes(client, repository, data)
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def _publish(server: services.RegistryProcess, repository: str, tag: str) -> Published:
    """An OCI index of two platforms and an attestation manifest, as BuildKit pushes one."""
    client = RegistryClient(server.url)
    blobs: dict[str, bytes] = {}
    shared = _blob(client, repository, os.urandom(3 << 20), blobs)
    entries, manifests = [], []
    for system, architecture in PLATFORMS:
        config = _blob(client, repository, json.dumps(
            {"architecture": architecture, "os": system, "rootfs": {"type": "layers"}}).encode(),
            blobs)
        own = _blob(client, repository, os.urandom(2 << 20), blobs)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
            "layers": [{"mediaType": LAYER, **shared}, {"mediaType": LAYER, **own}]}).encode()
        digest = put_manifest(client, repository, "sha256:" + hashlib.sha256(manifest).hexdigest(),
                              manifest, OCI_MANIFEST)
        manifests.append(digest)
        entries.append({"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest),
                        "platform": {"os": system, "architecture": architecture}})
    statement = _blob(client, repository, b'{"_type": "https://in-toto.io/Statement/v0.1"}',
                      blobs)
    attestation = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **_blob(client, repository, b"{}", blobs)},
        "layers": [{"mediaType": "application/vnd.in-toto+json", **statement}]}).encode()
    attested = put_manifest(client, repository,
                            "sha256:" + hashlib.sha256(attestation).hexdigest(), attestation,
                            OCI_MANIFEST)
    manifests.append(attested)
    entries.append({"mediaType": OCI_MANIFEST, "digest": attested, "size": len(attestation),
                    "platform": {"os": "unknown", "architecture": "unknown"},
                    "annotations": {"vnd.docker.reference.type": "attestation-manifest",
                                    "vnd.docker.reference.digest": manifests[0]}})
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
                       ).encode()
    digest = put_manifest(client, repository, tag, index, OCI_INDEX)
    return Published(digest, manifests, blobs, str(shared["digest"]))


def _blob_data(server: services.RegistryProcess, digest: str) -> Path:
    """Where docker-registry's filesystem driver keeps a blob's bytes."""
    hexdigest = digest.partition(":")[2]
    return server.data / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


def _mirror(cli: CliRun, *args: str) -> tuple[int, dict, str]:
    code, out, err = cli("mirror", *args, "--json")
    return code, (json.loads(out)["data"] if code == 0 else {}), err


def test_mirror_copies_every_platform_under_the_same_digests(cli: CliRun, registry_server,
                                                              ngc) -> None:
    published = _publish(ngc, "nvidia/pytorch", "24.05-py3")
    cli.write_config({"registry": {"port": registry_server.port}})
    code, data, err = _mirror(cli, f"{ngc.address}/nvidia/pytorch:24.05-py3")
    assert code == 0, err
    assert data["digest"] == published.index
    assert data["target"] == f"{registry_server.address}/nvidia/pytorch:24.05-py3"
    assert data["platforms"] == ["linux/amd64", "linux/arm64", "unknown/unknown"]
    assert (data["blobs_copied"], data["blobs_present"]) == (len(published.blobs), 0)
    assert data["bytes_copied"] == sum(len(b) for b in published.blobs.values())
    site = RegistryClient(registry_server.url)
    assert site.manifest_digest("nvidia/pytorch", "24.05-py3") == published.index
    for digest in [published.index, *published.manifests]:
        assert site.manifest_exactly("nvidia/pytorch", digest).digest == digest
    for digest, data_bytes in published.blobs.items():
        response = site.request("GET", f"/v2/nvidia/pytorch/blobs/{digest}")
        assert response.content == data_bytes
    # the image resolves per platform in the mirror as it does in the source
    source = RegistryClient(ngc.url)
    for system, architecture in PLATFORMS:
        platform = Platform(system, architecture)
        assert site.manifest("nvidia/pytorch", "24.05-py3", platform).digest == \
            source.manifest("nvidia/pytorch", "24.05-py3", platform).digest
    # run again: nothing sent, the same answer
    code, again, err = _mirror(cli, f"{ngc.address}/nvidia/pytorch:24.05-py3")
    assert code == 0, err
    assert (again["digest"], again["blobs_copied"], again["bytes_copied"]) == \
        (published.index, 0, 0)
    # by digest, under another name
    code, pinned, err = _mirror(cli, f"{ngc.address}/nvidia/pytorch@{published.index}",
                                "base/pytorch:ngc")
    assert code == 0, err
    assert site.manifest_digest("base/pytorch", "ngc") == published.index
    assert not list((cli.folder / "build/state/mirror").iterdir())  # no partial file left


def test_a_cut_copy_leaves_no_tag_and_goes_on_where_it_stopped(cli: CliRun, registry_server,
                                                               ngc) -> None:
    published = _publish(ngc, "nvidia/cuda", "12.4")
    cli.write_config({"registry": {"port": registry_server.port}})
    # the source loses a layer mid-copy: the copy stops there
    kept = _blob_data(ngc, published.shared_layer).parent
    aside = ngc.root / "aside"
    shutil.move(kept, aside)
    code, _, err = _mirror(cli, f"{ngc.address}/nvidia/cuda:12.4")
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and published.shared_layer in lines[0], err
    assert "Traceback" not in err
    site = RegistryClient(registry_server.url)
    assert site.manifest_digest("nvidia/cuda", "12.4") is None  # no tag on missing bytes
    there = [d for d in published.blobs if site.blob_exists("nvidia/cuda", d)]
    assert there and published.shared_layer not in there
    # the layer is back: only what is missing is sent
    shutil.move(aside, kept)
    code, data, err = _mirror(cli, f"{ngc.address}/nvidia/cuda:12.4")
    assert code == 0, err
    assert data["blobs_present"] == len(there)
    assert data["blobs_copied"] == len(published.blobs) - len(there)
    assert site.manifest_digest("nvidia/cuda", "12.4") == published.index


def test_bytes_that_do_not_match_their_digest_are_refused(cli: CliRun, registry_server,
                                                          ngc) -> None:
    published = _publish(ngc, "nvidia/tritonserver", "24.05")
    cli.write_config({"registry": {"port": registry_server.port}})
    # a source that serves other bytes under a layer's digest (same length)
    bad = _blob_data(ngc, published.shared_layer)
    bad.write_bytes(os.urandom(len(published.blobs[published.shared_layer])))
    code, _, err = _mirror(cli, f"{ngc.address}/nvidia/tritonserver:24.05")
    assert code == 1
    assert "failed verification" in err and published.shared_layer in err, err
    assert "Traceback" not in err
    site = RegistryClient(registry_server.url)
    assert not site.blob_exists("nvidia/tritonserver", published.shared_layer)
    assert site.manifest_digest("nvidia/tritonserver", "24.05") is None
    # an index whose bytes are not the digest asked for
    index = _blob_data(ngc, published.index)
    index.write_bytes(index.read_bytes().replace(b'"schemaVersion": 2', b'"schemaVersion":2 '))
    code, _, err = _mirror(cli, f"{ngc.address}/nvidia/tritonserver@{published.index}",
                           "mirror/triton:1")
    assert code == 1 and published.index[:19] in err, err
    assert site.manifest_digest("mirror/triton", "1") is None


def test_mirror_names_what_to_fix(cli: CliRun, registry_server, ngc) -> None:
    cli.write_config({"registry": {"port": registry_server.port}})
    code, _, err = _mirror(cli, f"{ngc.address}/nvidia/nothing:1")
    assert code == 1 and "not found" in err and "Traceback" not in err, err
    code, _, err = _mirror(cli, "nvidia/pytorch:1", "elsewhere.example:5000/nvidia/pytorch:1")
    assert code != 0 and "DEST must be in the configured registry" in err, err
    code, _, err = _mirror(cli, "nvidia/pytorch:1!")
    assert code != 0 and "Traceback" not in err, err
