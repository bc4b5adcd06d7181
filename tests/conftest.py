"""What every test shares: no proxy or ambient configuration, and `cli`, which runs imgpipe
as a user types it, in a folder of its own.  The fixtures that start real parts live in
tests/e2e/conftest.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from imgpipe.cli.main import main


@pytest.fixture(autouse=True)
def _no_proxy_or_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests talk to 127.0.0.1 only and never read the developer's imgpipe.yaml."""
    for name in ("IMGPIPE_CONFIG", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)


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


