"""Session fixtures that start real parts: the Docker engine, registries, the base image.

A missing part fails the tests that need it; nothing is skipped silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from imgpipe.pipeline.cli import main
from tests import services


@pytest.fixture(autouse=True)
def _no_proxy_or_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests talk to 127.0.0.1 only and never read the developer's imgpipe.yaml."""
    for name in ("IMGPIPE_CONFIG", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    with services.docker_engine():
        yield


@pytest.fixture(scope="session")
def base_image(docker_engine: None) -> str:
    return services.ensure_base_image()


@pytest.fixture(scope="session")
def registry_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.RegistryProcess]:
    """One plain-HTTP registry for the session (docker treats 127.0.0.1 as insecure-ok)."""
    server = services.start_registry(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


class CliRun:
    """The CLI run in-process, in a folder of its own with an imgpipe.yaml."""

    def __init__(self, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.folder = folder
        self.capsys = capsys

    def write_config(self, config: dict) -> Path:
        path = self.folder / "imgpipe.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        old = Path.cwd()
        os.chdir(self.folder)
        try:
            code = main(list(args))
        finally:
            os.chdir(old)
        out, err = self.capsys.readouterr()
        return code, out, err


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> CliRun:
    return CliRun(tmp_path, capsys)


@pytest.fixture
def managed_registry(cli: CliRun) -> Iterator[CliRun]:
    """A registry started by `imgpipe registry up` (binary mode) on a free port."""
    cli.write_config({"registry": {"port": services.free_port(),
                                   "server": {"mode": "binary"}}})
    code, out, err = cli("registry", "up")
    assert code == 0, err
    yield cli
    cli("registry", "down")
