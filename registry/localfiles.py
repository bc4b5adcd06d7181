"""The files the head node's registry runs from: where they live (from ``registry.server``),
its ``config.yml`` as the registry process sees it, the checks and folders ``up`` needs,
and garbage collection over them (the registry stopped)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Literal

import yaml

from imgpipe.base import process
from imgpipe.base.adminpath import Admins, as_path, only_names, walk_admin_folder
from imgpipe.base.config import RegistryConfig, Settings
from imgpipe.base.engine import Engine, EngineError
from imgpipe.base.files import TMP_PREFIX, atomic_write
from imgpipe.base.process import which
from imgpipe.registry.errors import LocalRegistryError

Mode = Literal["container", "binary"]
CONTAINER_DATA = "/var/lib/registry"
CONTAINER_CONFIG = "/etc/docker/registry/config.yml"
CONTAINER_CERTS = "/certs"
CONTAINER_AUTH = "/auth"
BINARY_NAMES = ("docker-registry", "registry")

__all__ = ["BINARY_NAMES", "CONTAINER_AUTH", "CONTAINER_CERTS", "CONTAINER_CONFIG",
           "CONTAINER_DATA", "Mode", "ServerFiles", "collect_garbage", "dir_bytes",
           "registry_binary", "short"]


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class ServerFiles:
    """The registry's folders and files for ``settings.registry.server``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.config: RegistryConfig = settings.registry
        server = self.config.server
        # as written, never resolved: root walks them without following a link
        self.state_dir = as_path(settings.path(server.state_dir))
        self.data_dir = as_path(settings.path(server.data_dir))
        self.tls_cert = settings.path(server.tls_cert).resolve() if server.tls_cert else None
        self.tls_key = settings.path(server.tls_key).resolve() if server.tls_key else None
        self.htpasswd = settings.path(server.htpasswd).resolve() if server.htpasswd else None

    # -- paths ------------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.state_dir / "config.yml"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "registry.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "registry.log"

    @property
    def listen(self) -> str:
        return f"{self.config.server.bind}:{self.config.port}"

    # -- configuration ----------------------------------------------------------------------

    def render_config(self, mode: Mode) -> str:
        """The registry's config.yml, with paths as the registry process will see them."""
        inside = mode == "container"
        http: dict[str, Any] = {
            "addr": self.listen,
            "headers": {"X-Content-Type-Options": ["nosniff"]},
        }
        if self.tls_cert and self.tls_key:
            http["tls"] = {
                "certificate": f"{CONTAINER_CERTS}/tls.crt" if inside else str(self.tls_cert),
                "key": f"{CONTAINER_CERTS}/tls.key" if inside else str(self.tls_key),
            }
        config: dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "info", "fields": {"service": "registry"}},
            "storage": {
                "filesystem": {"rootdirectory": CONTAINER_DATA if inside else str(self.data_dir)},
                "delete": {"enabled": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": http,
        }
        if self.htpasswd:
            config["auth"] = {
                "htpasswd": {
                    "realm": "imgpipe-registry",
                    "path": f"{CONTAINER_AUTH}/htpasswd" if inside else str(self.htpasswd),
                }
            }
        return yaml.safe_dump(config, sort_keys=False)

    def check_files(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise LocalRegistryError("registry.server.tls_cert and tls_key go together",
                                     hint="set both in imgpipe.yaml, or neither")
        for key, path in (("tls_cert", self.tls_cert), ("tls_key", self.tls_key),
                          ("htpasswd", self.htpasswd)):
            if path is not None and not path.is_file():
                raise LocalRegistryError(f"registry.server.{key}: {path} does not exist")
        if self.htpasswd and not self.tls_cert:
            raise LocalRegistryError(
                "registry.server.htpasswd needs TLS: the registry refuses Basic auth over http",
                hint="set registry.server.tls_cert and tls_key",
            )

    def walk_as_root(self) -> None:
        """As root: the state and data folders walked from / without following a link, made
        where missing (the data folder 0700: it holds every image, private ones too), and
        adopted only when root made them and they hold only the registry's own files."""
        if os.geteuid() != 0:
            return
        admins = Admins.of()
        state_names = STATE_NAMES | ({self.data_dir.name}
                                     if self.data_dir.parent == self.state_dir else set())
        for folder, mode, names, what in (
                (self.state_dir, 0o755, state_names, "a registry's state folder"),
                (self.data_dir, 0o700, DATA_NAMES, "a registry's data folder")):
            walk_admin_folder(folder, admins, create_mode=mode, refuse=_refuse, what=what,
                              adopt=_names_of(names, what))

    def prepare_dirs(self) -> list[Path]:
        """Create state and data directories; returns the ones created (for undo)."""
        self.walk_as_root()
        created: list[Path] = []
        for directory in (self.state_dir, self.data_dir):
            missing = []
            probe = directory
            while not probe.exists():
                missing.append(probe)
                probe = probe.parent
            try:
                directory.mkdir(parents=True, exist_ok=True)
                test = directory / f".imgpipe-write-test.{os.getpid()}"
                test.write_bytes(b"")
                test.unlink()
            except OSError as exc:
                for path in missing:  # deepest first
                    with contextlib.suppress(OSError):
                        path.rmdir()
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                raise LocalRegistryError(
                    f"cannot write the registry's directory {directory}: {reason.lower()}",
                    hint="run as a user who may write there, or set registry.server.data_dir "
                    "and state_dir in imgpipe.yaml",
                ) from exc
            created.extend(missing)
        return created


STATE_NAMES = frozenset({"config.yml", "registry.pid", "registry.log"})
DATA_NAMES = frozenset({"docker"})  # distribution's storage: docker/registry/v2/...


def _refuse(what: str, hint: str) -> LocalRegistryError:
    return LocalRegistryError(what, hint=hint)


def _names_of(allowed: Collection[str], what: str) -> Callable[[list[str]], str | None]:
    def rule(names: list[str]) -> str | None:
        return only_names(allowed, what)([name for name in names
                                          if not name.startswith((TMP_PREFIX, ".imgpipe-"))])
    return rule


def collect_garbage(files: ServerFiles, mode: Mode, delete_untagged: bool,
                    engine: Callable[[], Engine]) -> None:
    """``registry garbage-collect`` over the data folder, by the binary or in a container
    of the configured image (``engine``: the engine that runs it); the registry is down."""
    if mode == "binary":
        _gc_binary(files, delete_untagged)
    else:
        _gc_container(files, delete_untagged, engine())


def _gc_binary(files: ServerFiles, delete_untagged: bool) -> None:
    binary = registry_binary()
    if binary is None:
        raise LocalRegistryError("the docker-registry binary is not installed",
                                 hint="apt-get install docker-registry")
    atomic_write(files.config_file, files.render_config("binary"), mode=0o600)
    argv = [binary, "garbage-collect", str(files.config_file)]
    if delete_untagged:
        argv.append("--delete-untagged")
    proc = process.run(argv, timeout=600, check=False, what="garbage-collect")
    with open(files.log_file, "a") as log:
        log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise LocalRegistryError(f"garbage collection failed: {short(proc.stderr)}",
                                 hint=f"see {files.log_file}")

def _gc_container(files: ServerFiles, delete_untagged: bool, engine: Engine) -> None:
    atomic_write(files.config_file, files.render_config("container"), mode=0o644)
    command = ["garbage-collect", CONTAINER_CONFIG]
    if delete_untagged:
        command.append("--delete-untagged")
    try:
        output = engine.run_to_end(
            files.config.server.image,
            command,
            network_mode="none",
            volumes={
                str(files.data_dir): {"bind": CONTAINER_DATA, "mode": "rw"},
                str(files.config_file): {"bind": CONTAINER_CONFIG, "mode": "ro"},
            },
        )
    except EngineError as exc:
        raise LocalRegistryError(f"garbage collection failed: {short(exc.message)}"
                                 ) from exc
    with open(files.log_file, "ab") as log:
        log.write(output or b"")


def registry_binary() -> str | None:
    for name in BINARY_NAMES:
        path = which(name)
        if path:
            return path
    return None


def short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
