"""``.python/`` of a build context, for one platform: the chosen wheels fetched into the
wheel cache, unpacked by pip, laid out as the image's prefix, compiled to bytecode.

``stage_site`` is the whole of it (resolution included, through ``hostresolve``): two trees,
``packages/`` (from the index and the offered wheels, kept between builds while its stamp
says the same wheels would make it) and ``projects/`` (the image's own projects).  Every
file is checked against the sha256 its resolution named, on the way into the cache and
again on the way out.  ``choice_line`` says which build of the reported package was taken
(the +cpu wheel, or the index's CUDA build) and what it costs in image size.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.utils import canonicalize_name

from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.platforms import Platform
from imgpipe.base.process import run
from imgpipe.pipeline.catalog import PythonPackages
from imgpipe.pipeline.context import PYTHON_DIR
from imgpipe.pipeline.hostpip import HostPip, pip_target
from imgpipe.pipeline.hostresolve import Wheel, chosen, needed_on, resolve
from imgpipe.pipeline.lock import WheelPin

PACKAGES, PROJECTS = "packages", "projects"  # the two trees of .python/ (Site)
# PyPI's CUDA builds of torch bring these; a +cpu build needs none of them.
CUDA_ONLY = re.compile(r"^(nvidia-.+|cuda-.+|triton)$")
_TORCH_CUDA = re.compile(r"""^cuda\b[^=\n]*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


@dataclass(frozen=True)
class Site:
    """``.python/`` of one platform's context: what pip took, and what was left out.

    Two trees, each laid out as the prefix (``lib/pythonX.Y/site-packages``, ``bin``) and
    copied by its own Dockerfile step: ``packages/`` (from the index and the offered
    wheels: torch and the rest, gigabytes, seldom changed) and ``projects/`` (the image's
    own projects, ``./trainer``): a change of the trainer leaves torch's layer as it was.
    """

    platform: Platform
    root: Path
    wheels: tuple[Wheel, ...]
    left_out: tuple[str, ...] = ()  # wanted by the host's markers only
    compiled: bool = True
    reused: bool = False  # packages/ was made by an earlier build from the same wheels
    python: str = "3.11"

    @property
    def packages(self) -> Path:
        """site-packages of ``packages/``."""
        return self.root / PACKAGES / "lib" / f"python{self.python}" / "site-packages"

    def wheel(self, name: str) -> Wheel | None:
        wanted = canonicalize_name(name)
        return next((w for w in self.wheels if w.name == wanted), None)

    @property
    def pins(self) -> dict[str, WheelPin]:
        return {w.name: w.pin for w in self.wheels}

    @property
    def installed(self) -> int:
        return sum(w.installed for w in self.wheels)


def stage_site(pip: HostPip, spec: PythonPackages, platform: Platform, wanted: list[str],
               context: Path, work: Path) -> Site:
    """``.python/`` of ``context`` for ``platform``: resolved, fetched, unpacked, compiled.
    ``packages/`` is kept as an earlier build left it when the same wheels would make it
    (its stamp says which), so a context kept between builds skips the unpacking."""
    site = context / PYTHON_DIR
    site.mkdir(exist_ok=True)
    report = resolve(pip, spec, platform, wanted, work)
    picked = chosen(report)
    needed, missing = needed_on(platform, spec.version, picked)
    if missing:
        raise ConfigError(f"pip's resolution for {platform} lacks {', '.join(missing)}, "
                          f"which {platform.machine} needs (pip judged the markers for this "
                          "host's machine)", hint=f"add {missing[0]} to python.requirements "
                          "in image.yaml")
    wheels = [wheel for wheel, _ in picked if wheel.name in needed]
    left_out = tuple(sorted(wheel.name for wheel, _ in picked if wheel.name not in needed))
    built_here = (pip.cache / "local").resolve()
    projects = [w for w in wheels if (found := _file_of(w)) is not None
                and found.resolve().is_relative_to(built_here)]
    index = [w for w in wheels if w not in projects]
    compiled = f"{sys.version_info.major}.{sys.version_info.minor}" == spec.version
    stamp = json.dumps({"wheels": sorted([w.file, w.sha256] for w in index),
                        "python": spec.version, "prefix": spec.prefix,
                        "platform": str(platform), "compiled": compiled}, sort_keys=True)
    stamp_file = site / f"{PACKAGES}.json"
    reused = stamp_file.is_file() and stamp_file.read_text() == stamp \
        and (site / PACKAGES).is_dir()
    if not reused:
        stamp_file.unlink(missing_ok=True)
        shutil.rmtree(site / PACKAGES, ignore_errors=True)
        _install(pip, spec, platform, index, site / PACKAGES, work)
        stamp_file.write_text(stamp)
    shutil.rmtree(site / PROJECTS, ignore_errors=True)
    _install(pip, spec, platform, projects, site / PROJECTS, work)
    sizes: dict[str, int] = {}
    for tree in (PACKAGES, PROJECTS):
        sizes.update(installed_sizes(site / tree / "lib" / f"python{spec.version}" /
                                     "site-packages"))
    made = tuple(sorted((Wheel(w.name, w.version, w.file, w.sha256, w.url,
                               sizes.get(w.name, 0)) for w in wheels), key=lambda w: w.name))
    return Site(platform, site, made, left_out, compiled, reused, spec.version)


