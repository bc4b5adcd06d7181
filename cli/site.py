"""`imgpipe site init`: the site's config and cluster profile, from flags or questions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import get_args

import click

from imgpipe.base.config import EnrootConfig
from imgpipe.cli.clikit import CONTEXT, reporting
from imgpipe.cli.output import Result

DISTRIBUTIONS = list(get_args(EnrootConfig.model_fields["distribution"].annotation))

REQUIRED = {"registry": "the head node's registry, HOST[:PORT]",
            "squashfs_dir": "where squashfs files go (a shared folder, or node-local)",
            "partition": "the Slurm partition jobs run in",
            "data_root": "the shared folder for data, checkpoints and results"}


@click.group(context_settings=CONTEXT)
def site() -> None:
    """Set a site up: its config in /etc/imgpipe and its own cluster profile."""


@site.command(name="init", context_settings=CONTEXT)
@click.option("--registry", default=None, metavar="HOST[:PORT]", help=REQUIRED["registry"])
@click.option("--registry-ca", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The registry's TLS CA certificate (the site's CA).")
@click.option("--plain-http", is_flag=True, help="A registry without TLS.  imgpipe's importer "
              "fetches over http by itself; Enroot pulling imgpipe's images without the "
              "importer would need ENROOT_ALLOW_HTTP, which switches every registry to http.")
@click.option("--credentials", type=click.Choice(["netrc", "docker-config"]), default=None,
              help="A registry with logins (registry.credentials.source): each user's own "
              "login, read from the ~/.netrc (or ~/.docker/config.json) of whoever runs the "
              "command or the job (the nodes' importer too).  Needs TLS.")
@click.option("--squashfs-dir", type=click.Path(path_type=Path), default=None,
              help=REQUIRED["squashfs_dir"])
@click.option("--distribution", type=click.Choice(DISTRIBUTIONS), default=None,
              help="How images reach the nodes (enroot.distribution): shared (the folder is on "
              "a cluster file system; the default there), fetch, sbcast or broadcast (a node-local "
              "folder on every node; must be said for a folder on a local disk).")
@click.option("--pyxis-importer/--no-pyxis-importer", default=None,
              help="Whether the nodes' Pyxis line has importer= (node-config --accept "
              "importer): the recipes then pin images by digest, else squashfs files.")
@click.option("--cache-owner", default=None, metavar="ACCOUNT",
              help="The squashfs folder's service account (enroot.cache_owner): it owns the "
              "layout and its entries serve every user; on Lustre or NFS with root squash, "
              "it, not root, runs node-config --make-cache.")
@click.option("--partition", default=None, help=REQUIRED["partition"])
@click.option("--data-root", type=click.Path(path_type=Path), default=None,
              help=REQUIRED["data_root"])
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default="ngc", show_default=True)
@click.option("--profile-name", default="site", show_default=True)
@click.option("--from", "base_profile", default="dgx-h100", show_default=True,
              help="The shipped profile the site's starts from.")
@click.option("--gpus-per-node", type=click.IntRange(1, 64), default=None)
@click.option("--hcas", default=None, metavar="NAME,...", help="InfiniBand devices NCCL uses "
              "(as /sys/class/infiniband names them).")
@click.option("--cores-per-node", type=click.IntRange(1), default=None)
@click.option("--gpu-memory-gb", type=click.IntRange(0), default=None)
@click.option("--busbw-gbs", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The all-reduce bus bandwidth the fabric should reach.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("/etc/imgpipe/imgpipe.yaml"), show_default=True,
              help="Where the site config goes (profiles/ beside it).")
@click.option("--force", is_flag=True, help="Overwrite files that exist.")
@reporting
def init(ctx: click.Context, registry: str | None, registry_ca: Path | None, plain_http: bool,
         squashfs_dir: Path | None, partition: str | None, data_root: Path | None,
         flavor: str, profile_name: str, base_profile: str, gpus_per_node: int | None,
         hcas: str | None, cores_per_node: int | None, gpu_memory_gb: int | None,
         busbw_gbs: float | None, config_path: Path, force: bool, distribution: str | None,
         pyxis_importer: bool | None, cache_owner: str | None,
         credentials: str | None) -> Result:
    """Write the site config (/etc/imgpipe/imgpipe.yaml) and a site profile.

    On a terminal, what no flag gave is asked; otherwise every required flag must be given.

    \b
    Example (as root, on the login node):
      imgpipe site init --registry head:5000 --registry-ca /etc/pki/site-ca.crt \\
          --squashfs-dir /lustre/imgpipe/squashfs --partition gpu \\
          --data-root /lustre/bert --from dgx-h100 --hcas mlx5_0,mlx5_1,mlx5_2,mlx5_3
    """
    from imgpipe.commands.site.site import SiteAnswers, init_site

    given: dict[str, object] = {"registry": registry, "squashfs_dir": squashfs_dir,
                                "partition": partition, "data_root": data_root}
    for key, what in REQUIRED.items():
        if given[key] is None and sys.stdin.isatty():
            given[key] = click.prompt(what.capitalize(),
                                      type=Path if key.endswith(("dir", "root")) else str)
    missing = [f"--{key.replace('_', '-')}" for key, value in given.items() if value is None]
    if missing:
        raise click.UsageError(f"say {', '.join(missing)} (or run it on a terminal to be "
                               "asked)")
    written = init_site(SiteAnswers(
        registry=str(given["registry"]), squashfs_dir=Path(str(given["squashfs_dir"])),
        partition=str(given["partition"]), data_root=Path(str(given["data_root"])),
        ca_file=registry_ca, plain_http=plain_http, flavor=flavor, profile=profile_name,
        base_profile=base_profile, gpus_per_node=gpus_per_node,
        hcas=hcas.split(",") if hcas else None, cores_per_node=cores_per_node,
        gpu_memory_gb=gpu_memory_gb, busbw_gbs=busbw_gbs, config=config_path,
        overwrite=force, distribution=distribution, pyxis_importer=pyxis_importer,
        cache_owner=cache_owner, credentials=credentials))
    return Result({"written": [str(p) for p in written]},
                  ([f"wrote {p}" for p in written] or [f"{config_path}: as answered already"]) + [
                      f"next: imgpipe recipes profile check {profile_name} (on a compute "
                      "node), imgpipe node-config --check (on each node)"])
