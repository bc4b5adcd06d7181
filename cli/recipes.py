"""`imgpipe recipes …`: Slurm jobs for a cluster shape, pinned to the pushed bytes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import cast

import click

from imgpipe.base.platforms import Platform
from imgpipe.base.progress import Progress, choose_mode
from imgpipe.cli.clikit import CONTEXT, invocation, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.builds.recipes import (
    RUNTIMES,
    Runtime,
    publish_recipes,
    pull_recipes,
    render_recipes,
    shape_table,
    site_profile,
)


@click.group(context_settings=CONTEXT)
def recipes() -> None:
    """Slurm recipes (Pyxis srun/sbatch) for BERT training, dataset preparation and NCCL checks.

    \b
    Examples:
      imgpipe recipes table --profile dgx1 --max-nodes 16
      imgpipe recipes render --profile dgx-h100 --nodes 4 --flavor ngc -o ~/bert
      source ~/bert/config_4x8x2048x8.sh && sbatch -N"$DGXNNODES" \\
          --ntasks-per-node="$DGXNGPU" ~/bert/run.sub
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
    profile = site_profile(settings, profile_name)
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
@click.option("--platform", "platform", default=None, metavar="OS/ARCH",
              help="For a partition of one architecture: pin that platform's image alone.  "
              "Default: every platform of bert's index, each node taking its own.")
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
              help="Extra environment for every job (repeatable).")
@reporting
def render(ctx: click.Context, profile_name: str, nodes: int, phase: str, output: Path | None,
           runtime: str, adjust_global_batch: bool, image: str | None, flavor: str | None,
           platform: str | None, env: tuple[str, ...]) -> Result:
    """Render run.sub, dataset.sub, nccl.sub and config_<N>x<G>x<B>x<A>.sh for a shape.

    The image is pinned to the digest imgpipe.lock recorded (its squashfs file
    when one was converted), never to a tag.  An image built for several
    platforms is pinned per platform: run.sub picks the node's (IMGPIPE_PLATFORM,
    else uname -m), so one bundle serves x86 and Grace partitions.
    SELFTEST=only sbatch -N4 run.sub runs the image's self-test on each node.

    \b
    Example:
      imgpipe recipes render --profile dgx1 --nodes 16 --phase 1 -o /lustre/bert/recipes
    """
    settings = settings_of(ctx)
    extra = {}
    for item in env:
        name, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--env")
        extra[name] = value
    phases = (1, 2) if phase == "both" else (int(phase),)
    folder, bundle = render_recipes(settings, site_profile(settings, profile_name), nodes,
                                    cast(Runtime, runtime),  # a click.Choice of RUNTIMES
                                    phases, output, image, flavor, extra, adjust_global_batch,
                                    Progress(choose_mode(invocation(ctx).json)),
                                    Platform.parse(platform) if platform else None)
    lines = [f"rendered {len(bundle.files)} files in {folder} (image {bundle.image})"]
    lines += [f"  {p.name}" for p in bundle.files]
    for shape in bundle.shapes:
        lines.append(f"phase {shape.phase}: source {folder / shape.config_name} && sbatch "
                     f"-N{shape.nodes} --ntasks-per-node={shape.gpus_per_node} "
                     f"{folder / 'run.sub'}")
    return Result({"folder": folder, "files": bundle.files, "image": bundle.image,
                   "shapes": bundle.shapes}, lines)


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
    target, digest, names = publish_recipes(settings_of(ctx), folder, name)
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
    target, paths = pull_recipes(settings_of(ctx), name, output)
    return Result({"target": str(target), "files": paths},
                  [f"pulled {target} into {output}:"] + [f"  {p.name}" for p in paths])


@recipes.group(context_settings=CONTEXT)
def profile() -> None:
    """Cluster profiles: the shape of a site's nodes (GPUs, HCAs, cores, partition).

    \b
    Examples:
      imgpipe recipes profile list
      imgpipe recipes profile new h100-ours --from dgx-h100 -o /etc/imgpipe/profiles
      imgpipe recipes profile check h100-ours      # on a compute node
    """


@profile.command(name="list", context_settings=CONTEXT)
@reporting
def profile_list(ctx: click.Context) -> Result:
    """Every shipped profile and the site's own (recipes.profiles_dir)."""
    from imgpipe.commands.site.profiles import known_profiles

    known = known_profiles(settings_of(ctx))
    width = max(len(name) for name, _ in known)
    return Result({"profiles": [{"name": n, "description": d} for n, d in known]},
                  [f"{name:<{width}}  {description}" for name, description in known])


@profile.command(name="new", context_settings=CONTEXT)
@click.argument("name")
@click.option("--from", "base", default="dgx-h100", show_default=True,
              help="The profile to start from.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for NAME.yaml [default: recipes.profiles_dir].")
@reporting
def profile_new(ctx: click.Context, name: str, base: str, output: Path | None) -> Result:
    """Write NAME.yaml, a copy of another profile to edit for the site's nodes.

    \b
    Example:
      imgpipe recipes profile new h100-ours --from dgx-h100 -o /etc/imgpipe/profiles
    """
    from imgpipe.commands.site.profiles import new_profile

    path = new_profile(settings_of(ctx), name, base, output)
    return Result({"profile": name, "path": str(path)},
                  [f"wrote {path}: edit it, then run `imgpipe recipes profile check {name}` "
                   "on a compute node"])


@profile.command(name="check", context_settings=CONTEXT)
@click.argument("name")
@reporting
def profile_check(ctx: click.Context, name: str) -> Result:
    """Compare profile NAME with the node this runs on: Slurm's partitions (sinfo),
    InfiniBand devices (/sys/class/infiniband), GPUs (nvidia-smi) and cores.  Exits 1 when
    anything differs, naming each mismatch.

    \b
    Example:
      srun -N1 -p gpu imgpipe recipes profile check h100-ours
    """
    from imgpipe.commands.site.profiles import check_profile

    checked = check_profile(settings_of(ctx), name)
    lines = [f"mismatch: {line}" for line in checked.mismatches]
    lines += [f"ok: {line}" for line in checked.matched]
    lines += [f"not checked: {line}" for line in checked.unchecked]
    lines.append(f"profile {name}: " + ("matches this node" if checked.ok else
                                        f"{len(checked.mismatches)} mismatch(es)"))
    return Result(asdict(checked) | {"ok": checked.ok}, lines, ok=checked.ok)
