"""The recipe operations: render a bundle pinned to what imgpipe.lock recorded, publish it
beside the image as an OCI artifact, pull one on the cluster."""

from __future__ import annotations

from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.files import SquashfsPath
from imgpipe.base.platforms import Platform, host_platform
from imgpipe.base.progress import Progress
from imgpipe.commands.registry.pushed import catalog_image, find_pushed, require_pushed
from imgpipe.commands.shared.wiring import registry_client, registry_credentials
from imgpipe.enroot.cache.storage import converted_digest
from imgpipe.enroot.nodeconfig import nodes_enroot, takes_digests
from imgpipe.enroot.published.artifact import find_published
from imgpipe.enroot.published.pins import PINS_ENV, Pins
from imgpipe.pipeline.lock import LockEntry, PlatformPin, lock_path, read_lock
from imgpipe.recipes.profiles import Profile, load_profile
from imgpipe.recipes.render import Bundle, RecipeInputs, render_bundle
from imgpipe.recipes.runtimes import RUNTIMES, Runtime
from imgpipe.recipes.scaling import Shape
from imgpipe.recipes.scaling import table as scaling_table
from imgpipe.registry.reference import Reference

__all__ = ["RUNTIMES", "Runtime", "pin", "publish_recipes", "pull_recipes", "render_recipes",
           "shape_table", "site_profile"]


def shape_table(profile: Profile, max_nodes: int) -> list[Shape]:
    """Every shape from 1 to ``max_nodes`` nodes (powers of two) that keeps the global
    batch: batch, accumulation and learning rate of each."""
    return scaling_table(profile, max_nodes)


def profiles_dir(settings: Settings) -> Path | None:
    folder = settings.recipes.profiles_dir
    return settings.path(folder) if folder else None


def site_profile(settings: Settings, name: str) -> Profile:
    """A shipped profile, or one of the site's (recipes.profiles_dir)."""
    return load_profile(name, profiles_dir(settings))


def pin(settings: Settings, image: str, flavor: str, required: bool = True,
        progress: Progress | None = None) -> Reference | SquashfsPath | None:
    """The squashfs file of the image's pushed digest (``find_pushed``: imgpipe.lock, else
    the registry) when it exists, else the digest; None for an image never pushed that the
    recipes can do without (``required=False``)."""
    if required:
        entry: LockEntry | None = require_pushed(settings, image, flavor,
                                                 "to pin (or pass --image)", progress)
    else:
        known = catalog_image(settings, image)
        entry = (find_pushed(settings, known, flavor, progress=progress).entry
                 if known is not None and flavor in known.spec.flavors else None)
    if entry is None:
        return None
    return _on_nodes(settings, entry.squashfs_file(), image, flavor) or entry.reference


def _on_nodes(settings: Settings, converted: SquashfsPath | None, image: str, flavor: str,
              platform: str = "") -> SquashfsPath | None:
    """What the nodes are handed instead of the digest: the squashfs file converted here,
    by what the site says its nodes run (enroot.pyxis_importer).  With the importer, the
    digest (it serves the image); without it, the file (refused until it exists); unsaid,
    the file where one exists and the folder is the cluster's shared one."""
    importer = settings.enroot.pyxis_importer
    if importer or settings.enroot.distribution != "shared":
        return None  # the importer gets it (node-local caches stage through it too)
    if importer is False and converted is None:
        also = f" --platform {platform}" if platform else ""
        raise ConfigError(f"the nodes run Pyxis without imgpipe's importer "
                          f"(enroot.pyxis_importer: false), so jobs need {image}/{flavor}'s "
                          "squashfs file, and imgpipe.lock records none",
                          hint=f"imgpipe convert {image} --flavor {flavor}{also} (on a host "
                          "that sees the shared squashfs folder), then render again")
    return converted


def pinned_digest(settings: Settings, pinned: Reference | SquashfsPath | str) -> str:
    """The manifest digest behind a pin: a reference's own, or the one whose squashfs file
    imgpipe.lock records; "" when nothing says (a squashfs path typed by hand)."""
    if isinstance(pinned, Reference):
        return pinned.digest or ""
    if isinstance(pinned, str) and not pinned.startswith(("/", "./")):
        try:
            return Reference.parse(pinned).digest or ""
        except ImgpipeError:
            return ""
    for flavors in read_lock(lock_path(settings.root)).images.values():
        for entry in flavors.values():
            holders: list[LockEntry | PlatformPin] = [entry, *entry.platforms.values()]
            for held in holders:
                if held.squashfs and held.squashfs == str(pinned):
                    return held.digest
    # a conversion of imgpipe's cache names the manifest it was made from
    return converted_digest(Path(str(pinned)).name) or ""


