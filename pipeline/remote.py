"""The registry as the source of truth: what was pushed, read back from the pushed image.

Every build carries its input hash (and each input's hash) as labels of its config, so a
checkout without imgpipe.lock (a fresh CI runner: actions/checkout wipes ignored files)
learns from the registry which images are already built from these inputs, and
``imgpipe lock pull`` writes imgpipe.lock back from it.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from imgpipe.base.errors import ImgpipeError
from imgpipe.base.platforms import host_platform
from imgpipe.pipeline.builds import HASH_LABEL, INPUTS_LABEL, LABEL_PREFIX, WHEELS_LABEL
from imgpipe.pipeline.catalog import Image
from imgpipe.pipeline.lock import LockEntry, PlatformPin, WheelPin
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.platformindex import platform_digests


def version_tag(image: Image, flavor: str) -> str:
    """The tag every build of ``image`` in ``flavor`` pushes: its version and the suffix."""
    return f"{image.spec.version}{image.flavor(flavor).tag_suffix}"


def pushed_entry(client: RegistryClient, image: Image, flavor: str) -> LockEntry | None:
    """The lock entry the registry vouches for: the version tag's manifest and the inputs
    its config's labels record; None when the tag is not there or was not built by imgpipe."""
    repository, tag = image.spec.repository, version_tag(image, flavor)
    digest = client.manifest_digest(repository, tag)
    if digest is None:
        return None
    platforms: dict[str, PlatformPin] = {}
    for platform, child in platform_digests(client, repository, digest).items():
        held = client.manifest_exactly(repository, child)
        platforms[str(platform)] = PlatformPin(
            digest=child, config_digest=held.config_digest, size=held.size,
            python_wheels=_wheels(_labels(client, repository, held.config_digest)))
    own = platforms.get(str(host_platform())) or next(iter(platforms.values()), None)
    manifest = client.manifest_exactly(repository, own.digest if own else digest)
    labels = _labels(client, repository, manifest.config_digest)
    input_hash = labels.get(HASH_LABEL)
    if not input_hash:
        return None
    try:
        inputs = json.loads(labels.get(INPUTS_LABEL) or "{}")
    except ValueError:
        inputs = {}
    return LockEntry(
        repository=f"{client.address}/{repository}", tags=[tag], digest=digest,
        config_digest=manifest.config_digest, input_hash=input_hash,
        inputs={str(k): str(v) for k, v in inputs.items()} if isinstance(inputs, dict) else {},
        flavor=flavor, base=labels.get(f"{LABEL_PREFIX}.base.name", ""),
        size=manifest.size, pushed_at=labels.get(f"{LABEL_PREFIX}.created", "in the registry"),
        platforms=platforms, python_wheels={} if platforms else _wheels(labels))


def _labels(client: RegistryClient, repository: str, config_digest: str) -> dict[str, str]:
    config = client.image_config(repository, config_digest).get("config") or {}
    labels = config.get("Labels") or {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def _wheels(labels: dict[str, str]) -> dict[str, WheelPin]:
    """The wheels a build's label says pip installed on its build host (none when the label
    is absent or not what imgpipe writes)."""
    try:
        raw = json.loads(labels.get(WHEELS_LABEL) or "{}")
        return {str(name): WheelPin.model_validate(pin) for name, pin in raw.items()}
    except (ValueError, AttributeError, ValidationError):
        return {}


def pushed_entries(client: RegistryClient, images: list[Image], flavor: str
                   ) -> dict[str, LockEntry]:
    """``pushed_entry`` of each image that has ``flavor``, by image name; an unreachable
    registry answers nothing (planning works offline, from the lock alone)."""
    found: dict[str, LockEntry] = {}
    for image in images:
        if flavor not in image.spec.flavors:
            continue
        try:
            entry = pushed_entry(client, image, flavor)
        except ImgpipeError:
            return found
        if entry is not None:
            found[image.name] = entry
    return found
