"""registry.mirrors: which registries' images the site registry holds, and under which names
(the importer and `imgpipe mirror` read them alike)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from imgpipe.base.config import RegistryConfig
from imgpipe.registry.reference import Reference, through_mirror

SITE = "head:5000"


@pytest.mark.parametrize(("uri", "mirrors", "expected"), [
    ("nvcr.io#nvidia/pytorch:24.05-py3", {"nvcr.io": ""}, "head:5000/nvidia/pytorch:24.05-py3"),
    ("nvcr.io/nvidia/pytorch:24.05-py3", {"nvcr.io": "ngc"},
     "head:5000/ngc/nvidia/pytorch:24.05-py3"),
    (f"nvcr.io/nvidia/cuda@sha256:{'a' * 64}", {"nvcr.io": "m/ngc"},
     f"head:5000/m/ngc/nvidia/cuda@sha256:{'a' * 64}"),
    ("ubuntu:22.04", {"docker.io": "hub"}, "head:5000/hub/ubuntu:22.04"),
    ("docker.io/library/ubuntu:22.04", {"docker.io": ""}, "head:5000/library/ubuntu:22.04"),
    ("ghcr.io/org/tool:1", {"nvcr.io": ""}, None),
    ("head:5000/bert:1", {"head:5000": "x"}, None),  # the site's own images stay its own
])
def test_through_mirror(uri: str, mirrors: dict[str, str], expected: str | None) -> None:
    for default in ("docker.io", "registry-1.docker.io"):
        ref = Reference.parse(uri, default_registry=default)
        mapped = through_mirror(ref, mirrors, SITE)
        assert (mapped.canonical if mapped else None) == expected


@pytest.mark.parametrize(("mirrors", "says"), [
    ({"NVCR.IO": ""}, "not a registry address"),
    ({"https://nvcr.io": ""}, "not a registry address"),
    ({"nvcr.io": "/ngc"}, "not a repository prefix"),
    ({"nvcr.io": "NGC"}, "not a repository prefix"),
])
def test_a_mirror_entry_that_cannot_be_is_refused(mirrors: dict[str, str], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        RegistryConfig(mirrors=mirrors)


def test_mirror_entries_that_can_be() -> None:
    config = RegistryConfig(mirrors={"nvcr.io": "", "registry.example:5000": "vendor/x"})
    assert config.mirrors["registry.example:5000"] == "vendor/x"


def test_the_mirrors_source_goes_through_the_sites_proxy_and_nothing_else_of_the_env(
        monkeypatch) -> None:
    """`imgpipe mirror` reaches nvcr.io through HTTPS_PROXY (the build host's way out), but
    not ~/.netrc's Basic login over the token nvcr.io issues (requests' trust_env would send
    it); the site registry's own client never takes a proxy."""
    from imgpipe.registry.client import RegistryClient

    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.site.example:3128")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/pki/proxy-ca.pem")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    source = RegistryClient("https://nvcr.io", proxies_from_environment=True)
    assert source.session.proxies.get("https") == "http://proxy.site.example:3128"
    assert source.session.trust_env is False and source.verify == "/etc/pki/proxy-ca.pem"
    site = RegistryClient("https://head:5000")
    assert not site.session.proxies and site.verify is True
    monkeypatch.setenv("NO_PROXY", "nvcr.io")
    assert not RegistryClient("https://nvcr.io", proxies_from_environment=True).session.proxies
