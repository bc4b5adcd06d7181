"""Finding a Docker engine and a client that can drive BuildKit.

Two kinds of client exist on the machines imgpipe runs on: one with the buildx
plugin (BuildKit through ``docker buildx build``), and one without it whose
``docker build`` still uses the engine's built-in BuildKit when
``DOCKER_BUILDKIT=1`` is set (Docker 18.09 and newer; the newer CLI refuses
to do that without buildx).  Detect, don't assume.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from imgpipe.base.errors import CommandError, ImgpipeError
from imgpipe.base.process import run

BuildPath = Literal["buildx", "builtin"]
# Every docker CLI that still builds with the engine's BuildKit without the
# buildx plugin: 18.09 .. 22.x (23.0 made `docker build` an alias of buildx).
_BUILTIN_MAX_MAJOR = 22


@dataclass(frozen=True)
class BuildClient:
    """One docker client and the BuildKit path it offers."""

    path: str
    version: str
    build_path: BuildPath | None
    engine_version: str | None

    @property
    def usable(self) -> bool:
        return self.build_path is not None and self.engine_version is not None


def docker_clients() -> list[str]:
    """Every distinct ``docker`` executable on PATH, plus Debian's /usr/bin/docker."""
    seen: list[str] = []
    dirs = os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin"]
    for folder in dirs:
        candidate = Path(folder or ".") / "docker"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            real = str(candidate.resolve())
            if real not in [str(Path(s).resolve()) for s in seen]:
                seen.append(str(candidate))
    return seen


def _major(version: str) -> int:
    match = re.match(r"(\d+)", version)
    return int(match.group(1)) if match else 0


def probe_client(path: str, env: dict[str, str] | None = None) -> BuildClient:
    """Ask one client for its version, the engine's version and buildx."""
    try:
        client_version = run([path, "version", "--format", "{{.Client.Version}}"],
                             timeout=20, check=False, env=env).stdout.strip()
        server = run([path, "version", "--format", "{{.Server.Version}}"], timeout=20,
                     check=False, env=env)
        engine_version = server.stdout.strip() if server.returncode == 0 else None
        buildx = run([path, "buildx", "version"], timeout=20, check=False, env=env)
    except CommandError:
        return BuildClient(path, "unknown", None, None)
    build_path: BuildPath | None = None
    if buildx.returncode == 0:
        build_path = "buildx"
    elif 18 <= _major(client_version) <= _BUILTIN_MAX_MAJOR:
        build_path = "builtin"
    return BuildClient(path, client_version or "unknown", build_path, engine_version or None)


def find_build_client(preferred: str = "auto", docker_host: str | None = None) -> BuildClient:
    """The client builds go through: ``preferred`` if a path is set, else the best found."""
    env = {"DOCKER_HOST": docker_host} if docker_host else None
    candidates = docker_clients() if preferred == "auto" else [preferred]
    if not candidates:
        raise ImgpipeError("no docker client is installed", hint="apt-get install docker.io")
    probed = [probe_client(path, env) for path in candidates]
    for kind in ("buildx", "builtin"):
        for client in probed:
            if client.usable and client.build_path == kind:
                return client
    if not any(client.engine_version for client in probed):
        raise ImgpipeError(
            "no Docker engine answers",
            hint="start one: dockerd --bridge=none --iptables=false & (or ./setup.sh)",
        )
    described = ", ".join(f"{c.path} {c.version}" for c in probed)
    raise ImgpipeError(
        f"no docker client here can drive BuildKit ({described})",
        hint="install the buildx plugin (docker-buildx) or Debian's docker.io client",
    )
