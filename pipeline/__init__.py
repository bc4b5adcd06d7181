"""imgpipe.pipeline: the CLI, configuration, and the pieces every subsystem shares.

The CLI itself (``imgpipe.pipeline.cli``) is not imported here, so that other
subsystems can use the shared pieces without pulling it in.
"""

from imgpipe.pipeline.config import Settings, load_settings
from imgpipe.pipeline.errors import CommandError, ConfigError, ImgpipeError, ToolMissingError
from imgpipe.pipeline.files import atomic_path, atomic_write

__all__ = [
    "CommandError",
    "ConfigError",
    "ImgpipeError",
    "Settings",
    "ToolMissingError",
    "atomic_path",
    "atomic_write",
    "load_settings",
]
