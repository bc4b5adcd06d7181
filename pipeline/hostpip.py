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

Three modules, each importing only those before it: ``hostpip`` (this one) is pip on this
host as a build runs it (``HostPip``: this host's configuration, the build's secrets, the
offered wheels; pip's failure as one line), the options that make pip choose for another
platform, and the image's own projects built into pure wheels (step 1); ``hostresolve`` is
what to take (step 2: pip's report read back as wheels pinned by sha256, the pins
imgpipe.lock records, checked against the target's markers); ``hostsite`` fetches, unpacks
and compiles them into ``.python/`` (steps 3 and 4) and says which build was taken.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from imgpipe.base.errors import CommandError, ConfigError, ImgpipeError
from imgpipe.base.platforms import Platform
from imgpipe.base.process import stream
from imgpipe.pipeline.catalog import PythonPackages
from imgpipe.pipeline.context import ContextFile

# Legacy manylinux names (PEP 600): each is one glibc version's tag under another name.
LEGACY_TAGS = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}


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


def pip_target(spec: PythonPackages, platform: Platform) -> list[str]:
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
