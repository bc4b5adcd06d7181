"""Basic (htpasswd over TLS) and Bearer-token auth against real registries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from imgpipe.registry.auth import (
    Credentials,
)
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.errors import AuthError
from tests import services

USER, PASSWORD = "alice", "s3cret-Pa55word"


@pytest.fixture(scope="module")
def tls_htpasswd_registry(tmp_path_factory) -> Iterator[tuple[services.RegistryProcess, Path]]:
    root = tmp_path_factory.mktemp("tls-registry")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(root / "server.pem"))
    cert.private_key_pem.write_to_path(str(root / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(root / "server.crt"))
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    services.htpasswd_file(root / "htpasswd", USER, PASSWORD)
    server = services.start_registry(root, extra={
        "http": {"tls": {"certificate": str(root / "server.crt"),
                         "key": str(root / "server.key")}},
        "auth": {"htpasswd": {"realm": "test", "path": str(root / "htpasswd")}},
    }, scheme="https")
    yield server, root / "ca.pem"
    server.stop()


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory) -> Iterator[tuple[services.RegistryProcess,
                                                       services.TokenServer]]:
    root = tmp_path_factory.mktemp("token-registry")
    tokens = services.start_token_server(root, USER, PASSWORD)
    server = services.start_registry(root, extra={
        "auth": {"token": {"realm": tokens.url, "service": tokens.service,
                           "issuer": tokens.issuer, "rootcertbundle": str(tokens.cert_file)}},
    })
    yield server, tokens
    server.stop()
    tokens.stop()


def test_basic_auth_over_tls(tls_htpasswd_registry) -> None:
    server, ca = tls_htpasswd_registry
    client = RegistryClient(server.url, credentials=Credentials(USER, PASSWORD), ca_file=ca)
    client.ping()
    assert client.catalog() == []


def test_basic_auth_wrong_password_is_one_line(tls_htpasswd_registry) -> None:
    server, ca = tls_htpasswd_registry
    client = RegistryClient(server.url, credentials=Credentials(USER, "wrong"), ca_file=ca)
    with pytest.raises(AuthError) as caught:
        client.catalog()
    assert caught.value.message.startswith(f"registry {server.address} refused the credentials")
    assert "wrong" not in str(caught.value)


def test_basic_auth_without_credentials_says_how_to_log_in(tls_htpasswd_registry) -> None:
    server, ca = tls_htpasswd_registry
    with pytest.raises(AuthError) as caught:
        RegistryClient(server.url, ca_file=ca).ping()
    assert "requires a login" in caught.value.message
    assert "registry.credentials" in caught.value.hint


def test_tls_without_the_ca_names_the_fix(tls_htpasswd_registry) -> None:
    server, _ = tls_htpasswd_registry
    with pytest.raises(Exception) as caught:
        RegistryClient(server.url, credentials=Credentials(USER, PASSWORD), retries=0).ping()
    assert "TLS verification failed" in str(caught.value)
    assert "registry.ca_file" in str(caught.value)


def test_bearer_token_flow(token_registry) -> None:
    server, tokens = token_registry
    client = RegistryClient(server.url, credentials=Credentials(USER, PASSWORD), allow_http=True)
    client.ping()
    assert tokens.requests_seen and tokens.requests_seen[-1]["authorized"]
    assert client.catalog() == []
    assert any("scope=registry%3Acatalog%3A%2A" in r["path"] for r in tokens.requests_seen)


def test_credentials_never_cross_plain_http_unless_the_config_says_so(token_registry) -> None:
    """A network attacker reads plain http: without registry.credentials.allow_http the
    password goes neither to the registry nor to its token realm."""
    server, tokens = token_registry
    seen = len(tokens.requests_seen)
    client = RegistryClient(server.url, credentials=Credentials(USER, PASSWORD))
    with pytest.raises(AuthError) as caught:
        client.catalog()
    assert "credentials go only to the registry's own host" in caught.value.message
    assert "allow_http" in (caught.value.hint or "")
    assert not any(r["authorized"] for r in tokens.requests_seen[seen:])


def test_credentials_never_go_to_a_token_realm_on_another_host(token_registry) -> None:
    """A realm the registry names on another host (here 127.0.0.2, the same token server
    under another name) gets an anonymous request, never the password."""
    server, tokens = token_registry
    client = RegistryClient(server.url, credentials=Credentials(USER, PASSWORD), allow_http=True)
    assert not client.auth.may_send_to(tokens.url.replace("127.0.0.1", "127.0.0.2"))
    assert client.auth.may_send_to(tokens.url)
    assert not client.auth.may_send_to("http://evil.example:5000/v2/x/blobs/uploads/1")


def test_bearer_wrong_credentials_is_one_line(token_registry) -> None:
    server, tokens = token_registry
    client = RegistryClient(server.url, credentials=Credentials(USER, "nope"), allow_http=True)
    with pytest.raises(AuthError) as caught:
        client.catalog()
    assert caught.value.message == (
        f"token endpoint {tokens.url} refused the credentials for {server.address} (HTTP 401)")
    assert "nope" not in str(caught.value)


def test_cli_with_netrc_credentials_over_tls(cli, tls_htpasswd_registry, tmp_path) -> None:
    server, ca = tls_htpasswd_registry
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login {USER} password {PASSWORD}\n")
    netrc.chmod(0o600)
    cli.write_config({"registry": {"port": server.port, "scheme": "https", "ca_file": str(ca),
                                   "credentials": {"source": "netrc", "file": str(netrc)}}})
    code, out, err = cli("registry", "ls", "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["repositories"] == []
    netrc.write_text(f"machine 127.0.0.1 login {USER} password bad-{PASSWORD}\n")
    code, out, err = cli("registry", "ls")
    assert code == 1
    assert err.strip().splitlines() == [
        f"error: registry {server.address} refused the credentials (GET /v2/_catalog) "
        "(hint: check the username and password in your credentials file)"]
    assert PASSWORD not in err + out


def use_docker_config(cli, server, tmp_path: Path) -> str:
    """Point the CLI at ``server`` with credentials in a docker config.json; returns its auth."""
    import base64

    config = tmp_path / "config.json"
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    config.write_text(json.dumps({"auths": {server.address: {"auth": auth}}}))
    cli.write_config({"registry": {"port": server.port, "credentials": {
        "source": "docker-config", "file": str(config), "allow_http": True}}})
    return auth


def test_cli_with_docker_config_and_bearer(cli, token_registry, tmp_path) -> None:
    server, _ = token_registry
    use_docker_config(cli, server, tmp_path)
    code, out, err = cli("registry", "status", "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["reachable"] is True


def test_verbose_logs_hold_no_password_or_token(cli, token_registry, tmp_path, caplog) -> None:
    import logging

    server, _ = token_registry
    auth = use_docker_config(cli, server, tmp_path)
    with caplog.at_level(logging.DEBUG):
        code, out, err = cli("-v", "registry", "ls")
    assert code == 0, err
    everything = out + err + caplog.text
    assert "got a token" in caplog.text  # debug logging really was on
    for secret in (PASSWORD, auth, "eyJ"):  # "eyJ" starts every JWT
        assert secret not in everything
