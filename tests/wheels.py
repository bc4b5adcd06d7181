"""Wheels made by the tests, which pip installs as it would any: METADATA (with its
Requires-Dist), WHEEL (its tag), entry points, RECORD and the files given."""

from __future__ import annotations

import zipfile
from pathlib import Path


def make_wheel(folder: Path, name: str, version: str, tag: str, requires: tuple[str, ...] = (),
               files: dict[str, str] | None = None, scripts: dict[str, str] | None = None
               ) -> Path:
    """``folder/<name>-<version>-<tag>.whl``; ``files`` beside ``<name>/__init__.py``."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    package = name.replace("-", "_")
    members = {f"{package}/__init__.py": f"NAME = {name!r}\n", **(files or {})}
    info = f"{dist}.dist-info"
    members[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    members[f"{info}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                f"{'true' if tag.endswith('any') else 'false'}\nTag: {tag}\n")
    if scripts:
        members[f"{info}/entry_points.txt"] = "[console_scripts]\n" + "".join(
            f"{k} = {v}\n" for k, v in scripts.items())
    members[f"{info}/RECORD"] = "".join(f"{m},,\n" for m in members) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in members.items():
            archive.writestr(member, text)
    return path
