"""Planning and building the catalog's images; what was built is kept for `imgpipe push`.

``build/state/builds.json`` records, per image and flavor, the image ID and
tags of the last build and the inputs it was made from, so ``push`` knows
exactly which bytes to send and which hash to record.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import fnmatch
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ValidationError

from imgpipe.base.config import Settings
from imgpipe.base.engine import BuildClient, BuildRequest, Engine, EngineError
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.files import atomic_write
from imgpipe.base.platforms import Platform, host_platform
from imgpipe.base.progress import Progress
from imgpipe.pipeline.baseimage import DEFAULT_TAG
from imgpipe.pipeline.catalog import Image, PythonPackages
from imgpipe.pipeline.context import stage_context, sync_context, wheels_in
from imgpipe.pipeline.gitinfo import Revision
from imgpipe.pipeline.hostpip import HostPip, local_wheels
from imgpipe.pipeline.hostresolve import requirements
from imgpipe.pipeline.hostsite import Site, choice_line, stage_site
from imgpipe.pipeline.lock import LockFile, WheelPin
from imgpipe.pipeline.plan import PlanItem, plan_image
from imgpipe.pipeline.secrets import secret_files
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.reference import Reference

LABEL_PREFIX = "org.opencontainers.image"
HASH_LABEL = "org.imgpipe.input-hash"
INPUTS_LABEL = "org.imgpipe.inputs"  # each input's hash: what `plan` names as changed
FLAVOR_LABEL = "org.imgpipe.flavor"
# What pip installed on the build host (image.yaml's python:): {name: {file, sha256}}
WHEELS_LABEL = "org.imgpipe.python-wheels"


class BuildRecord(BaseModel):
    image: str
    flavor: str
    image_id: str
    repository: str  # host:port/repo
    tags: list[str]  # tag names only
    input_hash: str
    inputs: dict[str, str]
    base: str
    base_digest: str | None
    built_at: str
    build_args: dict[str, str] = {}
    wheels_dir: str | None = None  # the folder offered: plan and push find it again
    # An index build: platform -> the image ID built for it, tagged locally by
    # ``platform_tag``; ``image_id`` is then the first platform's
    platforms: dict[str, str] = {}
    # platform -> project name -> the wheel pip installed on the build host
    python_wheels: dict[str, dict[str, WheelPin]] = {}

    def platform_tag(self, platform: str) -> str:
        """``repository:<first tag>-<arch>``: where one platform's image waits for push
        (the engine keeps one platform per tag)."""
        return f"{self.repository}:{self.tags[0]}-{Platform.parse(platform).tag_suffix}"

    def reference(self, tag: str) -> Reference:
        """``repository:tag`` of this build, as the registry names it."""
        return Reference.parse(f"{self.repository}:{tag}")


def state_file(settings: Settings) -> Path:
    return settings.path(settings.outputs.state_dir) / "builds.json"


def read_records(settings: Settings) -> dict[str, BuildRecord]:
    path = state_file(settings)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        return {}  # a damaged state file only costs a rebuild
    if not isinstance(raw, dict):
        return {}
    records = {}
    for key, value in raw.items():
        try:
            records[key] = BuildRecord.model_validate(value)
        except ValidationError:
            continue  # written by another imgpipe version: that image is built again
    return records


def write_record(settings: Settings, record: BuildRecord) -> None:
    records = read_records(settings)
    records[f"{record.image}/{record.flavor}"] = record
    atomic_write(state_file(settings), json.dumps(
        {k: v.model_dump() for k, v in sorted(records.items())}, indent=2) + "\n")


def tag_names(image: Image, flavor: str, revision: Revision | None) -> list[str]:
    suffix = image.flavor(flavor).tag_suffix
    names = [image.spec.version]
    if revision is not None:
        names += [revision.tag, *revision.ref_tags()]
    names.append("latest")
    return list(dict.fromkeys(f"{name}{suffix}" for name in names))


def labels_for(item: PlanItem, revision: Revision | None, now: str) -> dict[str, str]:
    spec = item.image.spec
    labels = {
        f"{LABEL_PREFIX}.title": spec.name,
        f"{LABEL_PREFIX}.version": spec.version,
        f"{LABEL_PREFIX}.created": now,
        f"{LABEL_PREFIX}.base.name": item.build_args["BASE_IMAGE"],
        HASH_LABEL: item.input_hash,
        INPUTS_LABEL: json.dumps(item.inputs, sort_keys=True, separators=(",", ":")),
        FLAVOR_LABEL: item.flavor,
    }
    if spec.description:
        labels[f"{LABEL_PREFIX}.description"] = spec.description
    if revision is not None:
        labels[f"{LABEL_PREFIX}.revision"] = revision.full_sha + ("-dirty" if revision.dirty
                                                                 else "")
        if revision.source:
            labels[f"{LABEL_PREFIX}.source"] = revision.source
    labels.update(spec.labels)
    return labels


class BaseResolver:
    """The base image's identity: registry digest when reachable, else the engine's image ID."""

    def __init__(self, settings: Settings,
                 registry_for: Callable[[str], RegistryClient]) -> None:
        self.settings = settings
        self.registry_for = registry_for
        self._engine = Engine(settings.docker.host)
        self._cache: dict[str, str | None] = {}

    def __call__(self, ref: str) -> str | None:
        if ref not in self._cache:
            self._cache[ref] = self._resolve(ref)
        return self._cache[ref]

    def _resolve(self, ref: str) -> str | None:
        first = ref.split("/", 1)[0]
        if "/" in ref and ("." in first or ":" in first or first == "localhost"):
            try:
                parsed = Reference.parse(ref)
                client: RegistryClient = self.registry_for(parsed.registry)
                digest = client.manifest_digest(parsed.repository, parsed.reference)
                if digest:
                    return digest
            except ImgpipeError:
                pass
        try:
            image_id = self._engine.image_id(ref)
        except EngineError:
            return None
        return None if image_id is None else "image-id:" + image_id


def require_bases(item: PlanItem) -> None:
    """The base of every platform ``item`` builds is in the engine or its registry (as the
    plan found it), else a ConfigError naming each missing platform and the command that
    makes its base: checked before anything is built, never left to BuildKit (which would
    look for the base on Docker Hub and fail after the other platforms were built, in a
    page of resolver output).

    Raises:
        ConfigError: a base is missing.
    """
    if not item.platforms:  # one manifest of the build host's platform
        if item.base_digest is None:
            base = item.build_args["BASE_IMAGE"]
            raise ConfigError(
                f"base image {base} of {item.key} is neither in the Docker engine nor "
                "reachable in its registry",
                hint="pull or mirror it (imgpipe mirror), make one (imgpipe base-image), "
                "or pass --base",
            )
        return
    missing = [(platform, item.base_for(platform)) for platform in item.platforms
               if item.platform_base_digests.get(str(platform)) is None]
    if not missing:
        return
    many = len(missing) > 1
    named = ", ".join(f"{base} ({platform})" for platform, base in missing)
    raise ConfigError(
        f"base image{'s' if many else ''} {named} of {item.key} {'are' if many else 'is'} "
        "neither in the Docker engine nor reachable in its registry",
        hint=f"make {'them' if many else 'it'}: "
        + "; ".join(base_image_command(platform, base) for platform, base in missing)
        + f"; or pull or mirror {'them' if many else 'it'} (imgpipe mirror), or build without "
        + ", ".join(str(platform) for platform, _ in missing) + " (--platform)",
    )


def base_image_command(platform: Platform, base: str) -> str:
    """The ``imgpipe base-image`` command line that makes ``base`` for ``platform``: its
    default tag for that platform needs no --tag."""
    if base == DEFAULT_TAG and platform == host_platform():
        return "imgpipe base-image"
    command = f"imgpipe base-image --platform {platform}"
    return command if base == f"{DEFAULT_TAG}-{platform.tag_suffix}" else (
        f"{command} --tag {base}")


def make_plan(settings: Settings, images: list[Image], flavor: str, lock: LockFile, *,
              overrides: dict[str, str], base_override: str | None, wheels_dir: Path | None,
              resolver: BaseResolver, force: bool,
              platforms: tuple[Platform, ...] = ()) -> list[PlanItem]:
    return [plan_image(image, flavor, lock, overrides=overrides,
                       base_override=base_override or mirrored_base(settings, image, flavor,
                                                                    resolver),
                       wheels_dir=wheels_dir, resolve_base=resolver, force=force,
                       platforms=platforms)
            for image in images]


def mirrored_base(settings: Settings, image: Image, flavor: str,
                  resolve: Callable[[str], str | None]) -> str | None:
    """The site registry's copy of the flavor's base where ``registry.mirrors`` maps its
    registry there and the base itself is neither in the engine nor reachable (a build host
    without nvcr.io), else None: a base the engine holds is built from as it is."""
    from imgpipe.registry.errors import ReferenceFormatError
    from imgpipe.registry.reference import Reference, through_mirror

    if not settings.registry.mirrors or flavor not in (image.spec.flavors or {}):
        return None
    base = image.flavor(flavor).base
    try:
        mapped = through_mirror(Reference.parse(base, default_registry="docker.io"),
                                settings.registry.mirrors, settings.registry.address)
    except ReferenceFormatError:
        return None
    if mapped is None or resolve(base) is not None:
        return None
    return str(mapped.canonical)


@dataclass(frozen=True)
class BuildOutcome:
    image: str
    flavor: str
    action: str  # built | up to date
    reason: str
    image_id: str | None = None
    tags: tuple[str, ...] = ()
    seconds: float = 0.0
    notes: tuple[str, ...] = ()  # which torch each platform took, and what it costs


def build_item(settings: Settings, client: BuildClient, item: PlanItem,
               revision: Revision | None, progress: Progress, *, wheels_dir: Path | None,
               secret_overrides: dict[str, Path], cache: bool = True) -> BuildOutcome:
    """Build one planned image and record it for push."""
    from imgpipe.base.engine import run_build

    require_wheels(settings, item, wheels_dir, secret_overrides)
    require_bases(item)
    repository = f"{settings.registry.address}/{item.image.spec.repository}"
    names = tag_names(item.image, item.flavor, revision)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    started = time.monotonic()
    progress.step(f"build {item.key}: {item.reason}")
    labels = labels_for(item, revision, now)
    built: dict[str, str] = {}
    single: str | None = None  # the image ID of a one-manifest build
    wheels: dict[str, dict[str, WheelPin]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix=f"imgpipe-context-{item.image.name}-") as staged:
        with secret_files(settings, list(item.image.spec.secrets), secret_overrides) as secrets:
            request = BuildRequest(
                context=Path(staged), dockerfile=Path(staged) / item.image.spec.dockerfile,
                tags=[f"{repository}:{name}" for name in names], build_args=item.build_args,
                labels=labels, secrets=secrets,
                timeout_s=settings.build.timeout_s, cache=cache,
                cache_from=cache_refs(settings, client, repository, item),
            )
            for platform in item.platforms or (host_platform(),):
                with _staged(settings, item, platform, wheels_dir, secrets, Path(staged),
                             progress) as (context, site):
                    request_here = _with_context(request, item, context, site)
                    if site is not None:
                        wheels[str(platform)] = site.pins
                        note = choice_line(item.key, site, _python(item))
                        if note:
                            notes.append(note)
                            progress.step(note)
                    if item.platforms:
                        built[str(platform)] = _build_platform(settings, client, item,
                                                               request_here, platform, progress)
                        continue
                    try:
                        single = run_build(client, request_here, progress.detail)
                    finally:
                        progress.done()
    image_id = next(iter(built.values())) if built else single
    assert image_id is not None
    seconds = time.monotonic() - started
    write_record(settings, BuildRecord(
        image=item.image.name, flavor=item.flavor, image_id=image_id, repository=repository,
        tags=names, input_hash=item.input_hash, inputs=item.inputs,
        base=item.build_args["BASE_IMAGE"], base_digest=item.base_digest, built_at=now,
        build_args=item.build_args, wheels_dir=str(wheels_dir) if wheels_dir else None,
        platforms=built, python_wheels=wheels))
    progress.step(f"built {item.key} in {seconds:.1f} s: {image_id[:19]}")
    return BuildOutcome(item.image.name, item.flavor, "built", item.reason, image_id,
                        tuple(names), seconds, tuple(notes))


def _python(item: PlanItem) -> PythonPackages:
    python = item.image.flavor(item.flavor).python
    assert python is not None
    return python


def wheel_cache(settings: Settings) -> Path:
    """Where wheels pip fetched on the build host are kept, each under its sha256."""
    return settings.path(settings.outputs.state_dir) / "wheels"


def context_dir(settings: Settings, item: PlanItem, platform: Platform) -> Path:
    """Where the context of ``item`` for ``platform`` is kept between builds (a flavor with
    ``python:``: gigabytes that mostly stay the same)."""
    return (settings.path(settings.outputs.state_dir) / "contexts" /
            f"{item.image.name}-{item.flavor}-{platform.tag_suffix}")


@contextlib.contextmanager
def _staged(settings: Settings, item: PlanItem, platform: Platform, wheels_dir: Path | None,
            secrets: Mapping[str, Path], work: Path, progress: Progress
            ) -> Iterator[tuple[Path, Site | None]]:
    """One platform's build context: the image folder as .dockerignore leaves it and the
    offered wheels, in ``work`` (removed once that platform is built); for a flavor with
    ``python:``, in a folder kept between builds (``context_dir``; one build at a time uses
    it) with ``.python/`` that pip made here for that platform."""
    python = item.image.flavor(item.flavor).python
    if python is None:
        dest = work / f"context-{platform.tag_suffix}"
        dest.mkdir()
        try:
            yield stage_context(item.image.folder, item.files, wheels_dir, dest), None
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return
    dest = context_dir(settings, item, platform)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(dest.name + ".lock"), "a+") as guard:
        try:
            fcntl.lockf(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            progress.step(f"waiting for another build of {item.key} {platform} "
                          f"({dest} is in use)")
            fcntl.lockf(guard, fcntl.LOCK_EX)
        context = sync_context(item.image.folder, item.files, wheels_dir, dest)
        pip = HostPip(secrets, wheels_dir, wheel_cache(settings), settings.build.timeout_s,
                      progress.detail)
        started = time.monotonic()
        progress.step(f"pip for {item.key} {platform}, on this host: "
                      f"{', '.join(python.requirements)}")
        try:
            wanted = local_wheels(pip, requirements(python, item.build_args), context,
                                  item.files)
            site = stage_site(pip, python, platform, wanted, context, work)
        finally:
            progress.done()
        progress.step(f"pip for {item.key} {platform}: {len(site.wheels)} wheels, "
                      f"{site.installed / 1e9:.2f} GB, in {time.monotonic() - started:.1f} s"
                      + (" (packages/ as the last build left it: the same wheels)"
                         if site.reused else "")
                      + ("" if site.compiled else "; bytecode left to the image's imports "
                         f"(this host's Python is not {python.version})")
                      + (f"; left out, wanted by this host's markers only: "
                         f"{', '.join(site.left_out)}" if site.left_out else ""))
        yield context, site


def _with_context(request: BuildRequest, item: PlanItem, context: Path, site: Site | None
                  ) -> BuildRequest:
    """``request`` for one platform's context, labelled with the wheels pip installed."""
    labels = dict(request.labels)
    if site is not None:
        labels[WHEELS_LABEL] = json.dumps(
            {name: pin.model_dump() for name, pin in sorted(site.pins.items())},
            sort_keys=True, separators=(",", ":"))
    return replace(request, context=context, dockerfile=context / item.image.spec.dockerfile,
                   labels=labels)


