"""The image operations: plan, build, push, self-test, mirror, and what CI runs per merge.

Each takes the settings (and a progress display the CLI chose) and returns a result
dataclass; the CLI only parses options and renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from imgpipe.base import engine
from imgpipe.base.config import Settings
from imgpipe.base.engine import Engine, EngineError, find_build_client
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.platforms import Platform
from imgpipe.base.progress import Progress
from imgpipe.commands.registry.pushed import find_pushed
from imgpipe.commands.shared.wiring import registry_client, registry_for
from imgpipe.pipeline.builds import (
    BaseResolver,
    BuildOutcome,
    build_item,
    make_plan,
    read_records,
    require_bases,
    skipped,
)
from imgpipe.pipeline.catalog import Image, load_catalog, select
from imgpipe.pipeline.gitinfo import revision
from imgpipe.pipeline.lock import LockEntry, LockFile, lock_path, read_lock, updating_lock
from imgpipe.pipeline.plan import PlanItem
from imgpipe.pipeline.push import PushOutcome, push_record
from imgpipe.pipeline.remote import pushed_entries

SECRET_NAMES = ("ca_bundle", "pip_config", "ngc_api_key")


@dataclass(frozen=True)
class ImagePlan:
    """What a build would do: one item per image of the flavor, and the images left out."""

    items: list[PlanItem]
    without: list[tuple[Image, str]]  # (image, why it is left out)
    flavor: str
    wheels_dir: Path | None


@dataclass(frozen=True)
class Built:
    outcomes: list[BuildOutcome]
    engine_called: bool


@dataclass(frozen=True)
class Merged:
    """What `imgpipe ci` did: nothing when every image was up to date."""

    built: list[BuildOutcome] = field(default_factory=list)
    pushed: list[PushOutcome] = field(default_factory=list)


def plan_images(settings: Settings, images: tuple[str, ...], flavor: str | None,
                build_args: dict[str, str], base: str | None, wheels_dir: Path | None,
                force: bool = False, platforms: tuple[Platform, ...] = ()) -> ImagePlan:
    """Which images of the catalog need a build in ``flavor`` (default: the site's), and why."""
    flavor = flavor or settings.default_flavor
    chosen = select(load_catalog(settings), images)
    without = [(image, f"no {flavor} flavor") for image in chosen
               if flavor not in image.spec.flavors]
    if images and without:
        image = without[0][0]
        raise ConfigError(f"image {image.name} has no {flavor} flavor (it has "
                          f"{', '.join(image.spec.flavors)})", hint="pass --flavor")
    buildable = [image for image in chosen if flavor in image.spec.flavors]
    lock = with_registry_entries(settings, read_lock(lock_path(settings.root)), buildable,
                                 flavor)
    wheels = wheels_dir or (settings.path(settings.build.wheels_dir)
                            if settings.build.wheels_dir else recorded_wheels(lock, flavor))
    items = make_plan(settings, buildable, flavor, lock, overrides=build_args,
                      base_override=base, wheels_dir=wheels,
                      resolver=BaseResolver(settings, registry_for(settings)), force=force,
                      platforms=platforms)
    return ImagePlan(_still_pushed(settings, items, lock), without, flavor, wheels)


def recorded_wheels(lock: LockFile, flavor: str) -> Path | None:
    """The wheels folder the last pushes of ``flavor`` were offered, when they agree and it
    is still there: a plan without --wheels then sees the inputs the build saw."""
    folders = {entry.wheels_dir for image in lock.images.values()
               if (entry := image.get(flavor)) is not None}
    if len(folders) == 1:
        [folder] = folders
        if folder and Path(folder).is_dir():
            return Path(folder)
    return None


def with_registry_entries(settings: Settings, lock: LockFile, images: list[Image],
                          flavor: str) -> LockFile:
    """``lock`` completed, in memory, with what the registry says was pushed for images the
    lock does not know (a fresh checkout or runner): the registry is the source of truth."""
    unknown = [image for image in images if lock.entry(image.name, flavor) is None]
    if not unknown:
        return lock
    try:
        client = registry_client(settings)
    except ImgpipeError:
        return lock
    completed = lock.model_copy(deep=True)
    for name, entry in pushed_entries(client, unknown, flavor).items():
        completed.images.setdefault(name, {})[flavor] = entry
    return completed


@dataclass(frozen=True)
class Pulled:
    """What `imgpipe lock pull` wrote: each image/flavor and its digest, and what was new."""

    entries: dict[str, LockEntry]
    changed: list[str]


def pull_lock(settings: Settings, images: tuple[str, ...], flavors: tuple[str, ...]) -> Pulled:
    """Write imgpipe.lock from the registry: each image's version tag, its digest and the
    inputs its labels record (``flavors``: default every flavor of each image)."""
    chosen = select(load_catalog(settings), images)
    client = registry_client(settings)
    client.ping()
    found: dict[str, LockEntry] = {}
    for flavor in flavors or sorted({f for image in chosen for f in image.spec.flavors}):
        for name, entry in pushed_entries(client, chosen, flavor).items():
            found[f"{name}/{flavor}"] = entry
    changed = []
    with updating_lock(lock_path(settings.root)) as lock:
        for key, entry in found.items():
            name, flavor = key.split("/")
            current = lock.entry(name, flavor)
            if current is None or current.digest != entry.digest:
                if current is not None and current.squashfs and current.digest == entry.digest:
                    entry.squashfs, entry.squashfs_sha256 = (current.squashfs,
                                                             current.squashfs_sha256)
                lock.images.setdefault(name, {})[flavor] = entry
                changed.append(key)
    return Pulled(found, changed)


def gone_from_registry(settings: Settings, entry: LockEntry) -> bool:
    """Whether the manifest the lock records was deleted from the registry since (False
    when the registry cannot be asked: planning works offline)."""
    ref = entry.reference
    try:
        return registry_client(settings).manifest_digest(ref.repository, ref.reference) is None
    except ImgpipeError:
        return False


def _still_pushed(settings: Settings, items: list[PlanItem], lock: LockFile
                  ) -> list[PlanItem]:
    """An image is up to date only while the registry still holds what the lock records."""
    checked = []
    for item in items:
        entry = lock.entry(item.image.name, item.flavor)
        if item.action == "up to date" and entry is not None and gone_from_registry(
                settings, entry):
            item = replace(item, action="build", reason=f"its pushed manifest "
                           f"{entry.digest[:19]} is gone from the registry")
        checked.append(item)
    return checked


def build_images(settings: Settings, plan: ImagePlan, secrets: dict[str, Path],
                 progress: Progress, cache: bool = True) -> Built:
    """Build every planned item that is not up to date; the engine is not called otherwise."""
    unknown = set(secrets) - set(SECRET_NAMES)
    if unknown:
        raise ConfigError(f"unknown secret {sorted(unknown)[0]!r}",
                          hint="one of " + ", ".join(SECRET_NAMES))
    for item in plan.items:  # every platform's base, before the first build starts
        if item.action == "build":
            require_bases(item)
    outcomes = []
    client = None
    rev = revision(settings.path(settings.images_dir))
    for item in plan.items:
        if item.action == "up to date":
            progress.step(f"{item.key}: up to date ({item.reason})")
            # Up to date on the registry's word: the lock learns it here, so that every
            # later command (selftest, push, convert, recipes) finds the same digest.
            find_pushed(settings, item.image, item.flavor, wheels_dir=plan.wheels_dir,
                        progress=progress, item=item)
            outcomes.append(skipped(item))
            continue
        client = client or find_build_client(settings.docker.client, settings.docker.host)
        outcomes.append(build_item(settings, client, item, rev, progress,
                                   wheels_dir=plan.wheels_dir, secret_overrides=secrets,
                                   cache=cache))
    return Built(outcomes, client is not None)


@dataclass(frozen=True)
class Pushed:
    """What `imgpipe push` did: the builds it pushed, and the images it found in the
    registry already, pushed from the same inputs by another machine (a CI runner, a
    colleague), which it recorded in imgpipe.lock without pushing (by image/flavor)."""

    pushed: list[PushOutcome] = field(default_factory=list)
    adopted: dict[str, LockEntry] = field(default_factory=dict)


def push_images(settings: Settings, images: tuple[str, ...], progress: Progress,
                force: bool = False, flavor: str | None = None) -> Pushed:
    """Push the builds (of ``images``, or all; of ``flavor``, or any) whose inputs the lock
    does not hold yet, or whose recorded manifest the registry lost; every one with
    ``force``.  An image with no build here whose inputs the registry holds already
    (``imgpipe build`` said "up to date" on the registry's word) is recorded in the lock
    instead: it is pushed, by someone."""
    records = {key: record for key, record in read_records(settings).items()
               if flavor is None or record.flavor == flavor}
    lock = read_lock(lock_path(settings.root))
    if images:
        select(load_catalog(settings), images)  # unknown names are an error
        chosen = [r for r in records.values() if r.image in images]
    else:
        chosen = list(records.values())
    unbuilt = tuple(sorted(set(images) - {r.image for r in chosen}))
    adopted = adopt_pushed(settings, unbuilt, flavor, progress) if unbuilt else {}
    pending = [r for r in chosen
               if force or (e := lock.entry(r.image, r.flavor)) is None
               or e.input_hash != r.input_hash or gone_from_registry(settings, e)]
    if not images and not records:
        adopted = adopt_pushed(settings, (), flavor, progress)
    if not pending:
        return Pushed([], adopted)
    registry = registry_client(settings)
    registry.ping()
    client = find_build_client(settings.docker.client, settings.docker.host)
    return Pushed([push_record(client, registry, record, lock_path(settings.root), progress,
                               settings.build.builders) for record in pending], adopted)


def unconverted(settings: Settings, images: tuple[str, ...]) -> list[tuple[str, str]]:
    """(image, flavor) pairs of ``images`` (default: all) that imgpipe.lock pins with no
    squashfs file for their digest here."""
    lock = read_lock(lock_path(settings.root))
    return [(name, flavor) for name, flavors in sorted(lock.images.items())
            if not images or name in images
            for flavor, entry in sorted(flavors.items())
            if entry.squashfs_file() is None and not entry.platforms
            or any(pin.squashfs_file() is None for pin in entry.platforms.values())]


def adopt_pushed(settings: Settings, names: tuple[str, ...], flavor: str | None,
                 progress: Progress) -> dict[str, LockEntry]:
    """Record in the lock what the registry holds from this checkout's inputs for ``names``
    (default: every image of the flavor) in ``flavor`` (default: the site's), where the lock
    had nothing; a named image the registry does not hold is an error (it has not been
    built here, and ``imgpipe build`` would build it)."""
    flavor = flavor or settings.default_flavor
    chosen = select(load_catalog(settings), names)
    lacking = [image.name for image in chosen if flavor not in image.spec.flavors]
    if names and lacking:
        raise ConfigError(f"image {lacking[0]} has no {flavor} flavor", hint="pass --flavor")
    chosen = [image for image in chosen if image.name not in lacking]
    before = read_lock(lock_path(settings.root))
    adopted: dict[str, LockEntry] = {}
    for image in chosen:
        lookup = find_pushed(settings, image, flavor, progress=progress, current=True)
        if lookup.entry is None:
            if names:
                raise ImgpipeError(f"{image.name}/{flavor} has not been built here, and "
                                   f"{lookup.why}",
                                   hint=f"imgpipe build {image.name} --flavor {flavor}")
            continue
        if before.entry(image.name, flavor) != lookup.entry:
            adopted[f"{image.name}/{flavor}"] = lookup.entry
    return adopted


def lock_file(settings: Settings) -> Path:
    """This checkout's imgpipe.lock."""
    return lock_path(settings.root)


def selftest_named(settings: Settings, name: str, flavor: str, progress: Progress) -> str:
    """``run_selftest`` of the catalog's image ``name`` (an unknown name is an error)."""
    [image] = select(load_catalog(settings), [name])
    return run_selftest(settings, image, flavor, progress)


def run_selftest(settings: Settings, image: Image, flavor: str, progress: Progress) -> str:
    """The image's self-test in a container (no network), its last line: of this
    checkout's last build when the engine still has it, else of the pushed manifest
    (``find_pushed``: the lock, or the registry), pulled into the engine when missing.
    An index build is self-tested on every platform, each in a container of its own
    platform (emulated where this host cannot run it)."""
    if not image.spec.selftest:
        return "no self-test defined"
    client = find_build_client(settings.docker.client, settings.docker.host)
    lines = []
    for target, platform in _selftest_images(settings, image, flavor, progress):
        what = f"{image.name}/{flavor}" + (f" {platform}" if platform else "")
        progress.step(f"self-test {what}: {' '.join(image.spec.selftest)}")
        try:
            done = engine.run_in_container(client, target, list(image.spec.selftest),
                                           progress.detail, settings.build.selftest_timeout_s,
                                           f"self-test of {what}", platform)
        finally:
            progress.done()
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "passed"
        lines.append(f"{platform}: {last}" if platform else last)
    return "; ".join(lines)


def _selftest_images(settings: Settings, image: Image, flavor: str, progress: Progress
                     ) -> list[tuple[str, str | None]]:
    """What the self-test runs, per platform (None: the one manifest of a one-platform
    build): the local build's image IDs, or the pushed digests, pulled when missing."""
    docker_engine = Engine(settings.docker.host, timeout=600)
    record = read_records(settings).get(f"{image.name}/{flavor}")
    try:
        if record is not None and record.platforms:
            if all(docker_engine.image_id(i) is not None for i in record.platforms.values()):
                return [(image_id, name) for name, image_id in record.platforms.items()]
        elif record is not None and docker_engine.image_id(record.image_id) is not None:
            return [(record.image_id, None)]
    except EngineError as exc:
        raise ImgpipeError(exc.message, hint="start the Docker engine (dockerd)") from exc
    lookup = find_pushed(settings, image, flavor, progress=progress)
    if lookup.entry is None:
        raise ImgpipeError(f"{image.name}/{flavor} has not been built here, and {lookup.why}",
                           hint=f"imgpipe build {image.name} --flavor {flavor}")
    entry = lookup.entry
    wanted: list[tuple[str, str | None]] = [(f"{entry.repository}@{pin.digest}", name)
                                            for name, pin in entry.platforms.items()]
    wanted = wanted or [(entry.pinned, None)]
    for pinned, _ in wanted:
        if docker_engine.image_id(pinned) is None:
            progress.step(f"pull {pinned}")
            try:
                docker_engine.pull(pinned)
            except EngineError as exc:
                raise ImgpipeError(exc.message, hint="docker login to the registry, or check "
                                   "that the engine may pull from it") from exc
    return wanted


def ci_merge(settings: Settings, flavor: str | None, wheels_dir: Path | None,
             progress: Progress) -> Merged:
    """Plan, build what changed, self-test, push, lock: what CI runs on every merge."""
    plan = plan_images(settings, (), flavor, {}, None, wheels_dir)
    todo = [item for item in plan.items if item.action == "build"]
    if not todo:
        return Merged()
    for item in todo:
        require_bases(item)
    registry = registry_client(settings)
    registry.ping()  # fail before an hour of building, not after
    client = find_build_client(settings.docker.client, settings.docker.host)
    rev = revision(settings.path(settings.images_dir))
    built = [build_item(settings, client, item, rev, progress, wheels_dir=plan.wheels_dir,
                        secret_overrides={}) for item in todo]
    for item in todo:
        run_selftest(settings, item.image, plan.flavor, progress)
    records = read_records(settings)
    pushed = [push_record(client, registry, records[item.key], lock_path(settings.root),
                          progress, settings.build.builders) for item in todo]
    return Merged(built, pushed)
