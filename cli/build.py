"""`imgpipe plan | build | push | selftest | mirror | ci`: images from definition to registry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from imgpipe.base.config import Settings
from imgpipe.base.platforms import Platform, parse_platforms
from imgpipe.base.progress import Progress, choose_mode
from imgpipe.base.units import human_bytes
from imgpipe.cli.clikit import CONTEXT, invocation, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.builds.convert import convert_each_platform
from imgpipe.commands.builds.images import (
    Pushed,
    build_images,
    ci_merge,
    lock_file,
    plan_images,
    push_images,
    selftest_named,
    unconverted,
)
from imgpipe.commands.builds.mirror import mirror_image
from imgpipe.commands.registry.published import Published, publish_all, publish_squashfs


def _pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not NAME=VALUE", param_hint=what)
        pairs[key] = rest
    return pairs


def plan_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that shape what is built (and so its input hash)."""
    options = [
        click.argument("images", nargs=-1, metavar="[IMAGE]..."),
        click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
                     help="ngc (NVIDIA's PyTorch base, for clusters) or cpu (laptops, CI). "
                     "Default: default_flavor in imgpipe.yaml (cpu when there is none)."),
        click.option("--build-arg", "build_args", multiple=True, metavar="NAME=VALUE",
                     help="Override a build arg of the flavor (repeatable)."),
        click.option("--base", metavar="REF",
                     help="Use this base image instead of the flavor's (e.g. a mirror)."),
        click.option("--wheels", "wheels_dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Offer this folder of .whl files to the build (air-gapped sites).",
                     default=None),
        click.option("--platform", "platforms", metavar="OS/ARCH[,...]", default=None,
                     help="Build one manifest per platform under one OCI index, e.g. "
                     "linux/amd64,linux/arm64 (default: image.yaml's platforms, else this "
                     "host's alone).  Platforms this host cannot run are built under "
                     "emulation, or by build.builders' native engine."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _platforms(text: str | None) -> tuple[Platform, ...]:
    return parse_platforms(text) if text else ()


def _plan_lines(items: list[Any], without: list[tuple[Any, str]]) -> list[str]:
    lines = [f"{item.key:<24} {item.action:<11} {item.reason}" for item in items]
    lines += [f"{image.name:<24} {'skipped':<11} {why}" for image, why in without]
    return lines


@click.command(context_settings=CONTEXT)
@plan_options
@reporting
def plan(ctx: click.Context, images: tuple[str, ...], flavor: str | None,
         build_args: tuple[str, ...], base: str | None, wheels_dir: Path | None,
         platforms: str | None) -> Result:
    """Say which images need a build and why, without building anything.

    An image is up to date when the hash of everything that shapes it
    (Dockerfile, context files after .dockerignore, build args, flavor, labels,
    base image digest, offered wheels) equals the one recorded in imgpipe.lock
    by its last push.

    \b
    Example:
      imgpipe plan                 every image, default flavor
      imgpipe plan bert --flavor ngc --json
    """
    made = plan_images(settings_of(ctx), images, flavor, _pairs(build_args, "--build-arg"),
                       base, wheels_dir, platforms=_platforms(platforms))
    data = [{"image": i.image.name, "flavor": i.flavor, "action": i.action, "reason": i.reason,
             "input_hash": i.input_hash, "inputs": i.inputs} for i in made.items]
    return Result({"images": data}, _plan_lines(made.items, made.without))


@click.command(context_settings=CONTEXT)
@plan_options
@click.option("--force", is_flag=True, help="Build even when the inputs did not change.")
@click.option("--no-cache", is_flag=True, help="Do not reuse BuildKit's cached steps.")
@click.option("--secret", "secrets", multiple=True, metavar="NAME=FILE",
              help="Give a build secret from FILE (ca_bundle, pip_config, ngc_api_key); "
              "it reaches only RUN --mount=type=secret steps, never a layer.")
@reporting
def build(ctx: click.Context, images: tuple[str, ...], flavor: str | None,
          build_args: tuple[str, ...], base: str | None, wheels_dir: Path | None,
          platforms: str | None, force: bool, no_cache: bool, secrets: tuple[str, ...]
          ) -> Result:
    """Build the images whose inputs changed (all when none are named) with BuildKit.

    Tags each with its version, the git revision (-dirty when the tree is) and
    latest, on the configured registry; `imgpipe push` sends them.  The engine is
    not called for images that are up to date.

    \b
    Examples:
      imgpipe build bert && imgpipe push
      imgpipe build bert --platform linux/amd64,linux/arm64
      imgpipe build bert --flavor cpu --base imgpipe/debian-python:bookworm --wheels /opt/wheels
    """
    settings = settings_of(ctx)
    made = plan_images(settings, images, flavor, _pairs(build_args, "--build-arg"), base,
                       wheels_dir, force, _platforms(platforms))
    secret_paths = {k: Path(v) for k, v in _pairs(secrets, "--secret").items()}
    built = build_images(settings, made, secret_paths,
                         Progress(choose_mode(invocation(ctx).json)), cache=not no_cache)
    lines = [f"{o.image}/{o.flavor}: {o.action}"
             + (f" {o.image_id[:19]} in {o.seconds:.1f} s" if o.image_id else "")
             for o in built.outcomes]
    lines += [f"{image.name}: skipped ({why})" for image, why in made.without]
    return Result({"images": built.outcomes, "engine_called": built.engine_called}, lines)


@click.command(context_settings=CONTEXT)
@click.argument("images", nargs=-1, metavar="[IMAGE]...")
@click.option("--convert", "then_convert", is_flag=True,
              help="Then convert each pushed image into a squashfs file (imgpipe convert).")
@click.option("--squashfs", "with_squashfs", is_flag=True,
              help="Then publish each pushed image's squashfs beside it in the registry "
              "(enroot.publish_compressions) and pin it in imgpipe.lock: nodes fetch it "
              "instead of converting.")
@click.option("--force", is_flag=True, help="Push even what imgpipe.lock says is pushed.")
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
              help="Only builds of this flavor; an image not built here is looked up in the "
              "registry in it (default: default_flavor).")
