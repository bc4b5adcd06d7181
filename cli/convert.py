"""`imgpipe convert` and `imgpipe node-config`: registry images as squashfs files for Enroot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import click

from imgpipe.base.config import deprecated
from imgpipe.base.platforms import Platform
from imgpipe.base.progress import Progress, choose_mode
from imgpipe.base.units import human_bytes
from imgpipe.cli.clikit import CONTEXT, invocation, parsed_by, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.builds.convert import Conversion, convert_and_record
from imgpipe.commands.registry.published import verify
from imgpipe.commands.site.nodeconfig import ACCEPTED_NAMES, node_setup, parse_version
from imgpipe.commands.site.nodeconfig import make_cache as setup_cache

if TYPE_CHECKING:
    from imgpipe.commands.site.nodecheck import NodePlan

COMPRESSION = click.Choice(["zstd", "lz4", "lzo-enroot", "none"])


def _lines(conversion: Conversion) -> list[str]:
    verb = (f"fetched published squashfs {conversion.published[:19]} in "
            f"{conversion.seconds:.1f} s" if conversion.published
            else f"converted in {conversion.seconds:.1f} s" if conversion.converted
            else "already converted")
    return [f"{conversion.reference}: {verb}",
            f"  {conversion.path} ({human_bytes(conversion.size)}, {conversion.compression})"]


@click.command(context_settings=CONTEXT)
@click.argument("target", metavar="IMAGE|REF")
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
              help="For an IMAGE of the catalog: which flavor's pushed digest.")
@click.option("--compression", type=COMPRESSION, default=None,
              help="zstd (default, level 3), lz4, lzo-enroot (Enroot's -comp lzo -noD, for "
              "kernels older than 4.14) or none.  Default: image.yaml, then imgpipe.yaml.")
@click.option("--with-enroot", is_flag=True,
              help="Let `enroot import` do the conversion, under the same cache and lock.")
@click.option("--no-published", is_flag=True,
              help="Convert even when a pinned squashfs is published beside the image "
              "(as enroot.published: false does for every command).")
@click.option("--no-prebuilt", "no_prebuilt", is_flag=True, hidden=True,
              help="The earlier name of --no-published.")
@click.option("--platform", "platform", default=None, metavar="OS/ARCH",
              help="Which platform's manifest of an index (linux/arm64 on an x86 head node: "
              "nothing of the target runs).  Default: this node's (IMGPIPE_PLATFORM, else "
              "uname -m).")
@click.option("-q", "--quiet", is_flag=True, help="Print the squashfs path alone, no "
              "progress (for scripts: CONT=$(imgpipe convert -q bert)).")
@reporting
def convert_command(ctx: click.Context, target: str, flavor: str | None,
                    compression: str | None, with_enroot: bool, no_published: bool,
                    no_prebuilt: bool, platform: str | None, quiet: bool) -> Result:
    """Convert an image into a squashfs file in outputs.squashfs_dir, once per digest.

    IMAGE is a catalog name (its digest is taken from imgpipe.lock, and the lock
    records the squashfs path and checksum); REF is any reference in the
    registry.  A digest already converted returns at once; concurrent runs,
    on one host or many sharing the directory, convert it once.

    A squashfs published beside the image (imgpipe push --squashfs) is fetched
    instead of converting when its digest is pinned: by imgpipe.lock, by
    IMGPIPE_SQUASHFS_PINS ("IMAGE_DIGEST=SQUASHFS_DIGEST ..."), or by
    `imgpipe verify`.  Unpinned ones are used only with enroot.published_unpinned.

    \b
    Examples:
      imgpipe convert bert
      imgpipe convert bert --platform linux/arm64
      imgpipe convert 127.0.0.1:5000/imgpipe/bert:latest-cpu --compression lz4
      CONT=$(imgpipe convert -q bert) && sbatch -N2 run.sub
    """
    if no_prebuilt:
        deprecated("--no-prebuilt is now --no-published")
        no_published = True
    settings = settings_of(ctx)
    progress = Progress(choose_mode(invocation(ctx).json or quiet))
    conversion = convert_and_record(settings, target, flavor or settings.default_flavor,
                                    compression, with_enroot, progress, no_published,
                                    Platform.parse(platform) if platform else None)
    return Result({"reference": conversion.reference, "digest": conversion.digest,
                   "squashfs": conversion.path, "converted": conversion.converted,
                   "seconds": round(conversion.seconds, 3), "size": conversion.size,
                   "compression": conversion.compression,
                   "fetched_bytes": conversion.fetched_bytes, "entries": conversion.entries,
                   "published": conversion.published,
                   "layers": conversion.layers},
                  [str(conversion.path)] if quiet else _lines(conversion))


convert_command.name = "convert"


@click.command(name="node-config", context_settings=CONTEXT)
@click.option("--pyxis-version", default=None, metavar="X.Y[.Z]", callback=parsed_by(parse_version),
              help="The nodes' Pyxis (default: read from the spank_pyxis.so found here).")
@click.option("--pyxis-plugin", default=None, metavar="PATH",
              help="Path of spank_pyxis.so on the nodes (default: the one found here, else "
              "/usr/local/lib/slurm/spank_pyxis.so).")
@click.option("--enroot", "enroot_path", default=None, metavar="PATH",
              help="Path of enroot on the nodes (default: the one on this PATH).")
@click.option("--importer", default=None, metavar="PATH",
              help="Importer path on the nodes (default: /usr/local/bin/imgpipe-pyxis-importer).")
@click.option("--no-squashfuse", is_flag=True, help="Leave out use_squashfuse=1 (Pyxis 0.22+), "
              "so jobs unpack images as before.")
@click.option("--make-cache", "make_cache", default=None, metavar="DIR", is_flag=False,
              flag_value="", help="As root (or enroot.cache_owner): set up the shared squashfs "
              "folder DIR (default: outputs.squashfs_dir) the safe way: 1777, its layout owned "
              "by root or the service account, never by a job user.  Idempotent.")
@click.option("--group", default=None, metavar="NAME", help="With --make-cache: a group of "
              "every job user; the folder is then 3775 instead of 1777.")
@click.option("--check", "check", is_flag=True, help="Read this node's own files "
              "(plugstack.conf, enroot.conf, Pyxis, the importer link, /etc/imgpipe) and print "
              "only what imgpipe needs there, as a diff; lines that would change the site's "
              "existing jobs are marked.")
@click.option("--apply", "apply", is_flag=True, help="As root: write imgpipe's own files that "
              "--check found missing (the site config, the importer link) and what --accept "
              "names, recording each file replaced or made.  Idempotent: a second run "
              "changes nothing.")
@click.option("--accept", type=click.Choice(list(ACCEPTED_NAMES)), multiple=True,
              help="Take a line that changes the site's existing jobs (repeat for more): "
              "pyxis (a Pyxis line where the plugstack loads none), importer (importer= on "
              "the Pyxis line), container_scope (container_scope=job), squashfuse "
              "(use_squashfuse=1).  Without it each is printed commented out, marked.")
@click.option("--rollback", is_flag=True, help="As root: put back the files the last --apply "
              "replaced, and remove the ones it made (then restart slurmd).")
@click.option("--upgrade", is_flag=True, help="As root, with --venv NEW: point the importer "
              "link at a new imgpipe installed beside the one in use, in one rename (running "
              "steps finish on the old one, the next runs the new one); refused in one line, "
              "nothing changed, when a job user could not run it or its cache layout differs "
              "from the node's cache.  Recorded: --rollback puts the old link back.")
@click.option("--remove", is_flag=True, help="As root: take back what imgpipe put on the node "
              "(its Pyxis line or importer= option, the importer link, /etc/imgpipe/"
              "imgpipe.yaml, its sudoers files, imgpipe-*.service units, its logrotate file, "
              "the node-local cache but what running jobs use), each file kept for "
              "--rollback; says what it leaves.")
@click.option("--shared-plugstack", is_flag=True, help="With --apply: the plugstack is on storage "
              "every node reads (NFS, Lustre), and imgpipe is on every node already: change "
              "it for all at once.")
@click.option("--plugstack", default=None, metavar="FILE", help="The plugstack slurmd reads "
              "(default: PlugStackConfig in slurm.conf, else plugstack.conf beside it).")
@click.option("--venv", "node_venv", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="With --check/--apply/--upgrade (which needs it): the node's "
              "imgpipe venv the importer "
              "link names (default: this imgpipe's on the node itself; /opt/imgpipe in a "
              "node image given with --root).")
@click.option("--site-config", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              default=None, help="With --check/--apply: the site config the node should "
              "have in /etc/imgpipe/imgpipe.yaml.")
@click.option("--root", "node_root", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/"), show_default=True,
              help="With --check/--apply/--upgrade/--remove/--rollback: the node's root (a "
              "node image, a chroot).")
@reporting
def node_config(ctx: click.Context, pyxis_version: tuple[int, int, int] | None,
                pyxis_plugin: str | None,
                enroot_path: str | None, importer: str | None, no_squashfuse: bool,
                make_cache: str | None, group: str | None, check: bool, apply: bool,
                accept: tuple[str, ...], rollback: bool, upgrade: bool, remove: bool,
                shared_plugstack: bool,
                plugstack: str | None,
                node_venv: Path | None, site_config: Path | None, node_root: Path) -> Result:
    """Print what compute nodes need for imgpipe, and check or set up a node.

    Only imgpipe's own files are needed (the site config, the importer link); every line
    that would change what a cluster's existing jobs do (ENROOT_ALLOW_HTTP, SSL_CERT_FILE, a
    Pyxis line, importer=, container_scope=job, use_squashfuse=1) is printed commented out
    and marked with what it changes, unless --accept names it.  The options follow the
    nodes' Pyxis: importer= only for 0.21 and newer (older Pyxis fails on it),
    container_scope=job only where Pyxis's cleanup finds enroot, use_squashfuse=1 from
    0.22.  With importer=, images of other registries (nvcr.io, Docker Hub) are imported by
    enroot as Pyxis would, into Pyxis's runtime folder, removed when the step ends.

    \b
    Examples:
      imgpipe node-config --pyxis-version 0.24 --enroot /usr/bin/enroot > node-setup.txt
      imgpipe node-config --check                     # on a node: a diff of what it lacks
      imgpipe node-config --apply                     # as root: imgpipe's own files only
      imgpipe node-config --apply --accept importer   # and importer= on the site's line
      imgpipe node-config --rollback                  # as root: the last --apply undone
      imgpipe node-config --upgrade --venv /opt/imgpipe-2   # a new imgpipe while jobs run
      imgpipe node-config --remove                    # as root: imgpipe taken off the node
      imgpipe node-config --make-cache /lustre/imgpipe/squashfs
    """
    chosen = [name for name, on in (("--check", check), ("--apply", apply),
                                    ("--rollback", rollback), ("--upgrade", upgrade),
                                    ("--remove", remove)) if on]
    if len(chosen) > 1:
        raise click.UsageError(f"{' and '.join(chosen)}: one at a time")
    if make_cache is not None:
        return _make_cache(ctx, make_cache, group)
    if upgrade or remove:
        from imgpipe.commands.site.nodecheck import NodePlan

        return _upgrade_or_remove(ctx, upgrade, NodePlan(node_root, site_config, plugstack,
                                                         node_venv, frozenset(accept),
                                                         shared_plugstack))
    if rollback:
        from imgpipe.commands.site.nodebackup import rollback as roll_back

        done = roll_back(node_root)
        return Result({"rolled_back": done}, done)
    if check or apply:
        from imgpipe.commands.site.nodecheck import NodePlan

        return _check_or_apply(ctx, apply, NodePlan(node_root, site_config, plugstack,
                                                    node_venv, frozenset(accept),
                                                    shared_plugstack))
    rendered = node_setup(settings_of(ctx), pyxis_version, pyxis_plugin, enroot_path, importer,
                          squashfuse=not no_squashfuse, accept=frozenset(accept),
                          plugstack=plugstack)
    text = rendered.enroot_conf + "\n" + rendered.plugstack_conf + "\n" + rendered.install
    if rendered.credentials:
        text += "\n" + rendered.credentials
    return Result({"enroot_conf": rendered.enroot_conf,
                   "plugstack_conf": rendered.plugstack_conf,
                   "credentials": rendered.credentials,
                   "install": rendered.install,
                   "pyxis_version": rendered.pyxis_version,
                   "notes": rendered.notes,
                   "importer": rendered.importer_path}, text.rstrip("\n").splitlines())


def _upgrade_or_remove(ctx: click.Context, upgrade: bool, plan: NodePlan) -> Result:
    from imgpipe.base.configlayers import SITE_CONFIG
    from imgpipe.commands.site.config import parse_settings

    settings = settings_of(ctx)  # the node's own site config where it has one (--root)
    own = plan.site_config or plan.root / str(SITE_CONFIG).lstrip("/")
    if plan.root != Path("/") and own.is_file():
        settings = parse_settings(own)
    if upgrade:
        from imgpipe.commands.site.nodeupgrade import upgrade_node

        done = upgrade_node(settings, plan)
        return Result({"upgraded": done}, done)
    from imgpipe.commands.site.noderemove import remove_node

    removal = remove_node(settings, plan)
    return Result({"removed": removal.done, "kept": removal.kept},
                  (removal.done or ["nothing of imgpipe's to remove"])
                  + [f"kept {line}" for line in removal.kept])


def _check_or_apply(ctx: click.Context, apply: bool, plan: NodePlan) -> Result:
    from imgpipe.commands.site.nodecheck import apply_node, check_node

    settings = settings_of(ctx)
    if plan.site_config is not None:  # the node's lines follow the config it will have
        from imgpipe.commands.site.config import parse_settings

        settings = parse_settings(plan.site_config)
    done = apply_node(settings, plan) if apply else None
    checked = check_node(settings, plan)
    lines = [f"plugstack: {checked.plugstack[0]} ({checked.plugstack[1]})"]
    for finding in checked.findings:
        whose = "imgpipe's" if finding.ours else "the site's"
        lines.append(f"{finding.file} ({whose}): {finding.verdict}")
        lines += [f"  {line}" for line in finding.diff]
        if finding.affects and finding.verdict != "ok":
            lines.append(f"  ! changes existing jobs: {finding.affects}")
            if finding.safer:
                lines.append(f"  ! safer: {finding.safer}")
            if finding.accept and finding.accept not in plan.accept:
                lines.append(f"  ! written only with --accept {finding.accept}")
    if done is not None:
        lines += done or ["nothing to do: the node has what imgpipe needs"]
    else:
        need = [f for f in checked.needed if f.ours]
        lines.append(f"{len(need)} of imgpipe's own files to write (imgpipe node-config "
                     "--apply)" if need else "imgpipe's own files are in place")
    data = {"findings": [asdict(f) for f in checked.findings],
            "pyxis": {"plugin": checked.pyxis[0], "version": ".".join(map(str, checked.pyxis[1]))}
            if checked.pyxis else None, "applied": done}
    return Result(data, lines)


def _make_cache(ctx: click.Context, folder: str, group: str | None) -> Result:
    if group is not None:
        import grp

        try:
            grp.getgrnam(group)
        except KeyError:
            raise click.BadParameter(f"no group {group!r} on this host",
                                     param_hint="--group") from None
    root, done, owners = setup_cache(settings_of(ctx), folder, group)
    lines = done or [f"{root}: set up already"]
    return Result({"squashfs_dir": str(root), "changes": done},
                  [*lines, f"{root}: ready for every job user (owner {owners})"])


@click.command(name="verify", context_settings=CONTEXT)
@click.argument("target", metavar="IMAGE|REF")
@click.option("--flavor", type=click.Choice(["ngc", "cpu"]), default=None,
              help="For an IMAGE of the catalog: which flavor's pushed digest.")
@click.option("--compression", type=COMPRESSION, default=None,
              help="Which published squashfs to check (default: as `imgpipe convert`).")
@reporting
def verify_command(ctx: click.Context, target: str, flavor: str | None,
                   compression: str | None) -> Result:
    """Convert an image here and compare it byte for byte with its published squashfs.

    Conversion is deterministic, so a squashfs published beside an image (imgpipe
    push --squashfs) must equal what any cache converts from the same layers.
    This converts in a private area (never from a published file), compares with
    every squashfs published for the digest in that compression, and exits 1
    naming both digests on a mismatch.  For an IMAGE of the catalog a match is
    pinned in imgpipe.lock, so this checkout's conversions and recipes then
    fetch the published file instead of converting.

    \b
    Example:
      imgpipe verify bert && imgpipe convert bert
    """
    settings = settings_of(ctx)
    progress = Progress(choose_mode(invocation(ctx).json))
    done = verify(settings, target, flavor or settings.default_flavor, compression, progress)
    return Result({"reference": done.reference, "digest": done.digest,
                   "compression": done.compression, "local": done.local,
                   "published": done.published, "seconds": round(done.seconds, 3)},
                  [f"{done.reference}: published squashfs {done.local} ({done.compression}) "
                   f"equals a local conversion ({done.seconds:.1f} s)"])


COMMANDS = [convert_command, node_config, verify_command]
