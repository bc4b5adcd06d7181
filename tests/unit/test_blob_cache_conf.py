"""The blob cache's nginx.conf and its settings (seconds; the e2e tests run it for real)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from imgpipe.base.configlayers import parse_settings
from imgpipe.base.errors import ConfigError
from imgpipe.registry.blobcacheconf import NginxLayout, render
from imgpipe.registry.cacheroute import BLOB_PATH, BlobCacheRoute

DIGEST = "sha256:" + "ab" * 32


def layout(**changes: object) -> NginxLayout:
    base = dict(upstream="http://head:5000", bind="0.0.0.0", port=5080,
                state_dir=Path("/srv/cache"), cache_dir=Path("/data/blobs"), max_size="100G")
    return NginxLayout(**{**base, **changes})  # type: ignore[arg-type]


def test_every_path_nginx_writes_is_in_the_state_folder() -> None:
    text = render(layout())
    written = re.findall(r"^\s*(?:pid|error_log|access_log|\w+_temp_path)\s+([^\s;]+)", text,
                         re.M)
    assert len(written) == 8
    assert all(path.startswith("/srv/cache/") for path in written), written
    assert "/etc/nginx" not in text and "/var/" not in text
    assert "proxy_cache_path /data/blobs " in text and "max_size=102400m" in text
    assert "daemon off;" in text and "user " not in text


def test_only_blobs_by_digest_are_cached_keyed_by_the_digest() -> None:
    text = render(layout())
    assert text.count("proxy_cache imgpipe_blobs;") == 1
    assert "proxy_cache_key $blob_digest$slice_range;" in text
    assert "Authorization" not in text.split("proxy_cache_key", 1)[1].split("\n", 1)[0]
    assert "proxy_cache_valid 200 206 30d;" in text and "proxy_cache_lock on;" in text
    assert "proxy_ignore_headers Cache-Control Expires X-Accel-Expires Set-Cookie Vary;" in text
    assert "proxy_hide_header Set-Cookie;" in text
    assert re.search(r"location / \{\s+return 404;", text)


def test_allow_and_https_upstream() -> None:
    text = render(layout(allow=("10.1.0.0/16", "192.168.7.3"), upstream="https://head:5000",
                         ca_file=Path("/etc/site-ca.pem"), user="nobody nogroup"))
    assert "allow 10.1.0.0/16;\n        allow 192.168.7.3;\n        deny all;" in text
    assert "proxy_ssl_verify on;" in text and "proxy_ssl_trusted_certificate /etc/site-ca.pem;" \
        in text
    assert text.splitlines()[3] == "user nobody nogroup;"


@pytest.mark.parametrize(("path", "routed"), [
    (f"/v2/local/bert/blobs/{DIGEST}", True),
    (f"/v2/bert/blobs/{DIGEST}?x=1", False),
    ("/v2/local/bert/manifests/latest", False),
    (f"/v2/local/bert/manifests/{DIGEST}", False),
    ("/v2/local/bert/blobs/uploads/", False),
    ("/v2/local/bert/blobs/sha256:abc", False),
])
def test_which_requests_go_to_the_cache(path: str, routed: bool) -> None:
    assert (BLOB_PATH.fullmatch(path) is not None) is routed
    route = BlobCacheRoute("http://rack1:5080/")
    assert route.takes("GET", path) is routed
    assert route.takes("HEAD", path) is False  # existence is the registry's to say


@pytest.mark.parametrize(("value", "ok"), [
    ("http://rack1:5080", True), ("https://rack1:5080/", True), ("http://10.0.0.5:65001", True),
    ("rack1:5080", False), ("http://rack1:5080/cache", False), ("ftp://rack1", False),
    ("http://user:pw@rack1:5080", False), ("http://rack1:99999", False),
])
def test_blob_cache_setting(tmp_path: Path, value: str, ok: bool) -> None:
    path = tmp_path / "imgpipe.yaml"
    path.write_text(f"registry:\n  blob_cache: '{value}'\n")
    if ok:
        assert parse_settings(path).registry.blob_cache == value.rstrip("/")
    else:
        with pytest.raises(ConfigError, match=r"registry\.blob_cache: .* is not a URL"):
            parse_settings(path)


def test_cache_server_settings_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "imgpipe.yaml"
    path.write_text("registry:\n  cache_server:\n    allow: ['10.1.0.0/16', 'rack-a']\n")
    with pytest.raises(ConfigError, match=r"cache_server\.allow: 'rack-a' is not an address"):
        parse_settings(path)
    path.write_text("registry:\n  cache_server:\n    max_size: lots\n")
    with pytest.raises(ConfigError, match=r"cache_server\.max_size"):
        parse_settings(path)
    path.write_text("registry: {}\n")
    assert parse_settings(path).registry.blob_cache is None
