"""`imgpipe sandbox up|down|status`: a head node and compute nodes on this machine.

The same cluster the tests run recipes on (``imgpipe.recipes.sandbox``): each host a network
namespace with its own name and address, slurmctld on ``head``, one slurmd per ``nodeN``.
Users submit from the head host, as on a login node:

    imgpipe sandbox up
    imgpipe sandbox run -- sbatch -N2 build/recipes/dataset.sub
    imgpipe sandbox down
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

from imgpipe.base import process
from imgpipe.base.files import atomic_write
from imgpipe.base.platforms import Platform
from imgpipe.cli.clikit import CONTEXT, reporting, settings_of
from imgpipe.cli.output import Result
from imgpipe.commands.builds.sandbox import (
    MAX_COMPUTE_NODES,
    Sandbox,
    SandboxError,
    SandboxSpec,
    has_pyxis,
    registry_data,
    with_pyxis,
)

DEFAULT_SUBNET = "10.213.7"
DEFAULT_NAME = "imgp"
SHARED_FILE = "shared.json"  # a same-named sandbox of another checkout that `up` uses


def _sandbox(ctx: click.Context, nodes: int = 2, subnet: str = DEFAULT_SUBNET,
             cpus: int | None = None, name: str = DEFAULT_NAME, platforms: str = "",
             registry_rate: str = "", pyxis: bool = False, importer: str = "") -> Sandbox:
    settings = settings_of(ctx)
    root = settings.path(settings.outputs.state_dir) / "sandbox"
    root.mkdir(parents=True, exist_ok=True)
    spec = SandboxSpec(root=root, name=name, subnet=subnet, compute_nodes=nodes,
                       cpus=cpus or max(2, os.cpu_count() or 2), platforms=platforms,
                       registry_rate=registry_rate)
    return Sandbox(with_pyxis(spec, importer) if pyxis else spec)


def _own(ctx: click.Context) -> Sandbox:
    """The sandbox this checkout started, as ``up`` made it (its spec is kept in its state),
    else the default one."""
    default = _sandbox(ctx)
    return Sandbox.saved(default.root) or default


def _pointer(ctx: click.Context) -> Path:
    """Where ``up`` notes a same-named sandbox of another checkout that it uses."""
    return _sandbox(ctx).root / SHARED_FILE


def _saved(ctx: click.Context) -> Sandbox:
    """The sandbox commands here act on: this checkout's own, else the live one of another
    checkout that ``up`` found and uses."""
    own = _own(ctx)
    if own.is_up():
        return own
    try:
        shared = Sandbox.saved(Path(json.loads(_pointer(ctx).read_text())["root"]))
    except (OSError, ValueError, KeyError, TypeError):
        shared = None
    return shared if shared is not None and shared.is_up() else own


def _use_other(ctx: click.Context, cluster: Sandbox) -> Sandbox | None:
    """A live sandbox of this name started from another folder (a second checkout on the
    same machine): used as it is when it has the asked shape, refused otherwise."""
    if cluster.is_up():
        return None
    other = Sandbox.running_named(cluster.spec.name)
    if other is None or other.root == cluster.root:
        return None
    spec, theirs = cluster.spec, other.spec
    if (theirs.compute_nodes, theirs.subnet) != (spec.compute_nodes, spec.subnet):
        raise SandboxError(
            f"a sandbox named {spec.name!r} is running already from {other.root} with "
            f"{theirs.compute_nodes} compute host{'s' if theirs.compute_nodes != 1 else ''} "
            f"on {theirs.subnet}.0/24",
            hint=f"use it as it is (--nodes {theirs.compute_nodes} --subnet {theirs.subnet}), "
            "stop it with 'imgpipe sandbox down' there, or pick another --name and --subnet")
    atomic_write(_pointer(ctx), json.dumps({"name": spec.name, "root": str(other.root)}) + "\n")
    return other


def _lines(sandbox: Sandbox, state: dict) -> list[str]:
    if not state.get("hosts"):
        return ["sandbox: down"]
    lines = [f"sandbox: {'up' if state['up'] else 'broken (run: imgpipe sandbox down)'}"]
    nodes = state.get("nodes", {})
    for host in state["hosts"]:
        role = "slurmctld" if host["name"] == "head" else nodes.get(host["name"], "?")
        lines.append(f"  {host['name']:<6} {host['address']:<14} {role}")
    if state.get("pyxis"):
        importer = state.get("importer") or "none (Enroot imports)"
        lines.append(f"containers: Pyxis with Enroot on every node; importer {importer}")
    if state.get("registry"):
        lines.append(f"registry: {state['registry']} (the local registry's images, read-only)")
    lines.append(f"submit from the head host: imgpipe sandbox run -- sbatch ...  "
                 f"(or: export SLURM_CONF={sandbox.conf})")
    return lines


@click.group(context_settings=CONTEXT)
def sandbox() -> None:
    """A local Slurm cluster to try recipes on before a real one (needs root).

    A head host and compute hosts, each a network namespace with its own hostname and
    address on a private /24 that never leaves the machine; slurmctld on the head, one
    slurmd per node, one munged.  State under outputs.state_dir/sandbox.

    \b
    Examples:
      imgpipe sandbox up --nodes 2
      imgpipe recipes render --profile local --nodes 2 --runtime charliecloud -o r
      imgpipe sandbox run -- sbatch -N2 --ntasks-per-node=1 r/dataset.sub
      imgpipe sandbox status
      imgpipe sandbox down
    """


@sandbox.command(name="up", context_settings=CONTEXT)
@click.option("--nodes", type=click.IntRange(1, MAX_COMPUTE_NODES), default=2, show_default=True,
              help="Compute hosts (node1..nodeN).")
@click.option("--subnet", default=DEFAULT_SUBNET, show_default=True, metavar="A.B.C",
              help="The private /24 (first three octets); refused if any route covers it.")
@click.option("--cpus", type=click.IntRange(1, 512), default=None,
              help="CPUs each node offers to Slurm [default: this machine's, at least 2].")
@click.option("--name", default=DEFAULT_NAME, show_default=True,
              help="Prefix of its namespaces and links (1-6 letters or digits).")
@click.option("--node-platform", "node_platforms", multiple=True, metavar="NODE=OS/ARCH",
              help="A compute host that stands for another platform, e.g. node2=linux/arm64: "
              "its Slurm node carries the feature (arm64), its jobs get IMGPIPE_PLATFORM and "
              "run that platform's images under emulation (needs qemu-user-static).")
@click.option("--registry-rate", default="", metavar="RATE",
              help="Limit the head host's link (its registry's egress) to RATE, e.g. 1gbit, "
              "so that what the registry serves shows in time (tc's token bucket).")
@click.option("--pyxis/--no-pyxis", default=None,
              help="Load Pyxis (and so Enroot) on every compute host, through the plugstack "
              "line node-config renders [default: when this machine has both; ./setup.sh "
              "builds them].")
@click.option("--importer", default="", metavar="PATH",
              help="Pyxis's importer= on that line: imgpipe-pyxis-importer of a venv every "
              "job user can run [default: none, Enroot imports].")
@click.option("--serve-registry", is_flag=True,
              help="The head host serves the local registry's images (imgpipe registry up) "
              "read-only as head:5000, for jobs pinned to a digest.")
@reporting
def up_command(ctx: click.Context, nodes: int, subnet: str, cpus: int | None,
               name: str, node_platforms: tuple[str, ...], registry_rate: str,
               pyxis: bool | None, importer: str, serve_registry: bool) -> Result:
    """Start the cluster and wait until every node is idle (kept if already up).

    \b
    A Pyxis cluster whose jobs run `srun --container-image=head:5000#REPO@DIGEST`:
      imgpipe sandbox up --serve-registry \\
        --importer /opt/imgpipe/bin/imgpipe-pyxis-importer

    \b
    A mixed cluster (x86 beside Grace), node2 an arm64 host:
      imgpipe sandbox up --node-platform node2=linux/arm64
      imgpipe sandbox run -- sbatch --constraint=arm64 run.sub

    A sandbox of the same name that another checkout started on this machine is used as
    it is (same --nodes and --subnet), and left running by `sandbox down` here.
    """
    for pair in node_platforms:
        node, _, platform = pair.partition("=")
        if not node.startswith("node") or not platform:
            raise click.BadParameter(f"{pair!r} is not NODE=OS/ARCH (node2=linux/arm64)",
                                     param_hint="--node-platform")
        Platform.parse(platform)
    if pyxis is None:
        pyxis = has_pyxis()
    if importer and not (Path(importer).is_file() and os.access(importer, os.X_OK)):
        raise click.BadParameter(f"{importer} is no program", param_hint="--importer")
    if importer and not pyxis:
        raise click.BadParameter("an importer needs Pyxis (drop --no-pyxis)",
                                 param_hint="--importer")
    storage = registry_data(settings_of(ctx)) if serve_registry else None
    cluster = _sandbox(ctx, nodes, subnet, cpus, name, ",".join(node_platforms),
                       registry_rate, pyxis, str(Path(importer).absolute()) if importer else "")
    other = _use_other(ctx, cluster)
    if other is not None:
        state = {**other.status(), "started_here": False, "owner": str(other.root)}
        return Result(state, [f"sandbox {name!r} is up already, started from {other.root}: "
                              "using it (`imgpipe sandbox down` here leaves it running)",
                              *_lines(other, state)])
    _pointer(ctx).unlink(missing_ok=True)
    cluster.up(registry_storage=storage)
    state = {**cluster.status(), "started_here": True, "owner": str(cluster.root)}
    return Result(state, _lines(cluster, state))


@sandbox.command(name="down", context_settings=CONTEXT)
@reporting
def down_command(ctx: click.Context) -> Result:
    """Cancel its jobs, stop its daemons, remove its namespaces (safe to repeat).

    Only a sandbox started from here: one that `up` found running from another checkout
    is left running.
    """
    shared = _saved(ctx)
    cluster = _own(ctx)
    _pointer(ctx).unlink(missing_ok=True)
    if shared.root != cluster.root:
        return Result({"up": True, "stopped": False, "owner": str(shared.root)},
                      [f"sandbox {shared.spec.name!r} was started from {shared.root}: "
                       "left running (stop it there)"])
    cluster.down()
    return Result({"up": False, "stopped": True}, ["sandbox: down"])


@sandbox.command(name="status", context_settings=CONTEXT)
@reporting
def status_command(ctx: click.Context) -> Result:
    """Daemons, hosts with their addresses, and each node's Slurm state."""
    cluster = _saved(ctx)
    state = cluster.status()
    return Result(state, _lines(cluster, state), ok=bool(state.get("up")))


@sandbox.command(name="run", context_settings={**CONTEXT, "ignore_unknown_options": True})
@click.option("--user", default=None, help="Run it as this user (as on a login node).")
@click.option("--host", default="head", show_default=True, help="head or nodeN.")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, user: str | None, host: str, argv: tuple[str, ...]
                ) -> None:
    """Run a command on a host of the cluster with its SLURM_CONF (sbatch, squeue, ...);
    exits with the command's status."""
    cluster = _saved(ctx)
    hosts = {h.name: h for h in cluster.spec.hosts}
    if host not in hosts:
        raise click.BadParameter(f"{host!r}: one of {', '.join(hosts)}", param_hint="--host")
    if not cluster.is_up():
        raise click.UsageError("the sandbox is not up: imgpipe sandbox up")
    command = cluster.on(hosts[host], list(argv), user)
    try:
        code = process.attached(command)
    except KeyboardInterrupt:
        code = 130
    if code:
        print(f"error: {shlex.join(argv)} exited {code}", file=sys.stderr)
    ctx.exit(code)
