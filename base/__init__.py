"""imgpipe.base: what every layer shares, and nothing that knows a subsystem.

Errors with hints, the one place external programs start (``process``), atomic files,
the configuration file's model, sizes, progress display.  It imports no other part of
imgpipe.  The names below resolve on first use (PEP 562): importing a base module does
not load the configuration's pydantic models, which the Pyxis importer's fast path and
``imgpipe --help`` do without.
"""

from __future__ import annotations

from imgpipe.base.lazy import lazy_exports

_HOME = {
    "Settings": "imgpipe.base.config",
    "load_settings": "imgpipe.base.configlayers",
    "CommandError": "imgpipe.base.errors",
    "ConfigError": "imgpipe.base.errors",
    "ImgpipeError": "imgpipe.base.errors",
    "ToolMissingError": "imgpipe.base.errors",
    "atomic_path": "imgpipe.base.files",
    "atomic_write": "imgpipe.base.files",
}

__all__ = sorted(_HOME)


__getattr__ = lazy_exports("imgpipe.base", _HOME)
