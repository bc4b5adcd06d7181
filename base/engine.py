"""The one adapter to the Docker engine: every engine call imgpipe makes goes through here.

Three ways in, each where it is the right one:

* builds: BuildKit through python-on-whales (``docker buildx build``) where the client has
  the buildx plugin, else the engine's built-in BuildKit through the 20.10 client
  (``DOCKER_BUILDKIT=1 docker build``, which python-on-whales' legacy path cannot hand
  secrets to) run by :mod:`imgpipe.base.process`; either way the image ID comes from
  BuildKit (``--iidfile`` or the loaded image), never from progress text;
* self-tests: the client's ``docker run`` through :mod:`imgpipe.base.process` (its
  timeout, its output line by line);
* everything else (pushes with their byte counts, images present, pulls, tags, imports,
  the registry's container): the docker SDK, made on first use (it is slow to import),
  its errors turned into :class:`EngineError`.

Two kinds of client exist on the machines imgpipe runs on: one with the buildx plugin,
and one without it whose ``docker build`` still uses the engine's built-in BuildKit when
``DOCKER_BUILDKIT=1`` is set (Docker 18.09 .. 22.x; the newer CLI refuses to do that
without buildx).  Detect, don't assume.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from imgpipe.base.errors import CommandError, ImgpipeError
from imgpipe.base.platforms import Platform, emulated_cpuinfo, emulation_env
from imgpipe.base.process import Completed, last_error_line, require, run, stream

NO_ENGINE_HINT = "start one: dockerd --bridge=none --iptables=false & (or ./setup.sh)"


class EngineError(ImgpipeError):
    """The Docker engine does not answer, or refused a call (message from the engine)."""

    code = "engine"


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
    docker_host: str | None = None  # DOCKER_HOST for every call through this client

    @property
    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": self.docker_host} if self.docker_host else {}

    @property
    def usable(self) -> bool:
        return self.build_path is not None and self.engine_version is not None

    def with_host(self, docker_host: str) -> BuildClient:
        if not self.usable:
            raise EngineError(f"the builder {docker_host} does not answer or cannot build",
                              hint="check build.builders in imgpipe.yaml")
        return replace(self, docker_host=docker_host)


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
                return replace(client, docker_host=docker_host)
    if not any(client.engine_version for client in probed):
        raise EngineError("no Docker engine answers", hint=NO_ENGINE_HINT)
    described = ", ".join(f"{c.path} {c.version}" for c in probed)
    raise ImgpipeError(
        f"no docker client here can drive BuildKit ({described})",
        hint="install the buildx plugin (docker-buildx) or Debian's docker.io client",
    )


@dataclass(frozen=True)
class BuildRequest:
    context: Path
    dockerfile: Path
    tags: list[str]
    build_args: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, Path] = field(default_factory=dict)
    timeout_s: float = 7200
    cache: bool = True
    # Registry references whose layers may be reused (the last push); with buildx the first
    # is also where the cache is exported (a registry cache, mode=max).
    cache_from: list[str] = field(default_factory=list)
    platform: str | None = None  # os/arch to build for; None: the engine's own


def _secret_specs(secrets: dict[str, Path]) -> list[str]:
    return [f"id={name},src={path}" for name, path in sorted(secrets.items())]


def run_build(client: BuildClient, request: BuildRequest, on_line: Callable[[str], None]) -> str:
    """Build and return the image ID (``sha256:…``); raise CommandError on failure."""
    if client.build_path == "buildx":
        return _build_buildx(client, request, on_line)
    return _build_builtin(client, request, on_line)


def _build_builtin(client: BuildClient, request: BuildRequest,
                   on_line: Callable[[str], None]) -> str:
    with tempfile.TemporaryDirectory(prefix="imgpipe-build-") as work:
        iidfile = Path(work) / "iid"
        argv = [client.path, "build", "--progress=plain", "--network=host",
                "--iidfile", str(iidfile), "--file", str(request.dockerfile)]
        if request.platform:
            argv += ["--platform", request.platform]
        for name, value in request.build_args.items():
            argv += ["--build-arg", f"{name}={value}"]
        for name, value in request.labels.items():
            argv += ["--label", f"{name}={value}"]
        for spec in _secret_specs(request.secrets):
            argv += ["--secret", spec]
        for tag in request.tags:
            argv += ["--tag", tag]
        if not request.cache:
            argv.append("--no-cache")
        elif request.cache_from:
            # The built-in BuildKit exports no registry cache: inline cache metadata in the
            # pushed image itself, which the next build (any runner) names as --cache-from.
            # The 20.10 engine then wants the layers in its own store ("failed to get layer
            # …: layer does not exist" on a fresh engine): pull the cache image first.
            argv += ["--build-arg", "BUILDKIT_INLINE_CACHE=1"]
            engine = Engine(client.docker_host, timeout=3600)
            for ref in request.cache_from:
                try:
                    if engine.image_id(ref) is None:
                        on_line(f"cache: pull {ref}")
                        engine.pull(ref)
                except EngineError as exc:  # first build, or the registry is away: no cache
                    on_line(f"cache: {ref} unavailable ({exc.message})")
                    continue
                argv += ["--cache-from", ref]
        argv.append(str(request.context))
        stream(argv, on_line, timeout=request.timeout_s,
               env={"DOCKER_BUILDKIT": "1", **client.env},
               what=f"build of {request.tags[0]}")
        return iidfile.read_text().strip()


def _build_buildx(client: BuildClient, request: BuildRequest,
                  on_line: Callable[[str], None]) -> str:
    """buildx through python-on-whales.  The time limit is coreutils' ``timeout`` in front of
    the client (python-on-whales runs the program itself); the image ID is the config digest
    BuildKit writes to the metadata file (what ``--load`` gives the engine)."""
    from python_on_whales import DockerClient, Image  # slow to import: builds only
    from python_on_whales.exceptions import DockerException

    limited = [require("timeout"), "--kill-after=30", f"{request.timeout_s:.0f}", client.path]
    docker = DockerClient(client_call=limited, host=client.docker_host)
    with tempfile.TemporaryDirectory(prefix="imgpipe-build-") as work:
        metadata = Path(work) / "metadata.json"
        try:
            logs = docker.buildx.build(
                request.context, file=request.dockerfile, tags=request.tags,
                build_args=request.build_args, labels=request.labels,
                secrets=_secret_specs(request.secrets), load=True, network="host",
                platforms=[request.platform] if request.platform else None,
                progress="plain", stream_logs=True, cache=request.cache,
                metadata_file=metadata,
                cache_from=([{"type": "registry", "ref": ref} for ref in request.cache_from]
                            if request.cache else None),
                cache_to=({"type": "registry", "ref": request.cache_from[0], "mode": "max"}
                          if request.cache and request.cache_from else None),
            )
            assert logs is not None and not isinstance(logs, Image)  # stream_logs: lines
            for line in logs:
                on_line(line.rstrip("\n"))
        except DockerException as exc:
            output = (exc.stderr or "") + (exc.stdout or "")
            message = (f"build of {request.tags[0]} did not finish within "
                       f"{request.timeout_s:.0f} s" if exc.return_code in (124, 137)
                       else f"build of {request.tags[0]} failed: {last_error_line(output)}")
            raise CommandError(message, argv=list(map(str, exc.docker_command)),
                               returncode=exc.return_code, stderr=output[-2000:]) from exc
        written = json.loads(metadata.read_text())
        return str(written["containerimage.config.digest"])


def run_in_container(client: BuildClient, image: str, argv: list[str],
                     on_line: Callable[[str], None], timeout: float, what: str,
                     platform: str | None = None) -> Completed:
    """``docker run --rm --network=none image argv…`` (a self-test), its output line by line;
    ``platform``: run that platform's image (emulated where the host cannot run it: on the
    CPU and with the /proc/cpuinfo that ``imgpipe.base.platforms`` names for it)."""
    options = ["--platform", platform] if platform else []
    emulated = Platform.parse(platform) if platform and not client.docker_host else None
    cpuinfo = emulated_cpuinfo(emulated) if emulated else None
    with tempfile.TemporaryDirectory(prefix="imgpipe-cpuinfo-") as work:
        if emulated is not None and cpuinfo is not None:
            path = Path(work) / "cpuinfo"
            path.write_text(cpuinfo)
            os.chmod(work, 0o755)
            options += ["--volume", f"{path}:/proc/cpuinfo:ro"]
            for name, value in emulation_env(emulated).items():
                options += ["--env", f"{name}={value}"]
        return stream([client.path, "run", "--rm", "--network=none", *options, image, *argv],
                      on_line, timeout=timeout, env=client.env or None, what=what)


class Engine:
    """The engine's API through the docker SDK, connected on first use.

    ``host`` is a DOCKER_HOST value (settings' ``docker.host``); None reads the
    environment as the docker client does.
    """

    def __init__(self, host: str | None = None, timeout: int = 30) -> None:
        self.host = host
        self.timeout = timeout
        self._client: Any = None

    def _sdk(self) -> Any:
        if self._client is None:
            import docker  # slow to import: only engine calls need it

            try:
                client = (docker.DockerClient(base_url=self.host, timeout=self.timeout)
                          if self.host else docker.from_env(timeout=self.timeout))
                client.ping()
            except docker.errors.DockerException as exc:
                raise EngineError("no Docker engine answers", hint=NO_ENGINE_HINT) from exc
            self._client = client
        return self._client

    def answers(self) -> bool:
        try:
            self._sdk()
        except EngineError:
            return False
        return True

    def _call(self, what: str, action: Callable[[Any], Any]) -> Any:
        import docker

        try:
            return action(self._sdk())
        except docker.errors.DockerException as exc:
            why = getattr(exc, "explanation", None) or str(exc)
            raise EngineError(f"{what}: {why}") from exc

    def image_id(self, reference: str) -> str | None:
        """The ID of the image ``reference`` (a name or an ID) in the engine, None when absent."""
        import docker

        try:
            return str(self._sdk().images.get(reference).id)
        except docker.errors.ImageNotFound:
            return None
        except docker.errors.DockerException as exc:
            raise EngineError(f"cannot look up {reference} in the engine: {exc}") from exc

    def pull(self, reference: str) -> str:
        """Pull ``reference``; its image ID."""
        return str(self._call(f"cannot pull {reference}",
                              lambda sdk: sdk.images.pull(reference).id))

    def tag(self, reference: str, repository: str, tag: str) -> None:
        self._call(f"cannot tag {reference}",
                   lambda sdk: sdk.images.get(reference).tag(repository, tag))

    def container(self, name: str) -> Any | None:
        """The container called ``name`` (the SDK's object: status, logs, stop, remove)."""
        import docker

        try:
            return self._sdk().containers.get(name)
        except docker.errors.NotFound:
            return None
        except docker.errors.DockerException as exc:
            raise EngineError(f"cannot look up container {name}: {exc}") from exc

    def start_container(self, image: str, **options: Any) -> Any:
        """``docker run -d`` of ``image`` with the SDK's ``containers.run`` options."""
        return self._call(f"cannot start a container of {image}",
                          lambda sdk: sdk.containers.run(image, detach=True, **options))

    def push(self, reference: str, advance: Callable[[int], None],
             on_line: Callable[[str], None]) -> None:
        """Push ``repository:tag`` through the engine API, its bytes counted as they go
        (``advance``: the growth of the sum over layers) and each layer's state shown
        (``on_line``); the user's docker config supplies credentials, as for the client."""
        repository, _, tag = reference.rpartition(":")
        if not repository or "/" in tag:
            repository, tag = reference, "latest"
        moved: dict[str, int] = {}
        counted = 0

        def stream(sdk: Any) -> None:
            nonlocal counted
            for event in sdk.images.push(repository, tag=tag, stream=True, decode=True):
                if "error" in event:
                    raise EngineError(f"push of {reference} failed: {event['error']}")
                layer, status = event.get("id"), event.get("status", "")
                detail = event.get("progressDetail") or {}
                if layer and "current" in detail:
                    moved[layer] = int(detail["current"])
                    now = sum(moved.values())
                    if now > counted:
                        advance(now - counted)
                        counted = now
                elif status and not detail:
                    on_line(f"{layer}: {status}" if layer else status)

        self._call(f"cannot push {reference}", stream)

    def import_tarball(self, tarball: Path, reference: str, changes: list[str]) -> str:
        """``docker import`` of a root filesystem tar as ``reference``; the image ID."""
        repository, _, tag = reference.rpartition(":")
        if not repository or "/" in tag:
            repository, tag = reference, "latest"
        self._call(f"cannot import {tarball} as {reference}",
                   lambda sdk: sdk.api.import_image_from_file(
                       str(tarball), repository=repository, tag=tag, changes=changes))
        found = self.image_id(reference)
        if found is None:
            raise EngineError(f"{reference} is missing after import")
        return found

    def run_to_end(self, image: str, command: list[str], **options: Any) -> bytes:
        """Run ``image`` with ``command`` until it exits, removed after; its output."""
        output = self._call(f"{image} {' '.join(command)} failed",
                            lambda sdk: sdk.containers.run(image, command=command, remove=True,
                                                           **options))
        return output if isinstance(output, bytes) else b""