@reporting
def push(ctx: click.Context, images: tuple[str, ...], then_convert: bool,
         with_squashfs: bool, force: bool, flavor: str | None) -> Result:
    """Push what `imgpipe build` built and record the digests in imgpipe.lock.

    Pushes every tag, reads the manifest digest back from the registry, checks
    that its config is the image that was built, and writes imgpipe.lock
    atomically (a failed push leaves it as it was).  An image not built here
    whose inputs the registry holds already (pushed by CI or a colleague:
    `imgpipe build` said "up to date") is recorded in the lock, not pushed.
    --convert makes the squashfs of what it pushed or recorded, or of what the
    lock pins without one.  --squashfs also publishes that squashfs beside the
    image (an OCI artifact whose subject is the image manifest) and pins its
    digest in imgpipe.lock; `imgpipe registry ls` shows what has one.

    \b
    Examples:
      imgpipe build bert && imgpipe push
      imgpipe push bert --squashfs      # what CI runs: convert once, fetch anywhere
    """
    settings = settings_of(ctx)
    progress = Progress(choose_mode(invocation(ctx).json))
    done = push_images(settings, images, progress, force, flavor)
    if not done.pushed and not done.adopted:
        lines = ["nothing to push: imgpipe.lock is up to date"]
    else:
        lines = [f"{o.image}/{o.flavor}: {o.pinned}" for o in done.pushed]
        lines += [f"{key}: {entry.pinned} (in the registry already, pushed "
                  f"{entry.pushed_at}; recorded in imgpipe.lock)"
                  for key, entry in done.adopted.items()]
    squashfs: dict[str, str] = {}
    published: list[Published] = []
    if then_convert and not with_squashfs:
        keys = [(o.image, o.flavor) for o in done.pushed]
        keys += [(key.split("/")[0], key.split("/")[1]) for key in done.adopted]
        if not keys:  # nothing new: the squashfs of what the lock pins, where it is missing
            keys = unconverted(settings, images)
        for name, flavor in keys:
            for converted in convert_each_platform(settings, name, flavor, progress):
                squashfs[f"{name}/{flavor}"] = str(converted.path)
                lines.append(f"{name}/{flavor}: {converted.path}")
    if with_squashfs:
        published, more = _publish_all(settings, images, flavor, done, progress)
        lines += more
    return Result({"images": done.pushed, "adopted": done.adopted,
                   "lock": lock_file(settings), "squashfs": squashfs,
                   "published": published}, lines)


def _publish_all(settings: Settings, images: tuple[str, ...], flavor: str | None,
                 done: Pushed, progress: Progress) -> tuple[list[Published], list[str]]:
    """Publish the squashfs of every image pushed, recorded, or (nothing new) pinned."""
    keys = [(o.image, o.flavor) for o in done.pushed]
    keys += [(key.split("/")[0], key.split("/")[1]) for key in done.adopted]
    published = publish_all(settings, images, flavor, keys, progress)
    return published, [f"{p.image}/{p.flavor}: squashfs {p.squashfs.blob} "
                       f"({p.squashfs.compression}) "
                       + ("published" if p.pushed else "published already")
                       for p in published]


