"""Build secrets: gathered into files only BuildKit reads, for one build, then removed.

They reach a build only as BuildKit ``--secret id=NAME,src=FILE`` mounts
(``RUN --mount=type=secret,id=NAME``), never as build args, labels or
context files, so no layer, no ``docker history`` line and no log holds them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError


@contextlib.contextmanager
def secret_files(settings: Settings, wanted: list[str],
                 overrides: dict[str, Path] | None = None) -> Iterator[dict[str, Path]]:
    """Map each secret ``wanted`` that is available to a readable file."""
    sources = settings.build.secrets
    overrides = overrides or {}
    found: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="imgpipe-secrets-") as private:
        os.chmod(private, 0o700)
        for name in wanted:
            if name in overrides:
                path = overrides[name]
                if not path.is_file():
                    raise ConfigError(f"secret {name}: {path} does not exist",
                                      hint="fix the path given to --secret")
                found[name] = path
            elif name == "ca_bundle" and sources.ca_bundle is not None:
                path = settings.path(sources.ca_bundle)
                if path.is_file():
                    found[name] = path
            elif name == "pip_config" and sources.pip_config is not None:
                path = settings.path(sources.pip_config)
                if not path.is_file():
                    raise ConfigError(f"build.secrets.pip_config: {path} does not exist")
                found[name] = path
            elif name == "ngc_api_key" and os.environ.get(sources.ngc_api_key_env):
                path = Path(private) / name
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(os.environ[sources.ngc_api_key_env])
                found[name] = path
        yield found
