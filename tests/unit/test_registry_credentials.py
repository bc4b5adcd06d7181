"""Where registry credentials come from (docker config.json, netrc with Enroot's port rule)
and how a registry's auth challenge is read (tests/e2e/test_registry_auth.py: real registries)."""

from __future__ import annotations

import json
from pathlib import Path

from imgpipe.registry.auth import (
    Credentials,
    credentials_from_docker_config,
    credentials_from_netrc,
    parse_challenge,
)


def test_credentials_lookup(tmp_path: Path) -> None:
    import base64

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {
        "head:5000": {"auth": base64.b64encode(b"bob:pw:with:colons").decode()},
        "https://other:443": {"username": "carol", "password": "x"}}}))
    found = credentials_from_docker_config("head:5000", config)
    assert found == Credentials("bob", "pw:with:colons")
    assert credentials_from_docker_config("other:443", config) == Credentials("carol", "x")
    assert credentials_from_docker_config("nowhere:1", config) is None
    netrc = tmp_path / "netrc"
    netrc.write_text("machine head login dave password pw\n")
    # Enroot's rule: the port is stripped when matching the machine name.
    assert credentials_from_netrc("head:5000", netrc) == Credentials("dave", "pw")
    assert credentials_from_netrc("else:5000", netrc) is None
    assert "pw" not in repr(Credentials("dave", "pw"))


def test_challenge_parsing() -> None:
    scheme, params = parse_challenge(
        'Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push"')
    assert scheme == "bearer"
    assert params == {"realm": "https://auth.example/token", "service": "reg",
                      "scope": "repository:a/b:pull,push"}
