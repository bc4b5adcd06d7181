"""The catalog of images: ``images/<name>/image.yaml`` beside a Dockerfile and its payload.

Each definition is validated once into frozen models; an error names the file
and the key (``images/bert/image.yaml: flavors.cpu.base: Field required``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from imgpipe.base.config import Settings, format_validation_error
from imgpipe.base.errors import ConfigError
from imgpipe.base.platforms import Platform, host_platform

IMAGE_FILE = "image.yaml"
SecretName = Literal["ca_bundle", "pip_config", "ngc_api_key"]
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
ARG_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PythonPackages(_Strict):
    """Python packages that pip resolves, fetches and unpacks on the build host, for the
    platform each build makes (``pip --platform``), into ``.python/`` of that build's
    context, which the Dockerfile copies to ``prefix``: nothing of pip runs in the image,
    under emulation least of all."""

    version: str = Field(pattern=r"^3\.\d+$", description="the base image's Python (3.11): "
                         "the wheels' interpreter tags, and the build checks it")
    glibc: str = Field(pattern=r"^2\.\d+$", description="the base image's C library (Debian "
                       "12: 2.36): manylinux wheels up to this one are taken")
    requirements: list[str] = Field(min_length=1, description="pip requirements; ${NAME} is "
                                    "the flavor's build arg NAME, ./path a project folder in "
                                    "the image folder (built on the host)")
    prefix: str = Field(default="/opt/venv", pattern=r"^/[A-Za-z0-9._/-]+$",
                        description="the virtual environment the Dockerfile copies .python/ "
                        "into: scripts' #! lines name its python3")
    report: str | None = Field(default="torch", description="the package whose wheel the "
                               "build names in one line (which build, what it adds to the "
                               "image) and the lock pins per platform, with every other")


class Flavor(_Strict):
    """One way to build an image: its base and the build args that go with it."""

    base: str = Field(description="base image, passed as the BASE_IMAGE build arg")
    build_args: dict[str, str] = Field(default_factory=dict)
    tag_suffix: str = Field(default="", description="appended to every tag, e.g. -cpu")
    required_wheels: list[str] = Field(default_factory=list, description="wheel name patterns "
                                       "(torch-*+cpu-*.whl) a build of this flavor must be "
                                       "offered, unless a pip config names an index")
    platform_bases: dict[str, str] = Field(
        default_factory=dict, description="platform -> base, where one platform's base is "
        "another image (an engine holds one platform per tag: imgpipe base-image --platform "
        "linux/arm64 makes imgpipe/debian-python:bookworm-arm64); a multi-platform index "
        "(NGC's) needs none")
    python: PythonPackages | None = Field(default=None, description="Python packages pip "
                                          "installs on the build host for each platform")

    @model_validator(mode="after")
    def _python_args(self) -> Flavor:
        if self.python is not None:
            for line in self.python.requirements:
                for name in re.findall(r"\$\{([^}]*)\}", line):
                    if name not in self.build_args:
                        raise ValueError(f"python.requirements: ${{{name}}} is not a build "
                                         "arg of the flavor (add it under build_args)")
        return self

    @field_validator("platform_bases")
    @classmethod
    def _platform_keys(cls, value: dict[str, str]) -> dict[str, str]:
        return {str(_platform(name)): base for name, base in value.items()}

    def base_for(self, platform: Platform) -> str:
        """The base image a build for ``platform`` starts from."""
        return self.platform_bases.get(str(platform), self.base)

    @field_validator("build_args")
    @classmethod
    def _arg_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not ARG_RE.match(name):
                raise ValueError(f"{name!r} is not a valid build arg name")
            if name in ("BASE_IMAGE", "FLAVOR"):
                raise ValueError(f"{name} is set by imgpipe from the flavor")
        return value

    @field_validator("build_args", mode="before")
    @classmethod
    def _as_strings(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: str(v) for k, v in value.items()}
        return value


class ImageSpec(_Strict):
    """What image.yaml says."""

    name: str
    repository: str
    version: str
    description: str = ""
    flavors: dict[Literal["ngc", "cpu"], Flavor]
    labels: dict[str, str] = Field(default_factory=dict)
    secrets: list[SecretName] = Field(default_factory=list)
    selftest: list[str] = Field(default_factory=list,
                                description="argv that proves a built image works")
    dockerfile: str = "Dockerfile"
    platforms: list[str] = Field(default_factory=list, description="platforms every build is "
                                 "made for (linux/amd64, linux/arm64); default: the build "
                                 "host's.  --platform overrides")
    squashfs_compression: Literal["zstd", "lz4", "lzo-enroot", "none"] | None = Field(
        default=None, description="overrides enroot.compression in imgpipe.yaml for this image")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError("must be lower-case letters, digits, '.', '_' or '-'")
        return value

    @field_validator("repository")
    @classmethod
    def _repository(cls, value: str) -> str:
        from imgpipe.registry.reference import REPO_RE

        if not REPO_RE.match(value):
            raise ValueError("must be a registry repository path such as imgpipe/bert")
        return value

    @field_validator("platforms")
    @classmethod
    def _platforms(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(str(_platform(name)) for name in value))

    @field_validator("flavors")
    @classmethod
    def _some_flavor(cls, value: dict[str, Flavor]) -> dict[str, Flavor]:
        if not value:
            raise ValueError("at least one flavor (ngc or cpu) is needed")
        return value


def _platform(text: str) -> Platform:
    try:
        return Platform.parse(text)
    except ConfigError as exc:
        raise ValueError(f"{exc.message} (write os/architecture, e.g. linux/arm64)") from None


class Image(BaseModel):
    """A validated definition and the folder it lives in."""

    model_config = ConfigDict(frozen=True)

    spec: ImageSpec
    folder: Path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dockerfile(self) -> Path:
        return self.folder / self.spec.dockerfile

    @property
    def platforms(self) -> tuple[Platform, ...]:
        """What a build makes: image.yaml's platforms, else the build host's."""
        return tuple(Platform.parse(p) for p in self.spec.platforms) or (host_platform(),)

    def flavor(self, name: str) -> Flavor:
        try:
            return self.spec.flavors[name]  # type: ignore[index]
        except KeyError:
            offered = ", ".join(self.spec.flavors)
            raise ConfigError(f"image {self.name} has no flavor {name!r} (it has {offered})",
                              hint="pass --flavor with one of those") from None


def load_image(folder: Path) -> Image:
    path = folder / IMAGE_FILE
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values")
    try:
        spec = ImageSpec(**raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from exc
    if spec.name != folder.name:
        raise ConfigError(f"{path}: name: is {spec.name!r} but the folder is {folder.name!r}",
                          hint="make them the same")
    image = Image(spec=spec, folder=folder.resolve())
    if not image.dockerfile.is_file():
        raise ConfigError(f"{path}: dockerfile: {image.dockerfile} does not exist")
    return image


def load_catalog(settings: Settings) -> dict[str, Image]:
    """Every image under the images folder, by name."""
    root = settings.path(settings.images_dir)
    if not root.is_dir():
        raise ConfigError(f"images folder {root} does not exist",
                          hint="set images_dir in imgpipe.yaml or run from the project folder")
    return {folder.name: load_image(folder)
            for folder in sorted(root.iterdir()) if (folder / IMAGE_FILE).is_file()}


def select(catalog: dict[str, Image], names: tuple[str, ...] | list[str]) -> list[Image]:
    """The images named (all when none), in catalog order; unknown names are an error."""
    if not names:
        return list(catalog.values())
    unknown = [n for n in names if n not in catalog]
    if unknown:
        known = ", ".join(catalog) or "none"
        raise ConfigError(f"unknown image {unknown[0]!r} (the catalog has {known})",
                          hint="image names are the folders under images/")
    return [catalog[n] for n in dict.fromkeys(names)]
