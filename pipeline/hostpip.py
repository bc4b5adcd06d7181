"""An image's Python packages, installed by pip on the build host for the image's platform.

A flavor's ``python:`` (image.yaml) names requirements.  For each platform a build makes,
pip on the build host resolves them against that platform's wheel tags (``--platform
manylinux_2_N_<machine>`` for every glibc 2.N the base offers, ``--only-binary=:all:``,
``--python-version``), fetches the wheels its cache lacks, unpacks them into ``.python/``
of the build context (``lib/pythonX.Y/site-packages`` and ``bin``) and compiles them to
bytecode here.  The Dockerfile copies that tree into its virtual environment: an arm64
build on an x86 host runs no pip under emulation, only what must run there.

Per platform, with this host's pip configuration (and the build's ``ca_bundle`` and
``pip_config`` secrets, when given, as ``PIP_CERT`` and ``PIP_CONFIG_FILE``):

1. ``pip wheel`` of each local project (``./trainer``), once per content: pure Python only;
2. ``pip install --dry-run --report``: what to take, from metadata alone (no big download);
3. ``pip download --no-deps --require-hashes``: what the wheel cache
   (``<state_dir>/wheels/<sha256>/<file>``) lacks, each file checked against the sha256
   the resolution named;
4. ``pip install --no-index --no-deps --require-hashes --target``: exactly those files.

pip evaluates environment markers for the host it runs on, not for ``--platform``
(pypa/pip#11664): the resolution is checked against the target's markers, a wheel only the
host's markers wanted is left out, and one the target needs that pip left out is an error.

``torch==VERSION`` (a public version) matches an offered ``VERSION+cpu`` wheel and PyPI's
build alike, and pip takes the higher one: the ``+cpu`` wheel wherever one is offered
(``--wheels``, a find-links folder or an index of the pip configuration), else the build
PyPI serves for that platform (a CUDA build on x86_64 and aarch64, with its ``nvidia-*``
wheels; it runs on the CPU where no GPU is).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any
from urllib.parse import unquote, urlparse

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from imgpipe.base.errors import CommandError, ConfigError, ImgpipeError
from imgpipe.base.platforms import Platform
from imgpipe.base.process import run, stream
from imgpipe.pipeline.catalog import PythonPackages
from imgpipe.pipeline.context import PYTHON_DIR, ContextFile
from imgpipe.pipeline.lock import WheelPin

PACKAGES, PROJECTS = "packages", "projects"  # the two trees of .python/ (Site)
# Legacy manylinux names (PEP 600): each is one glibc version's tag under another name.
LEGACY_TAGS = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
# PyPI's CUDA builds of torch bring these; a +cpu build needs none of them.
CUDA_ONLY = re.compile(r"^(nvidia-.+|cuda-.+|triton)$")
_TORCH_CUDA = re.compile(r"""^cuda\b[^=\n]*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


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


def platform_tags(platform: Platform, glibc: str) -> list[str]:
    """Every manylinux tag a system of ``platform`` with glibc ``glibc`` runs, newest first:
    pip's --platform matches only the tags given, not the older ones they imply."""
    major, newest = (int(part) for part in glibc.split("."))
    machine = platform.machine
    oldest = 5 if machine in ("x86_64", "i686") else 17
    tags = []
    for minor in range(newest, oldest - 1, -1):
        tags.append(f"manylinux_{major}_{minor}_{machine}")
        legacy = LEGACY_TAGS.get((major, minor))
        if legacy:
            tags.append(f"{legacy}_{machine}")
    return tags


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


def _pip_target(spec: PythonPackages, platform: Platform) -> list[str]:
    """The options that make pip choose for ``platform`` instead of this host."""
    tags = [arg for tag in platform_tags(platform, spec.glibc) for arg in ("--platform", tag)]
    abi = "cp" + spec.version.replace(".", "")
    return [*tags, "--only-binary=:all:", "--python-version", spec.version,
            "--implementation", "cp", "--abi", abi]


def _pip() -> list[str]:
    if importlib.util.find_spec("pip") is None:
        raise ImgpipeError("pip is not installed beside imgpipe, and the image's Python "
                           "packages are installed with it", hint=f"{sys.executable} -m "
                           "ensurepip, or install imgpipe into a virtual environment")
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


@dataclass(frozen=True)
class HostPip:
    """pip on this host as a build uses it: this host's pip configuration, the build's
    secrets as pip's certificate and configuration file, the offered wheels folder."""

    secrets: Mapping[str, Path]
    wheels_dir: Path | None
    cache: Path
    timeout_s: float
    on_line: Callable[[str], None]

    @property
    def env(self) -> dict[str, str]:
        env = {"PIP_PROGRESS_BAR": "off"}
        if "ca_bundle" in self.secrets:
            env["PIP_CERT"] = str(self.secrets["ca_bundle"])
        if "pip_config" in self.secrets:
            env["PIP_CONFIG_FILE"] = str(self.secrets["pip_config"])
        return env

    @property
    def find_links(self) -> list[str]:
        return ["--find-links", str(self.wheels_dir)] if self.wheels_dir else []

    def __call__(self, argv: list[str], what: str, hint: str) -> None:
        try:
            stream([*_pip(), *argv], self.on_line, timeout=self.timeout_s, env=self.env,
                   what=what)
        except CommandError as exc:
            said = pip_error(exc.stderr)
            message = f"{what} failed: {said}" if said else exc.message
            raise ImgpipeError(message, hint=hint) from exc


