"""``imgpipe mirror SRC [DEST]``: an image copied from its registry (nvcr.io, docker.io, a
vendor's) into the site registry by digest, every platform of an index and every blob, the
same digests on both sides (``registry.mirror``): what air-gapped nodes and builds pull."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError
from imgpipe.base.progress import Progress
from imgpipe.commands.shared.wiring import registry_client
from imgpipe.registry.auth import credentials_from_docker_config, credentials_from_netrc
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.mirror import Copied, Side, copy_image
from imgpipe.registry.reference import Reference, through_mirror

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"  # where docker.io's registry API answers


@dataclass(frozen=True)
class Mirrored:
    """What ``imgpipe mirror`` did: from where, to where, and the copy's own account."""

    source: str
    target: Reference
    copied: Copied


def mirror_image(settings: Settings, source: str, dest: str | None, progress: Progress
                 ) -> Mirrored:
    """Copy ``source`` into the configured registry as ``dest`` (default: its own
    repository and tag, or digest), by digest; resumable, checked on every byte."""
    src = Reference.parse(source, default_registry=DOCKER_HUB)
    target = Reference.parse(dest or _same_name(src, settings),
                             default_registry=settings.registry.address)
    if target.registry != settings.registry.address:
        raise ConfigError(f"DEST must be in the configured registry {settings.registry.address}",
                          hint="give DEST as repository:tag")
    repository = src.repository
    if src.registry == DOCKER_HUB and "/" not in repository:
        repository = f"library/{repository}"  # docker.io's official images
    work = settings.path(settings.outputs.state_dir) / "mirror"
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    reference = src.digest or src.tag or "latest"
    progress.step(f"mirror {src.canonical} -> {target.canonical}")
    try:
        copied = copy_image(Side(source_client(settings, src.registry), repository), reference,
                            Side(registry_client(settings), target.repository), target.tag,
                            work, progress.step, progress.transfer)
    finally:
        progress.done()
    if target.digest and target.digest != copied.digest:
        raise ConfigError(f"{source} is {copied.digest}, not the {target.digest} DEST names",
                          hint="give DEST as repository:tag")
    copied.platforms = sorted(set(copied.platforms))
    return Mirrored(source, target, copied)


def _same_name(src: Reference, settings: Settings) -> str:
    """DEST by default: where ``registry.mirrors`` has jobs and builds look for ``src``
    (the same repository and tag where it does not map ``src``'s registry)."""
    site = settings.registry.address
    mapped = through_mirror(src, settings.registry.mirrors, site) or Reference(
        site, src.repository, src.tag, src.digest)
    return mapped.canonical


def source_client(settings: Settings, address: str) -> RegistryClient:
    """A client for the registry a mirror copies from: the configured one as configured;
    another over https through the proxy the environment names (HTTPS_PROXY, NO_PROXY; its
    CA: REQUESTS_CA_BUNDLE), plain http only on this host's loopback (as Docker allows), with
    this user's credentials for it from ``docker login`` (``$DOCKER_CONFIG``) or ~/.netrc."""
    if address == settings.registry.address:
        return registry_client(settings)
    host = DOCKER_HUB_API if address == DOCKER_HUB else address
    loopback = _is_loopback(host)
    credentials = credentials_from_docker_config(address) or credentials_from_netrc(address)
    return RegistryClient(f"{'http' if loopback else 'https'}://{host}", credentials=credentials,
                          allow_http=loopback, proxies_from_environment=not loopback)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