def platform_pins(settings: Settings, image: str, flavor: str, only: Platform | None = None,
                  progress: Progress | None = None) -> dict[str, Reference | SquashfsPath]:
    """An index build's pin per platform (its squashfs file when converted here, else the
    platform's manifest digest), ``only`` one of them when given; empty for a one-manifest
    build (``pin`` serves it)."""
    known = catalog_image(settings, image)
    entry = (find_pushed(settings, known, flavor, progress=progress).entry
             if known is not None and flavor in known.spec.flavors else None)
    if entry is None or not entry.platforms:
        if only is not None and entry is not None and only != host_platform():
            raise ConfigError(f"{image}/{flavor} was built for this host's platform alone, "
                              f"not {only}", hint=f"build it with --platform {only}")
        return {}
    chosen = [only] if only is not None else [Platform.parse(p) for p in entry.platforms]
    pins: dict[str, Reference | SquashfsPath] = {}
    for platform in chosen:
        held = entry.platform_pin(platform)
        pins[str(platform)] = (_on_nodes(settings, held.squashfs_file(), image, flavor,
                                         str(platform))
                               or entry.reference.with_digest(held.digest))
    return pins


def squashfs_pins(settings: Settings, images: list[tuple[str, str]], chosen: str = ""
                  ) -> dict[str, str]:
    """{image digest: squashfs digest} of the published squashfs files imgpipe.lock pins for
    ``images`` (name, flavor) and for whatever lock entry ``chosen`` (an --image) names by
    digest, in the compression the nodes' importer asks for."""
    lock = read_lock(lock_path(settings.root))
    compression = settings.enroot.default_compression
    pins = {}
    for name, flavors in lock.images.items():
        for flavor, entry in flavors.items():
            wanted = (name, flavor) in images or (chosen and entry.digest in chosen)
            holders: list[LockEntry | PlatformPin] = [entry, *entry.platforms.values()]
            for held in holders:  # the one manifest, or every platform's
                if (wanted or (chosen and held.digest in chosen)) and (
                        compression in held.squashfs_digests):
                    pins[held.digest] = held.squashfs_digests[compression]
    return pins


def _say_if_unpinned(settings: Settings, pinned: Reference | str, progress: Progress) -> None:
    """A squashfs published beside the pinned image that no pin here names: say how to pin
    it (the nodes convert until then).  Quiet when the registry cannot be asked."""
    try:
        if isinstance(pinned, str):
            if pinned.startswith(("/", "./")):
                return
            pinned = Reference.parse(pinned, default_registry=settings.registry.address)
        if pinned.digest is None or pinned.registry != settings.registry.address:
            return
        # A hint, asked once: a registry that is down costs no retries (1.8 s of backoff)
        found = find_published(registry_client(settings, retries=0), pinned.repository,
                               pinned.digest, settings.enroot.default_compression)
    except ImgpipeError:
        return
    if found:
        progress.step(f"{pinned.repository}@{pinned.digest[:19]} has a published squashfs "
                      f"({found[-1].blob[:19]}) that imgpipe.lock does not pin: the nodes "
                      "will convert; `imgpipe verify` pins it")


def refuse_loopback(pinned: Reference | SquashfsPath | str, profile_name: str) -> None:
    """Compute nodes pull from the registry themselves: 127.0.0.1 is each node's own."""
    if isinstance(pinned, SquashfsPath) or profile_name == "local":
        return
    if isinstance(pinned, str):
        if pinned.startswith(("/", "./")):
            return
        pinned = Reference.parse(pinned)
    host = pinned.registry.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        raise ConfigError(f"the pinned image {pinned} is on {host}, which compute nodes "
                          "cannot reach",
                          hint="set registry.host in imgpipe.yaml to the head node's name, "
                          "push again, or convert it and pin the squashfs file")


