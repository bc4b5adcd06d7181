"""`imgpipe plan | build | push | selftest | mirror | ci`: images from definition to registry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from imgpipe.base import engine
from imgpipe.base.config import Settings
from imgpipe.base.engine import Engine, EngineError, find_build_client
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.progress import Progress, choose_mode
from imgpipe.cli.clikit import CONTEXT, invocation, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.wiring import registry_client
from imgpipe.pipeline.builds import BaseResolver, build_item, make_plan, read_records, skipped
from imgpipe.pipeline.catalog import Image, load_catalog, select
from imgpipe.pipeline.gitinfo import revision
from imgpipe.pipeline.lock import lock_path, read_lock
from imgpipe.pipeline.plan import PlanItem
from imgpipe.pipeline.push import push_record
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.reference import Reference


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
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _registry_for(settings: Settings) -> Callable[[str], RegistryClient]:
    def make(address: str) -> RegistryClient:
        if address == settings.registry.address:
            return registry_client(settings)
        return RegistryClient(f"https://{address}", retries=0, timeout=(3.0, 10.0))
    return make


def _plan(settings: Settings, images: tuple[str, ...], flavor: str | None,
          build_args: tuple[str, ...], base: str | None, wheels_dir: Path | None,
          force: bool) -> tuple[list[PlanItem], list[tuple[Image, str]], str, Path | None]:
    flavor = flavor or settings.default_flavor
    catalog = load_catalog(settings)
    chosen = select(catalog, images)
    without = [(image, f"no {flavor} flavor") for image in chosen
               if flavor not in image.spec.flavors]
    if images and without:
        image = without[0][0]
        raise ConfigError(f"image {image.name} has no {flavor} flavor (it has "
                          f"{', '.join(image.spec.flavors)})", hint="pass --flavor")
    buildable = [image for image in chosen if flavor in image.spec.flavors]
    wheels = wheels_dir or (settings.path(settings.build.wheels_dir)
                            if settings.build.wheels_dir else None)
    lock = read_lock(lock_path(settings.root))
    overrides = _pairs(build_args, "--build-arg")
    items = make_plan(settings, buildable, flavor, lock, overrides=overrides,
                      base_override=base, wheels_dir=wheels,
                      resolver=BaseResolver(settings, _registry_for(settings)), force=force)
    return items, without, flavor, wheels


def _plan_lines(items: list[PlanItem], without: list[tuple[Image, str]]) -> list[str]:
    lines = [f"{item.key:<24} {item.action:<11} {item.reason}" for item in items]
    lines += [f"{image.name:<24} {'skipped':<11} {why}" for image, why in without]
    return lines


@click.command(context_settings=CONTEXT)
@plan_options
@reporting
def plan(ctx: click.Context, images: tuple[str, ...], flavor: str | None,
         build_args: tuple[str, ...], base: str | None, wheels_dir: Path | None) -> Result:
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
    items, without, _, _ = _plan(settings_of(ctx), images, flavor, build_args, base,
                                 wheels_dir, False)
    data = [{"image": i.image.name, "flavor": i.flavor, "action": i.action, "reason": i.reason,
             "input_hash": i.input_hash, "inputs": i.inputs} for i in items]
    return Result({"images": data}, _plan_lines(items, without))


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
          force: bool, no_cache: bool, secrets: tuple[str, ...]) -> Result:
    """Build the images whose inputs changed (all when none are named) with BuildKit.

    Tags each with its version, the git revision (-dirty when the tree is) and
    latest, on the configured registry; `imgpipe push` sends them.  The engine is
    not called for images that are up to date.

    \b
    Examples:
      imgpipe build bert && imgpipe push
      imgpipe build bert --flavor cpu --base imgpipe/debian-python:bookworm --wheels /opt/wheels
    """
    settings = settings_of(ctx)
    items, without, _, wheels = _plan(settings, images, flavor, build_args, base, wheels_dir,
                                      force)
    secret_paths = {k: Path(v) for k, v in _pairs(secrets, "--secret").items()}
    unknown = set(secret_paths) - {"ca_bundle", "pip_config", "ngc_api_key"}
    if unknown:
        raise click.BadParameter(f"unknown secret {sorted(unknown)[0]!r} (ca_bundle, "
                                 "pip_config or ngc_api_key)", param_hint="--secret")
    progress = Progress(choose_mode(invocation(ctx).json))
    outcomes = []
    client = None
    rev = revision(settings.path(settings.images_dir))
    for item in items:
        if item.action == "up to date":
            progress.step(f"{item.key}: up to date ({item.reason})")
            outcomes.append(skipped(item))
            continue
        client = client or find_build_client(settings.docker.client, settings.docker.host)
        outcomes.append(build_item(settings, client, item, rev, progress, wheels_dir=wheels,
                                   secret_overrides=secret_paths, cache=not no_cache))
    lines = [f"{o.image}/{o.flavor}: {o.action}"
             + (f" {o.image_id[:19]} in {o.seconds:.1f} s" if o.image_id else "")
             for o in outcomes]
    lines += [f"{image.name}: skipped ({why})" for image, why in without]
    return Result({"images": outcomes, "engine_called": client is not None}, lines)


@click.command(context_settings=CONTEXT)
@click.argument("images", nargs=-1, metavar="[IMAGE]...")
@click.option("--convert", "then_convert", is_flag=True,
              help="Then convert each pushed image into a squashfs file (imgpipe convert).")
@reporting
def push(ctx: click.Context, images: tuple[str, ...], then_convert: bool) -> Result:
    """Push what `imgpipe build` built and record the digests in imgpipe.lock.

    Pushes every tag, reads the manifest digest back from the registry, checks
    that its config is the image that was built, and writes imgpipe.lock
    atomically (a failed push leaves it as it was).

    \b
    Example:
      imgpipe build bert && imgpipe push
    """
    settings = settings_of(ctx)
    records = read_records(settings)
    lock = read_lock(lock_path(settings.root))
    if images:
        catalog = load_catalog(settings)
        select(catalog, images)  # unknown names are an error
        chosen = [r for r in records.values() if r.image in images]
        missing = sorted(set(images) - {r.image for r in chosen})
        if missing:
            raise ImgpipeError(f"{missing[0]} has not been built here",
                               hint=f"imgpipe build {missing[0]}")
    else:
        chosen = list(records.values())
    pending = [r for r in chosen
               if (e := lock.entry(r.image, r.flavor)) is None or e.input_hash != r.input_hash]
    if not pending:
        return Result({"images": []}, ["nothing to push: imgpipe.lock is up to date"])
    registry = registry_client(settings)
    registry.ping()
    client = find_build_client(settings.docker.client, settings.docker.host)
    progress = Progress(choose_mode(invocation(ctx).json))
    outcomes = [push_record(client, registry, record, lock_path(settings.root), progress)
                for record in pending]
    lines = [f"{o.image}/{o.flavor}: {o.pinned}" for o in outcomes]
    squashfs = {}
    if then_convert:
        from imgpipe.cli.convert import convert_and_record

        for outcome in outcomes:
            done = convert_and_record(settings, outcome.image, outcome.flavor, None, False,
                                      progress)
            squashfs[f"{outcome.image}/{outcome.flavor}"] = str(done.path)
            lines.append(f"{outcome.image}/{outcome.flavor}: {done.path}")
    return Result({"images": outcomes, "lock": lock_path(settings.root),
                   "squashfs": squashfs}, lines)


def run_selftest(settings: Settings, image: Image, flavor: str, progress: Progress) -> str:
    records = read_records(settings)
    record = records.get(f"{image.name}/{flavor}")
    if record is None:
        raise ImgpipeError(f"{image.name}/{flavor} has not been built here",
                           hint=f"imgpipe build {image.name} --flavor {flavor}")
    if not image.spec.selftest:
        return "no self-test defined"
    client = find_build_client(settings.docker.client, settings.docker.host)
    progress.step(f"self-test {image.name}/{flavor}: {' '.join(image.spec.selftest)}")
    try:
        done = engine.run_in_container(client, record.image_id, list(image.spec.selftest),
                                       progress.detail, settings.build.selftest_timeout_s,
                                       f"self-test of {image.name}/{flavor}")
    finally:
        progress.done()
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "passed"


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
    [image] = select(load_catalog(settings), [image_name])
    flavor = flavor or settings.default_flavor
    summary = run_selftest(settings, image, flavor, Progress(choose_mode(invocation(ctx).json)))
    return Result({"image": image.name, "flavor": flavor, "result": summary},
                  [f"{image.name}/{flavor}: self-test passed: {summary}"])


@click.command(context_settings=CONTEXT)
@click.argument("source", metavar="SRC")
@click.argument("dest", metavar="[DEST]", required=False)
@reporting
def mirror(ctx: click.Context, source: str, dest: str | None) -> Result:
    """Copy an image (the NGC PyTorch base, say) into the head-node registry.

    Builds on worker nodes then pull it locally.  DEST is a repository:tag in
    the configured registry (default: SRC's repository and tag).

    \b
    Example:
      imgpipe mirror nvcr.io/nvidia/pytorch:24.05-py3
      imgpipe build bert --flavor ngc --base 127.0.0.1:5000/nvidia/pytorch:24.05-py3
    """
    settings = settings_of(ctx)
    src = Reference.parse(source, default_registry="docker.io")
    target = Reference.parse(dest or f"{src.repository}:{src.tag or 'latest'}",
                             default_registry=settings.registry.address)
    if target.registry != settings.registry.address:
        raise ConfigError(f"DEST must be in the configured registry {settings.registry.address}",
                          hint="give DEST as repository:tag")
    registry = registry_client(settings)
    registry.ping()
    docker_engine = Engine(settings.docker.host, timeout=600)
    progress = Progress(choose_mode(invocation(ctx).json))
    if docker_engine.image_id(source) is None:
        progress.step(f"pull {source}")
        try:
            docker_engine.pull(source)
        except EngineError as exc:
            raise ImgpipeError(exc.message,
                               hint="docker login to its registry, or check the name") from exc
    docker_engine.tag(source, f"{target.registry}/{target.repository}", target.tag or "latest")
    client = find_build_client(settings.docker.client, settings.docker.host)
    progress.step(f"push {target}")
    try:
        engine.push(client, str(target), progress.detail)
    finally:
        progress.done()
    digest = registry.manifest_digest(target.repository, target.reference)
    return Result({"source": source, "target": str(target), "digest": digest},
                  [f"mirrored {source} -> {target.canonical}@{digest}"])


@click.command(context_settings=CONTEXT)
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
              help="Flavor to build (default: default_flavor in imgpipe.yaml).")
@click.option("--wheels", "wheels_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Offer this folder of .whl files to the builds.")
@reporting
def ci(ctx: click.Context, flavor: str | None, wheels_dir: Path | None) -> Result:
    """What CI runs on every merge: plan, build what changed, self-test, push, lock.

    With nothing changed it does nothing and exits 0.

    \b
    Example (.github/workflows/images.yml runs this on the head node):
      imgpipe ci --flavor ngc
    """
    settings = settings_of(ctx)
    items, _, flavor, wheels = _plan(settings, (), flavor, (), None, wheels_dir, False)
    todo = [item for item in items if item.action == "build"]
    if not todo:
        return Result({"built": [], "pushed": []}, ["nothing changed: all images up to date"])
    registry = registry_client(settings)
    registry.ping()  # fail before an hour of building, not after
    progress = Progress(choose_mode(invocation(ctx).json))
    client = find_build_client(settings.docker.client, settings.docker.host)
    rev = revision(settings.path(settings.images_dir))
    built = [build_item(settings, client, item, rev, progress, wheels_dir=wheels,
                        secret_overrides={}) for item in todo]
    for item in todo:
        run_selftest(settings, item.image, flavor, progress)
    records = read_records(settings)
    pushed = [push_record(client, registry, records[item.key], lock_path(settings.root),
                          progress) for item in todo]
    lines = [f"{o.image}/{o.flavor}: {o.pinned}" for o in pushed]
    return Result({"built": built, "pushed": pushed}, lines)


COMMANDS = [plan, build, push, selftest, mirror, ci]
