"""`imgpipe recipes …`: Slurm jobs for a cluster shape, pinned to the pushed bytes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import cast

import click

from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError
from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.wiring import registry_client, registry_credentials
from imgpipe.pipeline.lock import lock_path, read_lock
from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle
from imgpipe.recipes.runtimes import RUNTIMES, Runtime
from imgpipe.recipes.scaling import table as shape_table
from imgpipe.registry.reference import Reference


def _profiles_dir(settings: Settings) -> Path | None:
    folder = settings.recipes.profiles_dir
    return settings.path(folder) if folder else None


def _pin(settings: Settings, image: str, flavor: str, required: bool = True) -> str | None:
    """The squashfs file of the image's pushed digest when it exists, else the digest;
    None for an image never pushed that the recipes can do without (``required=False``)."""
    lock = read_lock(lock_path(settings.root))
    entry = (lock.require(image, flavor, "to pin (or pass --image)") if required
             else lock.entry(image, flavor))
    if entry is None:
        return None
    squashfs = entry.squashfs_file()
    return str(squashfs) if squashfs else str(entry.reference)


def _refuse_loopback(pinned: str, profile_name: str) -> None:
    """Compute nodes pull from the registry themselves: 127.0.0.1 is each node's own."""
    if pinned.startswith(("/", "./")) or profile_name == "local":
        return
    host = Reference.parse(pinned).registry.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "::1") or host.startswith("127."):
        raise ConfigError(f"the pinned image {pinned} is on {host}, which compute nodes "
                          "cannot reach",
                          hint="set registry.host in imgpipe.yaml to the head node's name, "
                          "push again, or convert it and pin the squashfs file")


@click.group(context_settings=CONTEXT)
def recipes() -> None:
    """Slurm recipes (Pyxis srun/sbatch) for BERT training, dataset preparation and NCCL checks.

    \b
    Examples:
      imgpipe recipes table --profile dgx1 --max-nodes 16
      imgpipe recipes render --profile dgx-h100 --nodes 4 -o recipes/
      source recipes/config_4x8x2048x8.sh && sbatch -N"$DGXNNODES" \\
          --ntasks-per-node="$DGXNGPU" recipes/run.sub
    """


@recipes.command(context_settings=CONTEXT)
@click.option("--profile", "profile_name", required=True, help="Cluster profile (dgx1, dgx2, "
              "dgx-a100, dgx-h100, local, or one in recipes.profiles_dir).")
@click.option("--max-nodes", type=click.IntRange(1, 4096), default=16, show_default=True)
@reporting
def table(ctx: click.Context, profile_name: str, max_nodes: int) -> Result:
    """Per-GPU batch, micro-batch, accumulation and learning rate for 1…N nodes.

    The global batch stays fixed (65536 in phase 1, 32768 in phase 2), so every
    shape converges like the published recipe.
    """
    settings = settings_of(ctx)
    profile = load_profile(profile_name, _profiles_dir(settings))
    shapes = shape_table(profile, max_nodes)
    lines = [f"{'nodes':>5} {'gpus':>5} {'phase':>5} {'global':>7} {'per-gpu':>7} "
             f"{'micro':>5} {'accum':>5} {'lr':>7} {'warmup':>7} {'steps':>6}  config"]
    for s in shapes:
        lines.append(f"{s.nodes:>5} {s.gpus:>5} {s.phase:>5} {s.global_batch:>7} "
                     f"{s.per_gpu_batch:>7} {s.micro_batch:>5} {s.accumulation:>5} "
                     f"{s.learning_rate:>7g} {s.warmup_proportion:>7g} {s.max_steps:>6}  "
                     f"{s.config_name}")
    rows = [{**asdict(s), "gpus": s.gpus, "config_name": s.config_name} for s in shapes]
    return Result({"profile": profile.name, "shapes": rows}, lines)


@recipes.command(context_settings=CONTEXT)
@click.option("--profile", "profile_name", required=True, help="Cluster profile.")
@click.option("--nodes", type=click.IntRange(1, 4096), required=True)
@click.option("--phase", type=click.Choice(["1", "2", "both"]), default="both",
              show_default=True, help="Which phase's config files to render.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the bundle (default: outputs.recipes_dir/PROFILE-Nn).")
@click.option("--runtime", type=click.Choice(list(RUNTIMES)), default="pyxis",
              show_default=True, help="pyxis: srun --container-image (Enroot); charliecloud: "
              "srun ch-run on the squashfs file; host: the same steps with software installed "
              "on the nodes.")
@click.option("--adjust-global-batch", is_flag=True, help="Let a GPU count that does not "
              "divide the global batch (3, 12, 24 nodes) round it down to a multiple.")
