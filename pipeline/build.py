"""One BuildKit build: buildx through python-on-whales, or the engine's built-in BuildKit.

With buildx the image is loaded into the engine (``--load``); with the
built-in BuildKit (``DOCKER_BUILDKIT=1 docker build``, which python-on-whales'
legacy path cannot give secrets to) the engine keeps it.  Either way the
image ID comes from a file BuildKit writes (``--iidfile``), never from its
progress text.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from python_on_whales import DockerClient, Image
from python_on_whales.exceptions import DockerException

from imgpipe.base.errors import CommandError
from imgpipe.base.process import last_error_line, stream
from imgpipe.pipeline.engine import BuildClient


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
        argv.append(str(request.context))
        stream(argv, on_line, timeout=request.timeout_s, env={"DOCKER_BUILDKIT": "1"},
               what=f"build of {request.tags[0]}")
        return iidfile.read_text().strip()


def _build_buildx(client: BuildClient, request: BuildRequest,
                  on_line: Callable[[str], None]) -> str:
    docker = DockerClient(client_call=[client.path])
    try:
        logs = docker.buildx.build(
            request.context, file=request.dockerfile, tags=request.tags,
            build_args=request.build_args, labels=request.labels,
            secrets=_secret_specs(request.secrets), load=True, network="host",
            progress="plain", stream_logs=True, cache=request.cache,
        )
        assert logs is not None and not isinstance(logs, Image)  # stream_logs=True: lines
        for line in logs:
            on_line(line.rstrip("\n"))
        return docker.image.inspect(request.tags[0]).id
    except DockerException as exc:
        output = (exc.stderr or "") + (exc.stdout or "")
        raise CommandError(f"build of {request.tags[0]} failed: {last_error_line(output)}",
                           argv=list(map(str, exc.docker_command)),
                           returncode=exc.return_code, stderr=output[-2000:]) from exc