def _install(pip: HostPip, spec: PythonPackages, platform: Platform, wheels: list[Wheel],
             tree: Path, work: Path) -> None:
    """``wheels`` fetched, unpacked into ``tree`` (laid out as the prefix) and compiled."""
    tree.mkdir(parents=True)
    if not wheels:
        return
    files = fetch(pip, spec, platform, wheels, work)
    packages = unpack(pip, spec, platform, wheels, files, tree, work)
    compile_site(spec, tree, packages)


def fetch(pip: HostPip, spec: PythonPackages, platform: Platform, wheels: list[Wheel],
          work: Path) -> dict[str, Path]:
    """Each wheel's file on this host, by name: the wheel cache's (fetched into it where
    missing) or, for one pip found in a local folder, that file."""
    files: dict[str, Path] = {}
    missing: list[Wheel] = []
    for wheel in wheels:
        cached = pip.cache / wheel.sha256 / wheel.file
        local = _file_of(wheel)
        if local is not None:
            files[wheel.name] = local
        elif cached.is_file():
            files[wheel.name] = cached
        else:
            missing.append(wheel)
    if missing:
        landing = Path(tempfile.mkdtemp(prefix="download-", dir=work))
        pins = landing / "pins.txt"
        pins.write_text("".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n"
                                for w in missing))
        size = "" if len(missing) < 2 else f" ({len(missing)} wheels)"
        pip.on_line(f"fetching {', '.join(w.file for w in missing[:3])}"
                    f"{' …' if len(missing) > 3 else ''}{size}")
        pip(["download", "--no-deps", "--require-hashes", "--dest", str(landing),
             *pip_target(spec, platform), *pip.find_links, "-r", str(pins)],
            f"pip download for {platform}", "check the network and the pip configuration "
            "(index-url, cert); a wheel whose sha256 changed is refused")
        for wheel in missing:
            got = landing / wheel.file
            if not got.is_file():
                raise ImgpipeError(f"pip download for {platform} did not write {wheel.file}")
            final = pip.cache / wheel.sha256 / wheel.file
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, final)  # pip checked its sha256 (--require-hashes)
            files[wheel.name] = final
        shutil.rmtree(landing, ignore_errors=True)
    return files


def unpack(pip: HostPip, spec: PythonPackages, platform: Platform, wheels: list[Wheel],
           files: dict[str, Path], site: Path, work: Path) -> Path:
    """The wheels, unpacked by pip into ``site`` as the prefix lays them out; returns the
    site-packages folder.  pip re-checks every file's sha256 on the way."""
    view = Path(tempfile.mkdtemp(prefix="view-", dir=work))
    for wheel in wheels:
        os.symlink(files[wheel.name].resolve(), view / wheel.file)
    pins = view / "pins.txt"
    pins.write_text("".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n"
                            for w in wheels))
    packages = site / "lib" / f"python{spec.version}" / "site-packages"
    pip(["install", "--no-index", "--find-links", str(view), "--no-deps", "--require-hashes",
         "--no-compile", "--ignore-installed", "--target", str(packages),
         *pip_target(spec, platform), "-r", str(pins)],
        f"pip install for {platform}", "a cached wheel changed on disk: remove the wheel "
        f"cache ({pip.cache}) and build again")
    shutil.rmtree(view, ignore_errors=True)
    _lay_out(packages, site, spec.prefix)
    return packages