def _build_platform(settings: Settings, client: BuildClient, item: PlanItem,
                    request: BuildRequest, platform: Platform, progress: Progress) -> str:
    """One platform of an index build, tagged ``<first tag>-<arch>`` in the engine: where
    the build host cannot run it, through emulation (binfmt) or the remote builder that
    build.builders names for it."""
    from imgpipe.base.builders import builder_for
    from imgpipe.base.engine import run_build

    target, how = builder_for(client, platform, settings.build.builders)
    progress.step(f"build {item.key} for {platform} ({how})")
    first = request.tags[0].rsplit(":", 1)[0]
    tag = f"{first}:{request.tags[0].rsplit(':', 1)[1]}-{platform.tag_suffix}"
    args = {**item.build_args, "BASE_IMAGE": item.base_for(platform)}
    try:
        return run_build(target, replace(request, tags=[tag], build_args=args,
                                         platform=str(platform), cache_from=[]),
                         progress.detail)
    finally:
        progress.done()


def cache_refs(settings: Settings, client: BuildClient, repository: str, item: PlanItem
               ) -> list[str]:
    """Where a build finds layers to reuse in the head-node registry: with buildx, a cache
    tag of its own (exported there, mode=max, every stage); with the engine's built-in
    BuildKit, the last pushed images (their inline cache)."""
    if not settings.build.registry_cache:
        return []
    suffix = item.image.flavor(item.flavor).tag_suffix
    if client.build_path == "buildx":
        return [f"{repository}:buildcache{suffix}"]
    return [f"{repository}:{item.image.spec.version}{suffix}", f"{repository}:latest{suffix}"]


