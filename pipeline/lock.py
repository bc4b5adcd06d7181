"""imgpipe.lock: which bytes each image's last push produced, per image and flavor.

Written atomically under an exclusive lock, so concurrent runs serialize and
a failed push leaves the previous file exactly as it was.  Everything
downstream (squashfs conversion, recipes) pins to the digests recorded here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from imgpipe.base.errors import ConfigError
from imgpipe.base.files import SquashfsPath, atomic_write
from imgpipe.base.platforms import Platform
from imgpipe.registry.reference import Reference

LOCK_NAME = "imgpipe.lock"
LOCK_VERSION = 1


class WheelPin(BaseModel):
    """A wheel pip installed into the image on the build host: its file and its sha256."""

    file: str
    sha256: str


class PlatformPin(BaseModel):
    """One platform's manifest under an index build, and its squashfs files."""

    model_config = ConfigDict(extra="allow")

    digest: str  # the platform's manifest digest: what is converted and published
    config_digest: str
    size: int = 0
    squashfs: str | None = None
    squashfs_sha256: str | None = None
    squashfs_digests: dict[str, str] = {}
    # project name -> the wheel pip installed on the build host for this platform
    python_wheels: dict[str, WheelPin] = {}

    def squashfs_file(self) -> SquashfsPath | None:
        return SquashfsPath.checked(self.squashfs) if self.squashfs else None


class LockEntry(BaseModel):
    model_config = ConfigDict(extra="allow")

    repository: str  # host:port/repo
    tags: list[str]
    digest: str  # manifest digest in the registry
    config_digest: str
    input_hash: str
    inputs: dict[str, str]
    flavor: str
    base: str
    base_digest: str | None = None
    size: int = 0
    pushed_at: str
    squashfs: str | None = None
    squashfs_sha256: str | None = None
    # compression -> digest of the squashfs published beside this manifest (push --squashfs,
    # or `imgpipe verify` after converting it here): the pin a fetched squashfs must equal
    squashfs_digests: dict[str, str] = {}
    build_args: dict[str, str] = {}  # the values, beside their hash in inputs
    wheels_dir: str | None = None  # the wheels folder the build was offered
    # An index build: ``digest`` is the index, each platform's manifest is here
    platforms: dict[str, PlatformPin] = {}
    # A one-manifest build: the wheels pip installed on the build host (image.yaml's
    # python:), by project name; an index build keeps them per platform
    python_wheels: dict[str, WheelPin] = {}

    def platform_pin(self, platform: Platform) -> PlatformPin:
        """The manifest of ``platform`` in an index build; NotPushedError naming what the
        index offers when it has none."""
        found = self.platforms.get(str(platform))
        if found is None:
            offered = ", ".join(self.platforms) or "one manifest of no named platform"
            raise NotPushedError(f"{self.repository}@{self.digest[:19]} has no {platform} "
                                 f"image (it has {offered})",
                                 hint=f"add {platform} to the image's platforms, build and "
                                 "push; or pass --platform with one it has")
        return found

    def holder(self, manifest_digest: str) -> LockEntry | PlatformPin | None:
        """Where the squashfs facts of ``manifest_digest`` are kept: this entry (a one-
        manifest build) or one of its platforms."""
        if self.digest == manifest_digest and not self.platforms:
            return self
        return next((p for p in self.platforms.values() if p.digest == manifest_digest), None)

    @property
    def pinned(self) -> str:
        return f"{self.repository}@{self.digest}"

    @property
    def reference(self) -> Reference:
        """The pushed manifest, pinned by digest: what conversions and recipes use."""
        return Reference.parse(self.pinned)

    def squashfs_file(self) -> SquashfsPath | None:
        """The squashfs file recorded for this digest, when it still is one (a regular
        file, not a link, with the squashfs magic)."""
        return SquashfsPath.checked(self.squashfs) if self.squashfs else None


class LockFile(BaseModel):
    version: int = LOCK_VERSION
    images: dict[str, dict[str, LockEntry]] = {}

    def entry(self, name: str, flavor: str) -> LockEntry | None:
        return self.images.get(name, {}).get(flavor)

    def require(self, name: str, flavor: str, wanted_for: str) -> LockEntry:
        """The entry of ``name``/``flavor``; NotPushedError (one message for every caller,
        ``wanted_for`` saying what needed it) when it was never pushed."""
        entry = self.entry(name, flavor)
        if entry is None:
            raise NotPushedError(f"imgpipe.lock has no pushed {name}/{flavor} {wanted_for}",
                                 hint=f"imgpipe build {name} --flavor {flavor} && imgpipe push "
                                 f"{name} --flavor {flavor}")
        return entry


class NotPushedError(ConfigError):
    """An image the command needs has no digest in imgpipe.lock (exit 2)."""

    code = "not-pushed"


def lock_path(root: Path) -> Path:
    return root / LOCK_NAME


def read_lock(path: Path) -> LockFile:
    try:
        raw: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return LockFile()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable lock file ({exc})",
                          hint="restore it from version control, or delete it to rebuild all"
                          ) from exc
    try:
        return LockFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: not a valid imgpipe lock file",
                          hint="restore it from version control") from exc


@contextlib.contextmanager
def updating_lock(path: Path) -> Iterator[LockFile]:
    """Read, let the caller change, then write atomically; serialized across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    guard = path.with_name(f".{path.name}.guard")
    with open(guard, "a+") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            lock = read_lock(path)
            yield lock
            text = json.dumps(lock.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
            atomic_write(path, text)
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)