def _lay_out(packages: Path, site: Path, prefix: str) -> None:
    """pip --target leaves scripts and data beside the packages: scripts go to the
    prefix's bin (their #! naming its python3), data to the prefix."""
    interpreter = f"#!{prefix}/bin/python3\n"
    for name in ("bin", "share"):
        moved = packages / name
        if not moved.is_dir() or moved.is_symlink():
            continue
        target = site / name
        shutil.copytree(moved, target, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(moved)
    for script in sorted((site / "bin").glob("*")) if (site / "bin").is_dir() else []:
        if script.is_file() and not script.is_symlink():
            _point_at(script, interpreter)


def _point_at(script: Path, interpreter: str) -> None:
    """A console script's #! line, as pip wrote it for this host's python, made the
    prefix's: ``#!/host/python`` or, for a long path, ``#!/bin/sh`` + ``'''exec' …``."""
    with script.open("rb") as handle:
        head = handle.read(2)
    if head != b"#!":
        return
    lines = script.read_bytes().split(b"\n")
    first = lines[0]
    if b"python" in first:
        rest = lines[1:]
    elif first.strip() == b"#!/bin/sh" and len(lines) > 2 and lines[1].startswith(b"'''exec'"):
        rest = lines[3:]
    else:
        return
    script.write_bytes(interpreter.encode() + b"\n".join(rest))


def compile_site(spec: PythonPackages, site: Path, packages: Path) -> bool:
    """Bytecode for every module, made here when this host's Python is the image's (the
    format differs between minor versions), checked by hash rather than by time (files
    keep their bytes, not always their times, on the way into an image): False when it
    cannot be made here, and each import compiles in the image instead."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != spec.version:
        return False
    run([sys.executable, "-m", "compileall", "-q", "-q", "-j", "0",
         "--invalidation-mode", "unchecked-hash", "-s", str(site), "-p", spec.prefix,
         str(packages)], timeout=3600, check=False, what="compileall")
    return True


def installed_sizes(packages: Path) -> dict[str, int]:
    """Bytes each distribution's files take in ``packages`` (its RECORD), bytecode
    included, by canonical name."""
    sizes: dict[str, int] = {}
    for record in packages.glob("*.dist-info/RECORD"):
        name = canonicalize_name(record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0])
        total = 0
        with record.open(newline="") as handle:
            for row in csv.reader(handle):
                if not row:
                    continue
                path = packages / row[0]
                with contextlib.suppress(OSError):
                    total += path.lstat().st_size
                if path.suffix == ".py":
                    cached = importlib.util.cache_from_source(str(path))
                    with contextlib.suppress(OSError):
                        total += Path(cached).lstat().st_size
        sizes[name] = total
    return sizes


def _file_of(wheel: Wheel) -> Path | None:
    """The local file pip found ``wheel`` in, for a file: URL."""
    return Path(unquote(urlparse(wheel.url).path)) if wheel.url.startswith("file:") else None


def torch_cuda(packages: Path) -> str | None:
    """The CUDA version an unpacked torch was built for (torch/version.py), None for a
    CPU build."""
    try:
        text = (packages / "torch" / "version.py").read_text()
    except OSError:
        return None
    found = _TORCH_CUDA.search(text)
    return found.group(1) if found and found.group(1) not in ("None", "") else None


def choice_line(key: str, site: Site, spec: PythonPackages) -> str | None:
    """One line: which wheel of ``spec.report`` the build took for the platform, and what
    it costs in image size."""
    if spec.report is None:
        return None
    wheel = site.wheel(spec.report)
    if wheel is None:
        return None
    cuda = torch_cuda(site.packages) if wheel.name == "torch" else None
    cuda_wheels = [w for w in site.wheels if CUDA_ONLY.match(w.name)]
    extra = sum(w.installed for w in cuda_wheels)
    gb = 1e9
    where = f"{key} {site.platform}: {spec.report} {wheel.version}"
    if "+" in wheel.version:
        kind = f"the offered {wheel.version.split('+', 1)[1]} build"
    elif cuda or cuda_wheels:
        kind = (f"the index's CUDA {cuda} build" if cuda else "the index's CUDA build") + \
            f" (no +cpu wheel offered for {site.platform.machine})"
    else:
        kind = "the index's build"
    cost = f"{(wheel.installed + extra) / gb:.2f} GB in the image"
    if cuda_wheels:
        names = "nvidia-*, cuda-*, triton"
        cost += (f", {extra / gb:.2f} GB of it in {len(cuda_wheels)} CUDA wheels ({names}) "
                 "that a +cpu wheel does without")
    return f"{where}: {kind}, {wheel.file} (sha256:{wheel.sha256[:12]}…): {cost}"