def require_wheels(settings: Settings, item: PlanItem, wheels_dir: Path | None,
                   secret_overrides: dict[str, Path]) -> None:
    """A flavor's required wheels are offered, for every platform the build makes, or a pip
    config names an index that may serve them: never a silent fall-back to PyPI (whose
    torch is the 5 GB CUDA build, on aarch64 too)."""
    patterns = item.image.flavor(item.flavor).required_wheels
    if not patterns or "pip_config" in secret_overrides or settings.build.secrets.pip_config:
        return
    offered = [wheel.name for wheel in wheels_in(wheels_dir)]
    for platform in item.platforms or (host_platform(),):
        missing = [p for p in patterns
                   if not any(fnmatch.fnmatch(name, p) and _runs_on(name, platform)
                              for name in offered)]
        if missing:
            where = f"in {wheels_dir}" if wheels_dir else "(no --wheels folder)"
            what = f" for {platform}" if item.platforms else ""
            raise ConfigError(
                f"{item.key}{what} needs a wheel matching {missing[0]} ({platform.machine}) "
                f"and none is offered {where}", hint="pass --wheels DIR holding it (or "
                "build.wheels_dir), or a pip_config secret naming an index that serves it")


def _runs_on(wheel: str, platform: Platform) -> bool:
    """Whether a wheel's platform tag (its file name's last field) fits ``platform``."""
    tag = wheel.removesuffix(".whl").rsplit("-", 1)[-1]
    return tag == "any" or platform.machine in tag


def skipped(item: PlanItem) -> BuildOutcome:
    return BuildOutcome(item.image.name, item.flavor, "up to date", item.reason)

