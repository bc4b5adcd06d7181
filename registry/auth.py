"""Registry authentication: credentials lookup and the 401 challenge loop.

Start anonymous.  On a 401 the registry's ``WWW-Authenticate`` header says
what it wants:

* ``Basic realm=…`` (registry:2 with htpasswd): send the credentials.
* ``Bearer realm=…,service=…,scope=…`` (token auth, Docker's spec
  https://distribution.github.io/distribution/spec/auth/token/): GET the realm
  with ``service`` and ``scope`` (with Basic credentials when we have some),
  take ``token`` or ``access_token`` from the JSON, retry with it.

One token per scope is cached; tokens and passwords never reach a log line or
an error message.
"""

from __future__ import annotations

import base64
import json
import logging
import netrc
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import requests
from requests.utils import parse_dict_header

from imgpipe.registry.documents import read_capped
from imgpipe.registry.errors import AuthError, RegistryError

TOKEN_LIMIT = 1 << 20  # a token answer is a few KiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)

    def basic_header(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


def credentials_from_docker_config(address: str, path: Path | None = None) -> Credentials | None:
    """Look up ``address`` (host:port) in a docker ``config.json``'s ``auths``."""
    path = path or Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AuthError(f"{path}: cannot read docker credentials: {exc}") from exc
    auths = data.get("auths") or {}
    for key in (address, f"https://{address}", f"http://{address}", f"https://{address}/v2/"):
        entry = auths.get(key)
        if not entry:
            continue
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError) as exc:
                raise AuthError(f"{path}: auths.{key}.auth is not base64 user:password") from exc
            return Credentials(user, password)
        if entry.get("username"):
            return Credentials(entry["username"], entry.get("password", ""))
    return None


def credentials_from_netrc(address: str, path: Path | None = None) -> Credentials | None:
    """Look up the host of ``address`` in a netrc file (port stripped, as Enroot does)."""
    path = path or Path.home() / ".netrc"
    if not path.exists():
        return None
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError) as exc:
        raise AuthError(f"{path}: cannot parse netrc: {exc}") from exc
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    found = entries.authenticators(host)
    if not found:
        return None
    login, _, password = found
    return Credentials(login or "", password or "")


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="x",service="y"`` -> ``("bearer", {"realm": "x", ...})``."""
    scheme, _, rest = header.strip().partition(" ")
    params: dict[str, str | None] = parse_dict_header(rest)  # type: ignore[no-untyped-call]
    return scheme.lower(), {k: v or "" for k, v in params.items()}


class Authenticator:
    """Turns a 401 into the Authorization header for one retry."""

    def __init__(
        self,
        credentials: Credentials | None,
        session: requests.Session,
        timeout: float,
        verify: bool | str = True,
        registry_url: str = "",
        allow_http: bool = False,
    ) -> None:
        self.credentials = credentials
        self.session = session
        self.timeout = timeout
        self.verify = verify
        self.registry_url = registry_url
        self.allow_http = allow_http  # registry.credentials.allow_http
        self._tokens: dict[tuple[str, str, str], str] = {}
        # Whether the registry was answered with credentials: its images are then private
        # (what imgpipe keeps of them is the user's alone, enroot.cache.storage).
        self.credentials_sent = False

    def may_send_to(self, url: str) -> bool:
        """Credentials go to the registry's own host alone, and over plain http only when
        the config says so: never to a token realm or a redirect on another host."""
        target, registry = urlsplit(url), urlsplit(self.registry_url)
        if target.hostname != registry.hostname:
            return False
        return target.scheme == "https" or self.allow_http

    def answer(self, response: requests.Response, registry: str) -> str:
        """The Authorization header that answers ``response``'s challenge."""
        header = response.headers.get("WWW-Authenticate", "")
        scheme, params = parse_challenge(header)
        if scheme == "basic":
            if self.credentials is None:
                raise AuthError(
                    f"registry {registry} requires a login",
                    hint="set registry.credentials in imgpipe.yaml (docker-config or netrc)",
                    status=401,
                )
            if not self.may_send_to(self.registry_url):
                raise AuthError(
                    f"registry {registry} asks for a password over plain http: refused "
                    "(anyone on the network could read it)",
                    hint="use https (registry.scheme), or set registry.credentials.allow_http: "
                    "true if this network is trusted", status=401)
            self.credentials_sent = True
            return self.credentials.basic_header()
        if scheme == "bearer":
            return f"Bearer {self._token(params, registry)}"
        raise AuthError(
            f"registry {registry} asked for unsupported authentication {scheme or '(none)'!r}",
            status=401,
        )

    def _token(self, params: dict[str, str], registry: str) -> str:
        realm = params.get("realm")
        if not realm:
            raise AuthError(f"registry {registry} sent a Bearer challenge without a realm")
        key = (realm, params.get("service", ""), params.get("scope", ""))
        if key in self._tokens:
            # The cached token was just refused: ask again once.
            del self._tokens[key]
        query = {k: v for k, v in (("service", key[1]), ("scope", key[2])) if v}
        headers = {}
        if self.credentials is not None and self.may_send_to(realm):
            headers["Authorization"] = self.credentials.basic_header()
            self.credentials_sent = True
        elif self.credentials is not None:
            log.debug("token realm %s is not the registry's host over https: asked anonymously",
                      realm)
        try:
            reply = self.session.get(
                realm, params=query, headers=headers, timeout=self.timeout, verify=self.verify,
                stream=True)
        except requests.RequestException as exc:
            raise AuthError(f"token endpoint {realm} unreachable: {type(exc).__name__}") from exc
        try:
            read_capped(reply, TOKEN_LIMIT, f"token endpoint {realm}")
        except RegistryError as exc:
            raise AuthError(exc.message) from exc
        if reply.status_code in (401, 403) and "Authorization" not in headers \
                and self.credentials is not None:
            raise AuthError(
                f"token endpoint {realm} refused an anonymous request for {registry}: "
                "credentials go only to the registry's own host, and over plain http only "
                "with registry.credentials.allow_http", status=reply.status_code,
                hint="use https, or set registry.credentials.allow_http: true if this "
                "network is trusted")
        if reply.status_code in (401, 403):
            raise AuthError(
                f"token endpoint {realm} refused the credentials for {registry} "
                f"(HTTP {reply.status_code})",
                hint="check the username and password in your credentials file",
                status=reply.status_code,
            )
        if reply.status_code != 200:
            raise AuthError(f"token endpoint {realm} answered HTTP {reply.status_code}",
                            status=reply.status_code)
        try:
            body = reply.json()
        except ValueError as exc:
            raise AuthError(f"token endpoint {realm} did not answer JSON") from exc
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not token:
            raise AuthError(f"token endpoint {realm} answered without a token")
        self._tokens[key] = token
        log.debug("got a token for scope %r from %s", key[2], realm)
        return token