@click.command(context_settings=CONTEXT)
@click.argument("image_name", metavar="IMAGE")
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
              help="Which build to test (default: default_flavor).")
@reporting
def selftest(ctx: click.Context, image_name: str, flavor: str | None) -> Result:
    """Run the self-test image.yaml names, in a container of the last build (no network).

    \b
    Example:
      imgpipe build bert && imgpipe selftest bert && imgpipe push
    """
    settings = settings_of(ctx)
    flavor = flavor or settings.default_flavor
    summary = selftest_named(settings, image_name, flavor,
                             Progress(choose_mode(invocation(ctx).json)))
    return Result({"image": image_name, "flavor": flavor, "result": summary},
                  [f"{image_name}/{flavor}: self-test passed: {summary}"])


@click.command(context_settings=CONTEXT)
@click.argument("source", metavar="SRC")
@click.argument("dest", metavar="[DEST]", required=False)
@reporting
def mirror(ctx: click.Context, source: str, dest: str | None) -> Result:
    """Copy an image (the NGC PyTorch base, say) into the site registry by digest.

    Registry to registry: every platform of a multi-platform image, every
    blob, the same digests on both sides (a pin taken from nvcr.io holds in
    the mirror).  Every byte is checked against its digest; a copy broken
    off goes on where it stopped when run again (blobs the site registry has
    are not sent twice), and DEST is tagged only once all of it is there.
    Credentials for SRC's registry come from `docker login` or ~/.netrc.

    DEST is a repository:tag in the configured registry (default: SRC's
    repository and tag, under the prefix registry.mirrors gives SRC's
    registry).

    \b
    Example:
      docker login nvcr.io   # user $oauthtoken, your NGC API key
      imgpipe mirror nvcr.io/nvidia/pytorch:25.01-py3   # bert's ngc base
      imgpipe build bert --flavor ngc --base 127.0.0.1:5000/nvidia/pytorch:25.01-py3
    """
    done = mirror_image(settings_of(ctx), source, dest,
                        Progress(choose_mode(invocation(ctx).json)))
    copied = done.copied
    sent = (f"{copied.blobs_copied} blob(s) copied ({human_bytes(copied.bytes_copied)}), "
            f"{copied.blobs_present} there already")
    return Result({"source": done.source, "target": str(done.target), "digest": copied.digest,
                   "platforms": copied.platforms, "blobs_copied": copied.blobs_copied,
                   "blobs_present": copied.blobs_present, "bytes_copied": copied.bytes_copied},
                  [f"mirrored {source} -> {done.target.canonical}"
                   + ("" if done.target.digest else f"@{copied.digest}")
                   + (f" ({', '.join(copied.platforms)})" if copied.platforms else "")
                   + f": {sent}"])


@click.command(context_settings=CONTEXT)
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
              help="Flavor to build (default: default_flavor in imgpipe.yaml).")
@click.option("--wheels", "wheels_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Offer this folder of .whl files to the builds.")
@click.option("--squashfs", "with_squashfs", is_flag=True,
              help="Also publish each pushed image's squashfs beside it (push --squashfs).")
@reporting
def ci(ctx: click.Context, flavor: str | None, wheels_dir: Path | None,
       with_squashfs: bool) -> Result:
    """What CI runs on every merge: plan, build what changed, self-test, push, lock.

    With nothing changed it does nothing and exits 0.  With --squashfs (the
    workflow's default) every pushed image's squashfs is converted once and
    published beside it, so no cluster converts it again.

    \b
    Example (.github/workflows/images.yml runs this on the head node):
      imgpipe ci --flavor ngc --squashfs
    """
    settings = settings_of(ctx)
    progress = Progress(choose_mode(invocation(ctx).json))
    merged = ci_merge(settings, flavor, wheels_dir, progress)
    if not merged.built:
        return Result({"built": [], "pushed": []}, ["nothing changed: all images up to date"])
    lines = [f"{o.image}/{o.flavor}: {o.pinned}" for o in merged.pushed]
    published = []
    if with_squashfs:
        published = [p for o in merged.pushed
                     for p in publish_squashfs(settings, o.image, o.flavor, progress)]
        lines += [f"{p.image}/{p.flavor}: squashfs {p.squashfs.blob} ({p.squashfs.compression})"
                  for p in published]
    return Result({"built": merged.built, "pushed": merged.pushed, "published": published},
                  lines)


COMMANDS = [plan, build, push, selftest, mirror, ci]
