"""Which pushed manifest an image of the catalog is: one answer for every command.

The registry is the source of truth; imgpipe.lock is this checkout's cache of it.  Every
command that takes an IMAGE (selftest, push, convert, recipes, build's "up to date") asks
here, and gets the same answer:

1. the lock's entry, while the registry still holds its manifest (or cannot be asked:
   commands work offline from the lock);
2. else the registry's version tag, when the labels of its config record the inputs this
   checkout would build from (every input hash; the wheels' only when a wheels folder is
   known here, since a checkout that was offered none cannot hash them) — recorded in the
   lock, so the next command reads it from there;
3. else nothing, with the reason, and the one hint that is true: build, then push (``build``
   does build then, as its plan compares the same inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from imgpipe.base.config import Settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.progress import Progress
from imgpipe.commands.shared.wiring import registry_client, registry_for
from imgpipe.pipeline.builds import BaseResolver
from imgpipe.pipeline.catalog import Image, load_catalog
from imgpipe.pipeline.lock import (
    LockEntry,
    LockFile,
    NotPushedError,
    lock_path,
    read_lock,
    updating_lock,
)
from imgpipe.pipeline.plan import INPUT_NAMES, PlanItem, plan_image
from imgpipe.pipeline.remote import pushed_entry, version_tag
from imgpipe.registry.client import RegistryClient

Source = Literal["lock", "registry", "none"]


@dataclass(frozen=True)
class Lookup:
    """Where an image's pushed manifest was found; ``why`` says why not, when it was not."""

    entry: LockEntry | None
    source: Source
    why: str = ""


def planned(settings: Settings, image: Image, flavor: str, wheels_dir: Path | None
            ) -> PlanItem:
    """The inputs this checkout would build ``image`` in ``flavor`` from (default build
    args and base, as ``imgpipe build`` without options)."""
    return plan_image(image, flavor, LockFile(), overrides={}, base_override=None,
                      wheels_dir=wheels_dir,
                      resolve_base=BaseResolver(settings, registry_for(settings)))


def inputs_differ(entry: LockEntry, item: PlanItem, wheels_known: bool) -> list[str]:
    """The inputs whose hash the registry's labels record otherwise than this checkout.
    Two cannot be hashed everywhere and then count only where they can: the wheels (no
    wheels folder known here) and the base (neither its registry nor an engine here that
    holds it, as on a login node)."""
    if entry.input_hash == item.input_hash:
        return []
    unknown = {name for name, known in (("wheels", wheels_known),
                                        ("base", item.base_digest is not None)) if not known}
    differ = [n for n in INPUT_NAMES if n not in unknown and entry.inputs.get(n) != item.inputs[n]]
    return differ or ([] if unknown else ["hash"])


def _client(settings: Settings) -> RegistryClient | None:
    try:
        return registry_client(settings)
    except ImgpipeError:
        return None


def _still_there(client: RegistryClient | None, entry: LockEntry) -> bool:
    """Whether the registry holds the lock's manifest (True when it cannot be asked)."""
    if client is None:
        return True
    ref = entry.reference
    try:
        return client.manifest_digest(ref.repository, ref.reference) is not None
    except ImgpipeError:
        return True


def find_pushed(settings: Settings, image: Image, flavor: str, *,
                wheels_dir: Path | None = None, progress: Progress | None = None,
                item: PlanItem | None = None, current: bool = False) -> Lookup:
    """The pushed manifest of ``image`` in ``flavor`` (module docstring), recording in the
    lock what only the registry knew; ``item``: the inputs as a plan computed them
    (build args and base from the command line), else the defaults'.  With ``current``
    (what ``push`` asks: is this checkout's build pushed?) the lock's entry counts only
    while it was built from this checkout's inputs, as the registry's always does."""
    lock_file = lock_path(settings.root)
    cached = read_lock(lock_file).entry(image.name, flavor)
    client = _client(settings)
    wheels = wheels_dir or (settings.path(settings.build.wheels_dir)
                            if settings.build.wheels_dir else None)
    if wheels is None and cached is not None and cached.wheels_dir:
        wheels = Path(cached.wheels_dir)

    def differ(entry: LockEntry) -> list[str]:
        nonlocal item
        item = item or planned(settings, image, flavor, wheels)
        return inputs_differ(entry, item, wheels is not None)

    if cached is not None and _still_there(client, cached) and not (current and differ(cached)):
        return Lookup(cached, "lock")
    key, tag = f"{image.name}/{flavor}", version_tag(image, flavor)
    where = f"{settings.registry.address}/{image.spec.repository}:{tag}"
    if client is None:
        return Lookup(None, "none", f"the registry {settings.registry.address} cannot be "
                      "asked")
    try:
        found = pushed_entry(client, image, flavor)
    except ImgpipeError as exc:
        return Lookup(None, "none", f"the registry cannot be asked: {exc.message}")
    if found is None:
        return Lookup(None, "none", f"the registry has no {where} built by imgpipe")
    changed = differ(found)
    if changed:
        return Lookup(None, "none", f"{where} was built from other inputs "
                      f"({', '.join(changed)} changed)")
    found.wheels_dir = str(wheels) if wheels else None
    with updating_lock(lock_file) as lock:
        recorded = lock.entry(image.name, flavor)
        if recorded is None or recorded.digest != found.digest or not _still_there(
                client, recorded):
            lock.images.setdefault(image.name, {})[flavor] = found
            recorded = found
    if progress is not None and recorded is found:
        progress.step(f"{key}: the registry holds it ({found.digest[:19]}, pushed "
                      f"{found.pushed_at} from these inputs); recorded in imgpipe.lock")
    return Lookup(recorded, "registry")


def catalog_image(settings: Settings, name: str) -> Image | None:
    """The catalog's image ``name``; None where there is no images folder or no such image."""
    if not settings.path(settings.images_dir).is_dir():
        return None
    return load_catalog(settings).get(name)


def require_pushed(settings: Settings, name: str, flavor: str, wanted_for: str,
                   progress: Progress | None = None) -> LockEntry:
    """The pushed manifest of the catalog's ``name`` in ``flavor``; NotPushedError naming
    why (and build-then-push as the hint: the build then really builds) when there is none."""
    image = catalog_image(settings, name)
    if image is None:  # recipes rendered where only the lock is (no images folder)
        return read_lock(lock_path(settings.root)).require(name, flavor, wanted_for)
    lookup = find_pushed(settings, image, flavor, progress=progress)
    if lookup.entry is None:
        raise NotPushedError(f"no pushed {name}/{flavor} {wanted_for}: {lookup.why}",
                             hint=f"imgpipe build {name} --flavor {flavor} && imgpipe push "
                             f"{name} --flavor {flavor}")
    return lookup.entry
