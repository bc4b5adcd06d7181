"""A real multi-host Slurm cluster on one machine, for trying recipes before a real cluster.

Each host is a network namespace with its own hostname (a UTS namespace per daemon),
address and ``/etc/hosts`` (``ip netns exec`` binds ``/etc/netns/NAME/hosts`` over
``/etc/hosts``), joined by veth pairs on a bridge.  The head host runs slurmctld (and,
when asked, the registry); each compute host runs its own ``slurmd -N NAME``; one
munged serves all of them (its socket is a file, which every namespace sees).

The addresses exist only inside these namespaces and on the bridge, whose own address
in the root namespace makes the whole range a connected route: traffic to it never
leaves the machine.  ``up`` refuses a range that any existing route already covers.

State (config, spool, logs, munge key, pids) lives in one folder; ``down`` reads it
back, so a cluster started by one process (``imgpipe sandbox up``) is stopped by
another, and stopping leaves nothing behind: jobs, daemons, job processes that
slurmstepd daemonized, namespaces, links and ``/etc/netns`` entries.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from imgpipe.base import process
from imgpipe.base.errors import ImgpipeError
from imgpipe.recipes.daemons import alive, kill_marked, stop_group, wait_for
from imgpipe.recipes.errors import SandboxError
from imgpipe.recipes.sandboxfiles import (
    MUNGE_SOCKET,
    Host,
    SandboxSpec,
    write_boot_script,
    write_config,
)

STATE_FILE = "sandbox.json"

__all__ = ["Host", "Sandbox", "SandboxError", "SandboxSpec", "running"]
REGISTRY_PORT = 5000
# A job of 32+ nodes (the fan-out bench) fits; each slurmd is about 10 MB of memory.
MAX_COMPUTE_NODES = 64


@dataclass
class State:
    """What ``up`` made, written to ``root/sandbox.json`` as it goes."""

    spec: dict[str, object]
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    netns_dirs: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)


def _check_name(spec: SandboxSpec) -> None:
    if not spec.name.isalnum() or not 1 <= len(spec.name) <= 6:
        raise SandboxError(f"sandbox name {spec.name!r} must be 1-6 letters or digits")
    try:
        ipaddress.IPv4Network(f"{spec.subnet}.0/24")
    except ValueError as exc:
        raise SandboxError(f"subnet {spec.subnet!r} is not the first three octets of a /24",
                           hint="e.g. 10.213.7") from exc
    if not 1 <= spec.compute_nodes <= MAX_COMPUTE_NODES:
        raise SandboxError(f"a sandbox has 1 to {MAX_COMPUTE_NODES} compute hosts")
    if spec.registry_rate and not re.fullmatch(r"[1-9][0-9]*(kbit|mbit|gbit)",
                                               spec.registry_rate):
        raise SandboxError(f"registry rate {spec.registry_rate!r} is not a rate",
                           hint="e.g. 1gbit or 500mbit")


def _ip(*args: str, check: bool = True) -> process.Completed:
    return process.run(["ip", *args], timeout=30, check=check, what=f"ip {' '.join(args[:3])}")


def _routes_overlapping(network: ipaddress.IPv4Network) -> list[str]:
    out = _ip("-j", "route", "show", "table", "all").stdout
    found = []
    for route in json.loads(out or "[]"):
        dst = route.get("dst", "")
        if dst in ("default", "") or ":" in dst:
            continue
        with contextlib.suppress(ValueError):
            if ipaddress.IPv4Network(dst, strict=False).overlaps(network):
                found.append(f"{dst} dev {route.get('dev', '?')}")
    return found


class Sandbox:
    """A started (or startable) local cluster; ``up``/``down`` or ``with running(spec)``."""

    def __init__(self, spec: SandboxSpec) -> None:
        _check_name(spec)
        self.spec = spec
        self.root = spec.root.resolve()
        self.conf = self.root / "slurm.conf"

    # -- paths and commands --------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """What a client command needs: the cluster's slurm.conf."""
        return {"SLURM_CONF": str(self.conf)}

    def on(self, host: Host | None, argv: Sequence[str], user: str | None = None,
           env: Mapping[str, str] | None = None) -> list[str]:
        """argv run on ``host`` (default: the head, where users log in), as ``user``."""
        target = host or self.spec.head
        values = {**self.env, **(env or {})}
        if user is not None:
            values.setdefault("USER", user)
        prefix = ["ip", "netns", "exec", target.namespace]
        if user is not None:
            prefix += ["runuser", "-u", user, "--"]
        assignments = [f"{k}={v}" for k, v in sorted(values.items())]
        return [*prefix, "env", *assignments, *argv]

    def run(self, argv: Sequence[str], *, user: str | None = None, host: Host | None = None,
            env: Mapping[str, str] | None = None, timeout: float = 120,
            cwd: str | os.PathLike[str] | None = None) -> process.Completed:
        """A command on a host of the cluster; its result, whatever the exit status."""
        return process.run(self.on(host, argv, user, env), timeout=timeout, cwd=cwd,
                           check=False)

    # -- lifecycle -----------------------------------------------------------------------

    def _state_path(self) -> Path:
        return self.root / STATE_FILE

    @classmethod
    def saved(cls, root: Path) -> Sandbox | None:
        """The sandbox whose state is in ``root``, with the spec ``up`` was given."""
        try:
            spec = json.loads((root / STATE_FILE).read_text())["spec"]
            plugstack = spec.get("plugstack")
            return cls(SandboxSpec(
                root=Path(spec["root"]), name=spec["name"], subnet=spec["subnet"],
                compute_nodes=int(spec["compute_nodes"]), cpus=int(spec["cpus"]),
                gpus=int(spec["gpus"]), memory_mb=int(spec["memory_mb"]),
                plugstack=Path(plugstack) if plugstack not in (None, "None") else None,
                platforms=str(spec.get("platforms") or ""),
                registry_rate=str(spec.get("registry_rate") or ""),
                node_scratch=str(spec.get("node_scratch") or ""),
                pyxis=str(spec.get("pyxis")) == "True", importer=str(spec.get("importer") or ""),
                squashfuse=str(spec.get("squashfuse", "True")) == "True",
                pyxis_line=str(spec.get("pyxis_line") or ""),
                node_binds=str(spec.get("node_binds") or ""),
                node_disks=str(spec.get("node_disks") or ""),
                registry_tls=str(spec.get("registry_tls") or ""),
                registry_htpasswd=str(spec.get("registry_htpasswd") or "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def running_named(cls, name: str) -> Sandbox | None:
        """The live sandbox called ``name`` on this machine, whichever folder (checkout) it
        was started from: its head namespace's slurmctld carries its slurm.conf's path.
        Namespace names are machine-wide, so two checkouts share one sandbox of a name."""
        head = SandboxSpec(root=Path("."), name=name).head.namespace
        listed = _ip("netns", "pids", head, check=False)
        for pid in listed.stdout.split() if listed.returncode == 0 else []:
            with contextlib.suppress(OSError, ValueError):
                environ = Path(f"/proc/{int(pid)}/environ").read_bytes().split(b"\0")
                for entry in environ:
                    if entry.startswith(b"SLURM_CONF="):
                        found = cls.saved(Path(entry[len(b"SLURM_CONF="):].decode()).parent)
                        if found is not None and found.spec.name == name and found.is_up():
                            return found
        return None

    def _save(self, state: State) -> None:
        self._state_path().write_text(json.dumps(asdict(state), indent=2) + "\n")

    def is_up(self) -> bool:
        state = self._load()
        return state is not None and all(alive(pid) for pid in state.pids.values())

    def _load(self) -> State | None:
        try:
            data = json.loads(self._state_path().read_text())
        except (OSError, ValueError):
            return None
        return State(**data)

    def up(self, *, registry_storage: Path | None = None, timeout: float = 60) -> None:
        """Make the namespaces, start munged, slurmctld and one slurmd per compute host,
        and wait until every node is idle.  Idempotent: an answering sandbox is kept."""
        for program in ("ip", "unshare", "munged", "slurmctld", "slurmd", "sinfo"):
            process.require(program)
        if os.geteuid() != 0:
            raise SandboxError("making network namespaces needs root",
                               hint="run it as root (sudo imgpipe sandbox up)")
        if self.is_up() and self._runs_as(registry_storage):
            return
        self.down()  # whatever a crashed earlier run left, or one started otherwise
        self._clear_leftovers()
        overlapping = _routes_overlapping(self.spec.network)
        if overlapping:
            raise SandboxError(f"the sandbox range {self.spec.network} is already routed "
                               f"here ({'; '.join(overlapping)})",
                               hint="choose another subnet (--subnet)")
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # jobs of every user read slurm.conf
        state = State(spec={k: str(v) for k, v in asdict(self.spec).items()})
        self._save(state)
        try:
            self._network(state)
            write_config(self.spec, self.root)
            self._start_daemons(state, registry_storage)
            self._wait_idle(state, timeout)
        except BaseException:
            self.down()
            raise

    def _runs_as(self, registry_storage: Path | None) -> bool:
        """Whether the running sandbox was started as this one would be (its spec, and a
        registry on its head or none, as asked)."""
        state = self._load()
        wanted = {k: str(v) for k, v in asdict(self.spec).items()}
        return state is not None and state.spec == wanted and \
            ("registry" in state.pids) == (registry_storage is not None)

    def _clear_leftovers(self) -> None:
        """Remove the namespaces and bridge of a same-named sandbox whose run died without
        its state file (another root folder, a killed test session).  Namespaces that
        still hold processes belong to a live sandbox: refuse rather than pull its network."""
        spec = self.spec
        listed = {line.split()[0] for line in
                  _ip("netns", "list", check=False).stdout.splitlines() if line.strip()}
        leftover = [h.namespace for h in spec.hosts if h.namespace in listed]
        for namespace in leftover:
            if _ip("netns", "pids", namespace, check=False).stdout.split():
                raise SandboxError(f"a sandbox named {spec.name!r} is running already "
                                   f"(namespace {namespace} holds processes)",
                                   hint="stop it with 'imgpipe sandbox down' from its --root, "
                                        "or pick another --name and --subnet")
        for namespace in leftover:
            _ip("netns", "del", namespace, check=False)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        if _ip("link", "show", spec.bridge, check=False).returncode == 0:
            _ip("link", "del", spec.bridge, check=False)

    def _network(self, state: State) -> None:
        spec = self.spec
        _ip("link", "add", spec.bridge, "type", "bridge")
        state.links.append(spec.bridge)
        self._save(state)
        # The bridge's address makes the range a connected, local route in the root
        # namespace before any daemon starts: nothing for it is sent anywhere else.
        _ip("addr", "add", f"{spec.bridge_address}/24", "dev", spec.bridge)
        _ip("link", "set", spec.bridge, "up")
        hosts_file = "".join(f"{h.address} {h.name}\n" for h in spec.hosts)
        hosts_file = f"127.0.0.1 localhost\n::1 localhost\n{hosts_file}"
        for index, host in enumerate(spec.hosts):
            _ip("netns", "add", host.namespace)
            state.namespaces.append(host.namespace)
            netns_dir = Path("/etc/netns") / host.namespace
            netns_dir.mkdir(parents=True, exist_ok=True)
            state.netns_dirs.append(str(netns_dir))
            self._save(state)
            (netns_dir / "hosts").write_text(hosts_file)
            (netns_dir / "hostname").write_text(host.name + "\n")
            outer, inner = f"{spec.name}v{index}", f"{spec.name}i{index}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            state.links.append(outer)
            self._save(state)
            _ip("link", "set", inner, "netns", host.namespace)
            _ip("link", "set", outer, "master", spec.bridge)
            _ip("link", "set", outer, "up")
            in_ns = ["netns", "exec", host.namespace, "ip"]
            _ip(*in_ns, "link", "set", "lo", "up")
            _ip(*in_ns, "link", "set", inner, "name", "eth0")
            _ip(*in_ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip(*in_ns, "link", "set", "eth0", "up")
        if spec.registry_rate:
            self._limit_head(spec.registry_rate)

    def _limit_head(self, rate: str) -> None:
        """A token bucket on the head's egress: what its registry serves leaves at ``rate``."""
        process.require("tc")
        burst = "4mb" if rate.endswith("gbit") else "512kb"
        done = process.run(["ip", "netns", "exec", self.spec.head.namespace, "tc", "qdisc",
                            "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
                            "latency", "200ms"], check=False)
        if done.returncode != 0:
            raise SandboxError(f"tc could not limit the head's link to {rate}: "
                               f"{done.stderr.strip()}")

    def _daemon(self, state: State, label: str, host: Host | None, argv: list[str]) -> None:
        log = self.root / "log" / f"{label}.out"
        if host is not None:
            # Its own hostname: a UTS namespace inside the host's network namespace.
            # `ip netns exec` mounts a fresh /sys without cgroupfs, which slurmd needs.
            argv = ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--",
                    "sh", str(self.root / "boot.sh"), host.name, *argv]
        state.pids[label] = process.spawn(argv, log, env=self.env).pid
        self._save(state)

    def _start_daemons(self, state: State, registry_storage: Path | None) -> None:
        root = self.root
        write_boot_script(self.root, self.spec.node_scratch, self.spec.pyxis,
                          self.spec.node_binds, self.spec.node_disks)
        for folder in filter(None, self.spec.node_disks.split(",")):
            Path(folder).mkdir(parents=True, exist_ok=True)  # the mount point
        for host in self.spec.nodes:
            (root / "spool" / host.name).mkdir(parents=True, exist_ok=True)
        munge = root / "munge"
        self._daemon(state, "munged", None, [
            "munged", "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
            f"--socket={root / MUNGE_SOCKET}", f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        wait_for(lambda: (root / MUNGE_SOCKET).exists(), 20, "munged")
        self._daemon(state, "slurmctld", self.spec.head,
                     ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for host in self.spec.nodes:
            self._daemon(state, f"slurmd-{host.name}", host,
                         ["slurmd", "-D", "-N", host.name, "-f", str(self.conf)])
        if registry_storage is not None:
            self._start_registry(state, registry_storage)

    def _start_registry(self, state: State, storage: Path) -> None:
        """Debian's registry on the head host, serving ``storage`` read-only (another
        registry on the same folder may be the one images are pushed to); with TLS and logins
        where the spec gives a certificate and an htpasswd file."""
        config = self.root / "registry.yml"
        http: dict[str, object] = {"addr": f"{self.spec.head.address}:{REGISTRY_PORT}"}
        if self.spec.registry_tls:
            cert, _, key = self.spec.registry_tls.partition(":")
            http["tls"] = {"certificate": cert, "key": key}
        auth = ({"htpasswd": {"realm": "sandbox", "path": self.spec.registry_htpasswd}}
                if self.spec.registry_htpasswd else None)
        config.write_text(json.dumps({
            "version": 0.1,
            "log": {"level": "warn"},
            "storage": {"filesystem": {"rootdirectory": str(storage)},
                        "maintenance": {"readonly": {"enabled": True},
                                        "uploadpurging": {"enabled": False}}},
            "http": http, **({"auth": auth} if auth else {}),
        }))
        binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
        self._daemon(state, "registry", self.spec.head, [binary, "serve", str(config)])

    @property
    def registry_log(self) -> Path:
        """The head registry's log: its access lines say what it served."""
        return self.root / "log" / "registry.out"

    def registry_served(self, blob: str, since: int = 0) -> list[int]:
        """Bytes of each answer (200 or 206) to a GET of ``blob`` in the registry's access
        log, from byte offset ``since`` of the log."""
        try:
            with open(self.registry_log, "rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return []
        pattern = re.compile(r'"GET /v2/[^ ]+/blobs/' + re.escape(blob)
                             + r' HTTP/[0-9.]+" (200|206) ([0-9]+)')
        return [int(match.group(2)) for match in pattern.finditer(text)]

    def registry_log_size(self) -> int:
        try:
            return self.registry_log.stat().st_size
        except FileNotFoundError:
            return 0

    @property
    def registry_address(self) -> str:
        return f"{self.spec.head.name}:{REGISTRY_PORT}"

    def _wait_idle(self, state: State, timeout: float) -> None:
        def idle() -> bool:
            for label, pid in state.pids.items():
                if not alive(pid):
                    raise SandboxError(f"{label} exited while starting",
                                       hint=f"see {self.root / 'log'}")
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20)
            states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
            return len(states) == self.spec.compute_nodes and all(
                s in ("idle", "mix", "alloc") for s in states.values())

        wait_for(idle, timeout, f"{self.spec.compute_nodes} idle Slurm nodes", interval=0.3)

    def down(self) -> None:
        """Stop everything ``up`` started; safe to call at any point and more than once."""
        state = self._load()
        if state is None:
            return
        if any(alive(pid) for label, pid in state.pids.items() if label == "slurmctld"):
            self._cancel_jobs()
        for pid in state.pids.values():
            stop_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in state.pids.values()):
            time.sleep(0.1)
        for pid in state.pids.values():
            stop_group(pid, signal.SIGKILL)
        kill_marked(f"SLURM_CONF={self.conf}".encode())
        for namespace in state.namespaces:
            for listed in _ip("netns", "pids", namespace, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(listed), signal.SIGKILL)
            _ip("netns", "del", namespace, check=False)
        for link in state.links:
            _ip("link", "del", link, check=False)
        for folder in state.netns_dirs:
            shutil.rmtree(folder, ignore_errors=True)
        self._state_path().unlink(missing_ok=True)

    def _cancel_jobs(self) -> None:
        with contextlib.suppress(OSError, ImgpipeError):
            queue = self.run(["squeue", "-h", "-o", "%i"], timeout=20)
            jobs = queue.stdout.split()
            if jobs:
                self.run(["scancel", "--full", *jobs], timeout=20)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    left = self.run(["squeue", "-h", "-o", "%i"], timeout=20)
                    if left.returncode != 0 or not left.stdout.strip():
                        break
                    time.sleep(0.3)

    def status(self) -> dict[str, object]:
        """Daemons alive, and each node's Slurm state."""
        state = self._load()
        if state is None:
            return {"up": False}
        nodes: dict[str, str] = {}
        running = {label: alive(pid) for label, pid in state.pids.items()}
        if running.get("slurmctld"):
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20)
            nodes = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return {"up": all(running.values()), "daemons": running, "nodes": nodes,
                "hosts": [asdict(h) for h in self.spec.hosts], "conf": str(self.conf),
                "pyxis": self.spec.pyxis, "importer": self.spec.importer,
                "registry": self.registry_address if "registry" in state.pids else None}


@contextlib.contextmanager
def running(spec: SandboxSpec, *, registry_storage: Path | None = None) -> Iterator[Sandbox]:
    """A sandbox for the length of a ``with`` block, torn down even when the block fails."""
    sandbox = Sandbox(spec)
    try:
        sandbox.up(registry_storage=registry_storage)
        yield sandbox
    finally:
        sandbox.down()
