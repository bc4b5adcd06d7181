"""The head node's registry: up, down, status and garbage collection.

Two ways to run it, chosen by ``registry.server.mode``:

* ``container``: a ``registry:2`` container (named, restart policy
  ``unless-stopped``, data directory bind-mounted from the host, deletion
  enabled) on the host network, listening on the configured address.
  Host networking works with engines started with ``--bridge=none`` as well
  as ordinary ones.
* ``binary``: Debian's ``docker-registry`` (the same distribution 2.8
  release) as a background process managed from the state directory
  (``config.yml``, ``registry.pid``, ``registry.log``).

``auto`` takes the container when the engine has the image or can pull it,
the binary otherwise.  ``up`` and ``down`` are idempotent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

from imgpipe.base import process
from imgpipe.base.config import Settings
from imgpipe.base.daemon import Daemon, daemon_in_file
from imgpipe.base.engine import Engine, EngineError
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.files import atomic_write
from imgpipe.registry.errors import LocalRegistryError
from imgpipe.registry.localfiles import (
    CONTAINER_AUTH,
    CONTAINER_CERTS,
    CONTAINER_CONFIG,
    CONTAINER_DATA,
    Mode,
    ServerFiles,
    collect_garbage,
    dir_bytes,
    registry_binary,
    short,
)

START_DEADLINE_S = 20.0
STOP_DEADLINE_S = 15.0
# The state folder of the checkout that started a container-mode registry: the container's
# name is machine-wide, and another checkout must neither stop nor collect it.
OWNER_LABEL = "org.imgpipe.state-dir"


@dataclass(frozen=True)
class ServerState:
    """What is running at the configured address right now."""

    mode: Literal["container", "binary", "external", "down"]
    address: str
    pid: int | None = None
    container: str | None = None


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


class LocalRegistry(ServerFiles):
    """Lifecycle of the registry that serves ``settings.registry``."""

    def __init__(self, settings: Settings, engine: Engine | None = None):
        super().__init__(settings)
        self.engine = engine or Engine(settings.docker.host)

    # -- garbage collection -----------------------------------------------------------------

    def garbage_collect(self, delete_untagged: bool = False) -> tuple[int, int]:
        """Stop, collect, restart; returns (bytes before, bytes after) of the data directory."""
        current = self.state()
        if current.mode == "external":
            raise LocalRegistryError(
                "the registry on this address was not started by imgpipe; "
                "cannot collect its garbage",
                hint="run `registry garbage-collect` where that registry runs",
            )
        mode: Mode = current.mode if current.mode in ("container", "binary") else self.choose_mode()
        before = dir_bytes(self.data_dir)
        was_running = current.mode != "down"
        if was_running:
            self.down()
        try:
            collect_garbage(self, mode, delete_untagged, self._required_engine)
        finally:
            if was_running:
                self.up()
        return before, dir_bytes(self.data_dir)

    # -- state ------------------------------------------------------------------------------

    def _required_engine(self) -> Engine:
        """The engine a container-mode registry runs on; a clear error when none answers."""
        if not self.engine.answers():
            raise LocalRegistryError("the Docker engine does not answer, and container mode "
                                     "needs it", hint="start dockerd, or set "
                                     "registry.server.mode: binary")
        return self.engine

    def _container(self) -> Any | None:
        """The registry's container (the SDK's object), None without one or an engine."""
        if not self.engine.answers():
            return None
        try:
            return self.engine.container(self.config.server.container_name)
        except EngineError:
            return None

    def _daemon(self) -> Daemon | None:
        return daemon_in_file(self.pid_file, str(self.config_file))

    def _pid(self) -> int | None:
        """The registry's pid, when the process the pid file names is the one imgpipe
        started with this state folder's config (never another user's or a reused pid)."""
        found = self._daemon()
        return found.pid if found is not None and found.ours else None

    def state(self) -> ServerState:
        address = self.config.address
        container = self._container()
        if container is not None and container.status == "running":
            owner = (container.labels or {}).get(OWNER_LABEL)
            if owner and owner != str(self.state_dir):  # another checkout's: use, never stop
                return ServerState("external", address, container=container.name)
            return ServerState("container", address, container=container.name)
        pid = self._pid()
        if pid is not None:
            return ServerState("binary", address, pid=pid)
        if port_in_use(self._probe_host(), self.config.port):
            return ServerState("external", address)
        return ServerState("down", address)

    def answers_as_registry(self) -> bool:
        """Whether what listens on the port speaks the Registry HTTP API v2 (its /v2/ answers
        with the Docker-Distribution-API-Version header, whatever the auth says)."""
        import requests

        url = f"{self.config.scheme}://{self._probe_host()}:{self.config.port}/v2/"
        ca = self.settings.path(self.config.ca_file) if self.config.ca_file else None
        for verify in (str(ca) if ca else True, False):  # identity only: nothing is sent
            try:
                reply = requests.get(url, timeout=(3, 5), verify=verify, allow_redirects=False)
            except requests.exceptions.SSLError:
                continue
            except requests.RequestException:
                return False
            return reply.headers.get("Docker-Distribution-API-Version", "").startswith(
                "registry/2")
        return False

    def _probe_host(self) -> str:
        bind = self.config.server.bind
        return "127.0.0.1" if bind in ("0.0.0.0", "") else bind

    # -- up ---------------------------------------------------------------------------------

    def choose_mode(self) -> Mode:
        wanted = self.config.server.mode
        if wanted != "auto":
            return wanted
        # The engine's own image first, then Debian's binary; a pull (Docker Hub, or the
        # engine's mirror) only when neither is here.
        if self._image_available(pull=False):
            return "container"
        if registry_binary() is not None:
            return "binary"
        if self._image_available(pull=True):
            return "container"
        raise LocalRegistryError(
            f"cannot run a registry: no {self.config.server.image} image in the Docker engine "
            "and no docker-registry binary",
            hint="apt-get install docker-registry, or load the registry:2 image into the engine",
        )

    def _image_available(self, pull: bool) -> bool:
        if not self.engine.answers():
            return False
        image = self.config.server.image
        try:
            if self.engine.image_id(image) is not None:
                return True
            if pull:
                self.engine.pull(image)
                return True
        except EngineError:
            return False
        return False

    def up(self) -> tuple[ServerState, bool]:
        """Start the registry unless it runs; returns its state and whether it was started."""
        current = self.state()
        if current.mode in ("container", "binary"):
            return current, False
        if current.mode == "external":
            if self.answers_as_registry():  # a site's own (DeepOps', say): use it as it is
                return current, False
            raise LocalRegistryError(
                f"port {self.config.port} on {self.config.server.bind} is in use by a program "
                "that does not answer as a registry",
                hint="stop that program, or choose another registry.port in imgpipe.yaml",
            )
        mode = self.choose_mode()
        self.check_files()
        created = self.prepare_dirs()
        try:
            if mode == "container":
                self._start_container()
            else:
                self._start_binary()
            self._wait_until_ready(mode)
        except BaseException:
            self._stop_quietly(mode)
            for path in created:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        return self.state(), True

    def _start_binary(self) -> None:
        binary = registry_binary()
        if binary is None:
            raise LocalRegistryError("the docker-registry binary is not installed",
                                     hint="apt-get install docker-registry")
        atomic_write(self.config_file, self.render_config("binary"), mode=0o600)
        # survives the CLI (its own session); stopped by `registry down`
        proc = process.spawn([binary, "serve", str(self.config_file)], self.log_file,
                             env={k: v for k, v in os.environ.items()
                                  if not k.startswith("REGISTRY_")}, inherit_env=False)
        atomic_write(self.pid_file, f"{proc.pid}\n")
        self._proc = proc

    def _start_container(self) -> None:
        engine = self._required_engine()
        atomic_write(self.config_file, self.render_config("container"), mode=0o644)
        volumes = {
            str(self.data_dir): {"bind": CONTAINER_DATA, "mode": "rw"},
            str(self.config_file): {"bind": CONTAINER_CONFIG, "mode": "ro"},
        }
        if self.tls_cert and self.tls_key:
            volumes[str(self.tls_cert)] = {"bind": f"{CONTAINER_CERTS}/tls.crt", "mode": "ro"}
            volumes[str(self.tls_key)] = {"bind": f"{CONTAINER_CERTS}/tls.key", "mode": "ro"}
        if self.htpasswd:
            volumes[str(self.htpasswd)] = {"bind": f"{CONTAINER_AUTH}/htpasswd", "mode": "ro"}
        name = self.config.server.container_name
        stale = self._container()
        if stale is not None:
            stale.remove(force=True)
        try:
            engine.start_container(
                self.config.server.image,
                name=name,
                network_mode="host",
                restart_policy={"Name": "unless-stopped"},
                volumes=volumes,
                labels={"org.imgpipe.role": "registry", OWNER_LABEL: str(self.state_dir)},
            )
        except EngineError as exc:
            raise LocalRegistryError(f"cannot start the registry container: {exc.message}"
                                     ) from exc

    def _wait_until_ready(self, mode: Mode) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if mode == "binary" and self._proc.exited():
                raise LocalRegistryError(
                    f"the registry exited at start: {self._log_tail()}",
                    hint=f"its log is {self.log_file}",
                )
            if mode == "container":
                container = self._container()
                if container is None or container.status in ("exited", "dead"):
                    tail = container.logs(tail=3).decode(errors="replace") if container else ""
                    raise LocalRegistryError(f"the registry container exited at start: {tail}")
            if port_in_use(self._probe_host(), self.config.port):
                return
            time.sleep(0.1)
        raise LocalRegistryError(f"the registry did not listen on {self.listen} within "
                                 f"{START_DEADLINE_S:.0f} s", hint=f"see {self.log_file}")

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return "(no log)"
        for line in reversed(lines):
            if "level=fatal" in line or "level=error" in line or "panic" in line:
                return short(line)
        return short(lines[-1]) if lines else "(empty log)"

    # -- down -------------------------------------------------------------------------------

    def down(self) -> ServerState:
        """Stop what `up` started; fine when nothing runs.  Returns what was stopped."""
        current = self.state()
        if current.mode == "container":
            container = self._container()
            if container is not None:
                container.stop(timeout=int(STOP_DEADLINE_S))
                container.remove()
        elif current.mode == "binary" and current.pid is not None:
            found = self._daemon()
            if found is None:
                return current
            found.check_signal(f"the registry of {self.state_dir}")
            _terminate(found.pid)
            with contextlib.suppress(FileNotFoundError):
                self.pid_file.unlink()
        return current

    def _stop_quietly(self, mode: Mode) -> None:
        with contextlib.suppress(ImgpipeError, OSError):
            if mode == "binary" and getattr(self, "_proc", None) is not None:
                _terminate(self._proc.pid)
                self.pid_file.unlink(missing_ok=True)
            elif mode == "container":
                container = self._container()
                if container is not None:
                    container.remove(force=True)

def _terminate(pid: int) -> None:
    """SIGTERM, wait, then SIGKILL; the registry flushes nothing that matters at exit."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            reaped, _ = os.waitpid(pid, os.WNOHANG)
            if reaped == pid:
                return
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)



__all__ = ["LocalRegistry", "ServerState", "dir_bytes", "port_in_use"]