def render_recipes(settings: Settings, profile: Profile, nodes: int, runtime: Runtime,
                   phases: tuple[int, ...], output: Path | None, image: str | None,
                   flavor: str | None, env: dict[str, str],
                   adjust_global_batch: bool, progress: Progress | None = None,
                   platform: Platform | None = None) -> tuple[Path, Bundle]:
    """Render the bundle for ``nodes`` of ``profile``; the folder and what was written."""
    if flavor is None and image is None and profile.is_gpu and settings.default_flavor == "cpu":
        raise ConfigError(f"{profile.name} is a GPU profile but the default flavor is cpu",
                          hint="pass --flavor ngc (or --flavor cpu to mean it), or set "
                          "default_flavor: ngc in imgpipe.yaml")
    flavor = flavor or settings.default_flavor
    per_platform = {} if image else platform_pins(settings, "bert", flavor, platform, progress)
    pinned = image or next(iter(per_platform.values()), None) or pin(
        settings, "bert", flavor, progress=progress) or ""  # never empty
    for each in [pinned, *per_platform.values()]:
        refuse_loopback(each, profile.name)
    pins = squashfs_pins(settings, [("bert", flavor)]
                         + ([("nccl-tests", "ngc")] if profile.is_gpu else []), image or "")
    if pins:  # the importer on the nodes fetches these instead of converting
        env = {PINS_ENV: Pins.of(pins).text(), **env}
    elif progress is not None and not isinstance(pinned, SquashfsPath):
        _say_if_unpinned(settings, pinned, progress)
    site = settings.recipes
    enroot_version, learnt = nodes_enroot(settings)
    seen = (f"{'.'.join(map(str, enroot_version))}, from {learnt}" if enroot_version
            else learnt)
    inputs = RecipeInputs(
        profile=profile, nodes=nodes, image=pinned, runtime=runtime,
        nccl_image=(pin(settings, "nccl-tests", "ngc", required=False, progress=progress)
                    if profile.is_gpu else None),
        data_dir=site.data_dir, checkpoint_dir=site.checkpoint_dir,
        results_dir=site.results_dir, dataset_source=site.dataset_source,
        vocab=site.vocab, bert_config=site.bert_config, partition=site.partition,
        walltime_minutes=site.walltime_minutes, env=env,
        adjust_global_batch=adjust_global_batch, platform_images=dict(per_platform),
        image_digest=pinned_digest(settings, pinned),
        platform_digests={p: pinned_digest(settings, x) for p, x in per_platform.items()},
        selftest=_selftest_of(settings, "bert"),
        enroot_takes_digests=takes_digests(enroot_version), enroot_seen=seen,
        distribution=settings.enroot.distribution, importer_path=settings.enroot.importer_path,
        sbcast_fanout=settings.enroot.sbcast_fanout, sbcast_block=settings.enroot.sbcast_block)
    folder = output or settings.path(settings.outputs.recipes_dir) / f"{profile.name}-{nodes}n"
    return folder, render_bundle(inputs, folder, phases)


def _selftest_of(settings: Settings, name: str) -> tuple[str, ...]:
    known = catalog_image(settings, name)
    return tuple(known.spec.selftest) if known is not None else ()


def bundle_target(settings: Settings, name: str | None, tag: str | None = None) -> Reference:
    """NAME[:TAG] in the configured registry; default: bert's repository, -recipes, its tag."""
    if name:
        return Reference.parse(name, default_registry=settings.registry.address)
    entry = require_pushed(settings, "bert", settings.default_flavor,
                           "to publish the recipes beside (or pass --name)")
    return Reference.parse(f"{entry.reference.repository}-recipes:{tag or entry.tags[0]}",
                           default_registry=settings.registry.address)


def publish_recipes(settings: Settings, folder: Path, name: str | None
                    ) -> tuple[Reference, str | None, list[str]]:
    """Push the bundle in ``folder``; (where, its manifest digest, the files)."""
    from imgpipe.recipes.publish import publish as push_bundle  # oras: imported on use

    target = bundle_target(settings, name)
    registry = settings.registry
    names = push_bundle(folder, target, registry.scheme, registry_credentials(settings),
                        str(settings.path(registry.ca_file)) if registry.ca_file else None)
    digest = registry_client(settings).manifest_digest(target.repository, target.reference)
    return target, digest, names


def pull_recipes(settings: Settings, name: str, output: Path) -> tuple[Reference, list[Path]]:
    """Fetch the bundle ``name`` into ``output``; (what, the files written)."""
    from imgpipe.recipes.publish import pull as fetch_bundle  # oras: imported on use

    target = Reference.parse(name, default_registry=settings.registry.address)
    registry = settings.registry
    paths = fetch_bundle(target, output, registry_client(settings), registry.scheme,
                         registry_credentials(settings),
                         str(settings.path(registry.ca_file)) if registry.ca_file else None)
    return target, paths
