"""imgpipe.pipeline: the CLI, configuration, and the pieces every subsystem shares.

The CLI itself (``imgpipe.pipeline.cli``) is not imported here, so that other
subsystems can use the shared pieces without pulling it in.  The names below are
resolved on first use (PEP 562): importing any ``imgpipe.pipeline`` module must not
load the configuration's pydantic models, which the Pyxis importer's fast path and
``imgpipe --help`` do without.
"""

from __future__ import annotations

from imgpipe.pipeline.lazy import lazy_exports

_HOME = {
    "Settings": "imgpipe.pipeline.config",
    "load_settings": "imgpipe.pipeline.config",
    "CommandError": "imgpipe.pipeline.errors",
    "ConfigError": "imgpipe.pipeline.errors",
    "ImgpipeError": "imgpipe.pipeline.errors",
    "ToolMissingError": "imgpipe.pipeline.errors",
    "atomic_path": "imgpipe.pipeline.files",
    "atomic_write": "imgpipe.pipeline.files",
}

__all__ = sorted(_HOME)


__getattr__ = lazy_exports("imgpipe.pipeline", _HOME)