def pip_error(output: str) -> str:
    """The line of pip's output that says what failed: the versions it found for a
    requirement it could not meet, or its conflict and the requirements causing it."""
    lines = output.splitlines()
    errors = [line.removeprefix("ERROR: ").strip() for line in lines
              if line.startswith("ERROR: ")]
    useful = [e for e in errors
              if not e.startswith(("Ignored the following", "ResolutionImpossible"))]
    for error in useful:
        if error.startswith("Could not find a version"):
            return error
    if not useful:
        return ""
    said = useful[-1]
    if "The conflict is caused by:" in output:
        after = output.split("The conflict is caused by:", 1)[1].splitlines()
        causes = []
        for line in after[1:]:
            if not line.startswith((" ", "\t")) or not line.strip():
                break
            causes.append(line.strip())
        if causes:
            said += f" ({'; '.join(causes)})"
    return said


def build_local(pip: HostPip, project: Path, key: str) -> Path:
    """The pure-Python wheel of a project folder of the image, built once per content
    (``key``) into the wheel cache: ``pip wheel``, in this environment when it holds the
    project's build requirements, else in pip's isolated one (which fetches them)."""
    built = pip.cache / "local" / key
    made = sorted(built.glob("*.whl"))
    if not made:
        pip.cache.mkdir(parents=True, exist_ok=True)
        landing = Path(tempfile.mkdtemp(prefix=".building-", dir=pip.cache))
        try:
            isolation = ["--no-build-isolation"] if _can_build_here(project) else []
            # a copy: pip builds in the tree it is given, leaving build/ and *.egg-info
            source = landing / "source" / project.name
            shutil.copytree(project, source, symlinks=True)
            pip(["wheel", "--no-deps", *isolation, "--wheel-dir", str(landing),
                 *pip.find_links, str(source)],
                f"pip wheel {project.name}", f"fix {project.name}'s build (pyproject.toml)")
            wheels = sorted(landing.glob("*.whl"))
            if len(wheels) != 1:
                raise ImgpipeError(f"pip wheel {project.name} made {len(wheels)} wheels, not one")
            built.mkdir(parents=True, exist_ok=True)
            os.replace(wheels[0], built / wheels[0].name)
        finally:
            shutil.rmtree(landing, ignore_errors=True)
        made = sorted(built.glob("*.whl"))
    wheel = made[-1]
    if not wheel.name.endswith("-none-any.whl"):
        raise ConfigError(f"python.requirements: ./{project.name} builds a wheel for this host "
                          f"only ({wheel.name})", hint="list only pure-Python projects as "
                          "./path; publish a platform's wheels to an index instead")
    return wheel


def _can_build_here(project: Path) -> bool:
    """Whether this environment holds every build requirement of ``project``
    (pyproject.toml's [build-system] requires), so that pip needs no isolated one."""
    try:
        with (project / "pyproject.toml").open("rb") as handle:
            wanted = tomllib.load(handle).get("build-system", {}).get("requires", [])
    except (OSError, tomllib.TOMLDecodeError):
        return False
    for line in wanted:
        try:
            req = Requirement(str(line))
            have = importlib.metadata.version(req.name)
        except (InvalidRequirement, importlib.metadata.PackageNotFoundError):
            return False
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            return False
    return bool(wanted)


def resolve(pip: HostPip, spec: PythonPackages, platform: Platform, wanted: list[str],
            work: Path) -> dict[str, Any]:
    """pip's report of what it would install for ``platform`` (``pip install --dry-run``)."""
    report = work / f"report-{platform.tag_suffix}.json"
    pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         "--target", str(work / "dry-run"), *_pip_target(spec, platform), *pip.find_links,
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
             *_pip_target(spec, platform), *pip.find_links, "-r", str(pins)],
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
         *_pip_target(spec, platform), "-r", str(pins)],
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


def _file_of(wheel: Wheel) -> Path | None:
    """The local file pip found ``wheel`` in, for a file: URL."""
    return Path(unquote(urlparse(wheel.url).path)) if wheel.url.startswith("file:") else None


def _install(pip: HostPip, spec: PythonPackages, platform: Platform, wheels: list[Wheel],
             tree: Path, work: Path) -> None:
    """``wheels`` fetched, unpacked into ``tree`` (laid out as the prefix) and compiled."""
    tree.mkdir(parents=True)
    if not wheels:
        return
    files = fetch(pip, spec, platform, wheels, work)
    packages = unpack(pip, spec, platform, wheels, files, tree, work)
    compile_site(spec, tree, packages)


def local_wheels(pip: HostPip, lines: list[str], context: Path,
                 files: list[ContextFile]) -> list[str]:
    """``lines`` with each ``./path`` (a project folder of the image, as staged in
    ``context``) replaced by the wheel built from it (``build_local``; ``files``, the
    context's, key it by content)."""
    out = []
    for line in lines:
        if not line.startswith("./"):
            out.append(line)
            continue
        project = (context / line).resolve()
        if not project.is_relative_to(context.resolve()) or not project.is_dir():
            raise ConfigError(f"python.requirements: {line} is not a folder of the image",
                              hint="name a project folder under the image's folder")
        folder = project.relative_to(context.resolve()).as_posix() + "/"
        content = [[f.path, f.mode, f.digest] for f in files if f.path.startswith(folder)]
        key = hashlib.sha256(json.dumps(content).encode()).hexdigest()
        out.append(str(build_local(pip, project, key)))
    return out


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