@click.option("--image", default=None, help="Pin this image instead of bert's from "
              "imgpipe.lock (a squashfs path or host:port/repo@sha256:…).")
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None)
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="Extra environment for every job (repeatable).")
@reporting
def render(ctx: click.Context, profile_name: str, nodes: int, phase: str, output: Path | None,
           runtime: str, adjust_global_batch: bool, image: str | None, flavor: str | None,
           env: tuple[str, ...]) -> Result:
    """Render run.sub, dataset.sub, nccl.sub and config_<N>x<G>x<B>x<A>.sh for a shape.

    The image is pinned to the digest imgpipe.lock recorded (its squashfs file
    when one was converted), never to a tag.

    \b
    Example:
      imgpipe recipes render --profile dgx1 --nodes 16 --phase 1 -o /lustre/bert/recipes
    """
    settings = settings_of(ctx)
    profile = load_profile(profile_name, _profiles_dir(settings))
    if flavor is None and image is None and profile.is_gpu and settings.default_flavor == "cpu":
        raise ConfigError(f"{profile.name} is a GPU profile but the default flavor is cpu",
                          hint="pass --flavor ngc (or --flavor cpu to mean it), or set "
                          "default_flavor: ngc in imgpipe.yaml")
    flavor = flavor or settings.default_flavor
    pinned = image or _pin(settings, "bert", flavor) or ""
    _refuse_loopback(pinned, profile.name)
    extra = {}
    for item in env:
        name, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--env")
        extra[name] = value
    recipes_cfg = settings.recipes
    inputs = RecipeInputs(
        profile=profile, nodes=nodes, image=pinned, runtime=cast(Runtime, runtime),  # a Choice
        nccl_image=_pin(settings, "nccl-tests", "ngc", required=False) if profile.is_gpu else None,
        data_dir=recipes_cfg.data_dir, checkpoint_dir=recipes_cfg.checkpoint_dir,
        results_dir=recipes_cfg.results_dir, dataset_source=recipes_cfg.dataset_source,
        vocab=recipes_cfg.vocab, bert_config=recipes_cfg.bert_config,
        partition=recipes_cfg.partition,
        walltime_minutes=recipes_cfg.walltime_minutes, env=extra,
        adjust_global_batch=adjust_global_batch)
    folder = output or settings.path(settings.outputs.recipes_dir) / f"{profile.name}-{nodes}n"
    phases = (1, 2) if phase == "both" else (int(phase),)
    bundle = render_bundle(inputs, folder, phases)
    lines = [f"rendered {len(bundle.files)} files in {folder} (image {bundle.image})"]
    lines += [f"  {p.name}" for p in bundle.files]
    for shape in bundle.shapes:
        lines.append(f"phase {shape.phase}: source {folder / shape.config_name} && sbatch "
                     f"-N{shape.nodes} --ntasks-per-node={shape.gpus_per_node} "
                     f"{folder / 'run.sub'}")
    return Result({"folder": folder, "files": bundle.files, "image": bundle.image,
                   "shapes": bundle.shapes}, lines)


def _bundle_target(settings: Settings, name: str | None, tag: str | None) -> Reference:
    """NAME[:TAG] in the configured registry; default: bert's repository, -recipes, its tag."""
    if name:
        return Reference.parse(name, default_registry=settings.registry.address)
    entry = read_lock(lock_path(settings.root)).require(
        "bert", settings.default_flavor, "to publish the recipes beside (or pass --name)")
    repository = entry.reference.repository
    return Reference.parse(f"{repository}-recipes:{tag or entry.tags[0]}",
                           default_registry=settings.registry.address)


@recipes.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--name", default=None, metavar="REPO[:TAG]",
              help="Where to publish (default: bert's repository + -recipes, bert's tag).")
@reporting
def publish(ctx: click.Context, folder: Path, name: str | None) -> Result:
    """Push a rendered bundle to the registry as an OCI artifact, tagged like the image.

    \b
    Example:
      imgpipe recipes render --profile dgx1 --nodes 16 -o out && imgpipe recipes publish out
    """
    from imgpipe.recipes.publish import publish as push_bundle

    settings = settings_of(ctx)
    target = _bundle_target(settings, name, None)
    registry = settings.registry
    names = push_bundle(folder, target, registry.scheme, registry_credentials(settings),
                        str(settings.path(registry.ca_file)) if registry.ca_file else None)
    digest = registry_client(settings).manifest_digest(target.repository, target.reference)
    return Result({"target": str(target), "digest": digest, "files": names},
                  [f"published {len(names)} files to {target} ({digest})"])


@recipes.command(context_settings=CONTEXT)
@click.argument("name", metavar="NAME[:TAG]")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path),
              default=Path("."), show_default=True, help="Folder to write the bundle into.")
@reporting
def pull(ctx: click.Context, name: str, output: Path) -> Result:
    """Fetch a published bundle on the cluster and list what it holds.

    \b
    Example:
      imgpipe recipes pull imgpipe/bert-recipes:0.1.0 -o ~/bert && cat ~/bert/bundle.json
    """
    from imgpipe.recipes.publish import pull as fetch_bundle

    settings = settings_of(ctx)
    target = Reference.parse(name, default_registry=settings.registry.address)
    registry = settings.registry
    paths = fetch_bundle(target, output, registry_client(settings), registry.scheme,
                         registry_credentials(settings),
                         str(settings.path(registry.ca_file)) if registry.ca_file else None)
    return Result({"target": str(target), "files": paths},
                  [f"pulled {target} into {output}:"] + [f"  {p.name}" for p in paths])
