"""What an image's Python packages are for one platform: pip's resolution, read back.

``resolve`` asks pip on this host (``hostpip.HostPip``) for its dry-run report under the
target's wheel tags; ``chosen`` reads each distribution of it as a ``Wheel`` pinned by the
sha256 its index named (``Wheel.pin``: what imgpipe.lock records and every later fetch and
unpack is held to); ``needed_on`` walks the requirements again under the target's markers,
since pip judged them for this host (pypa/pip#11664).  Fetching and unpacking what was
chosen is ``hostsite``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any
from urllib.parse import unquote

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.platforms import Platform
from imgpipe.pipeline.catalog import PythonPackages
from imgpipe.pipeline.hostpip import HostPip, pip_target
from imgpipe.pipeline.lock import WheelPin


@dataclass(frozen=True)
class Wheel:
    """One distribution pip chose for a platform: its wheel and what it takes in the image."""

    name: str  # canonical (PEP 503)
    version: str
    file: str
    sha256: str
    url: str = field(default="", compare=False)
    installed: int = 0  # bytes of its files (bytecode included) once unpacked

    @property
    def pin(self) -> WheelPin:
        return WheelPin(file=self.file, sha256=self.sha256)


def marker_environment(platform: Platform, python: str) -> dict[str, str]:
    """PEP 508's marker variables as a CPython ``python`` on Linux ``platform`` has them."""
    return {"implementation_name": "cpython", "implementation_version": f"{python}.0",
            "os_name": "posix", "platform_machine": platform.machine,
            "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "",
            "python_full_version": f"{python}.0", "python_version": python,
            "sys_platform": "linux"}


def requirements(spec: PythonPackages, build_args: Mapping[str, str]) -> list[str]:
    """The requirement lines with each ``${NAME}`` replaced by its build arg."""
    try:
        return [Template(line).substitute(build_args) for line in spec.requirements]
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"python.requirements: {exc} is not a build arg of the flavor",
                          hint="add it under the flavor's build_args") from None


def resolve(pip: HostPip, spec: PythonPackages, platform: Platform, wanted: list[str],
            work: Path) -> dict[str, Any]:
    """pip's report of what it would install for ``platform`` (``pip install --dry-run``)."""
    report = work / f"report-{platform.tag_suffix}.json"
    pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         "--target", str(work / "dry-run"), *pip_target(spec, platform), *pip.find_links,
         *wanted],
        f"pip's resolution for {platform}",
        f"every requirement needs a wheel for {platform.machine} (manylinux up to glibc "
        f"{spec.glibc}, Python {spec.version}): pin another version in image.yaml, or offer "
        "the wheel with --wheels")
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def chosen(report: dict[str, Any]) -> list[tuple[Wheel, dict[str, Any]]]:
    """Each distribution of a resolution report as a Wheel, beside its report entry."""
    found = []
    for item in report.get("install", []):
        info = item.get("download_info") or {}
        url = str(info.get("url", ""))
        hashes = (info.get("archive_info") or {}).get("hashes") or {}
        meta = item.get("metadata") or {}
        if "sha256" not in hashes or not url.endswith(".whl"):
            raise ImgpipeError(f"pip chose {meta.get('name')} from {url.rsplit('/', 1)[-1]} "
                               "without a sha256 or not as a wheel",
                               hint="offer it as a wheel whose index names its sha256")
        name = url.rsplit("/", 1)[-1].split("#")[0]
        found.append((Wheel(canonicalize_name(str(meta["name"])), str(meta["version"]),
                            unquote(name), str(hashes["sha256"]), url), item))
    return found


def needed_on(platform: Platform, python: str, picked: list[tuple[Wheel, dict[str, Any]]]
              ) -> tuple[set[str], list[str]]:
    """The distributions the target needs, from the requested ones through each one's
    Requires-Dist under the target's markers; and the names the target needs that the
    resolution lacks (pip judged their markers for this host)."""
    env = marker_environment(platform, python)
    by_name = {wheel.name: item for wheel, item in picked}
    queue = [(wheel.name, tuple(item.get("requested_extras") or ())) for wheel, item in picked
             if item.get("requested")]
    needed: set[str] = set()
    seen: set[tuple[str, tuple[str, ...]]] = set()
    missing: list[str] = []
    while queue:
        name, extras = queue.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        needed.add(name)
        item = by_name.get(name)
        if item is None:
            missing.append(name)
            continue
        for line in (item.get("metadata") or {}).get("requires_dist") or []:
            try:
                req = Requirement(line)
            except (InvalidRequirement, InvalidMarker):
                continue
            if req.marker is None or any(_holds(req.marker, env, extra)
                                         for extra in ("", *extras)):
                queue.append((canonicalize_name(req.name), tuple(sorted(req.extras))))
    return needed, sorted(set(missing))


def _holds(marker: Marker, env: dict[str, str], extra: str) -> bool:
    return bool(marker.evaluate({**env, "extra": extra}))
