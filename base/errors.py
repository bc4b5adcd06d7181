"""The one error base every user-caused failure derives from.

The CLI catches :class:`ImgpipeError` in one place (``imgpipe.cli.main``),
prints ``error: <message> (hint: <hint>)`` and exits with ``exit_code``.
Anything else that escapes is a bug and keeps its traceback.

Hierarchy::

    ImgpipeError                    exit 1 unless stated
    ├── ConfigError                 exit 2: imgpipe.yaml / image.yaml / CLI values
    │   └── NotPushedError          imgpipe.pipeline.lock: no digest for an image a command needs
    ├── CommandError                an external program failed (argv, exit code, stderr)
    │   └── ToolMissingError        the program is not installed (hint names the package)
    ├── EngineError                 imgpipe.base.engine: the Docker engine is down or refused
    ├── RegistryError               imgpipe.registry.errors: method, URL, status, error code
    │   ├── AuthError               credentials missing or refused
    │   ├── DigestMismatchError     bytes did not hash to the digest asked for
    │   ├── BrokenRangeError        a ranged download's transfer broke off (asked again)
    │   ├── ReferenceFormatError    a malformed image reference (exit 2)
    │   ├── SharedManifestError     rm of a manifest other tags share, without --force (exit 2)
    │   └── LocalRegistryError      the head-node registry's lifecycle (up/down/gc)
    ├── ConvertError                imgpipe.enroot.errors: a conversion or the cache
    │   ├── HostileLayerError       a layer entry or stream that cannot be trusted
    │   ├── BlobDigestError         a cached blob changed since it was fetched
    │   ├── NoSpaceError            the squashfs folder is full (folder, needed, free)
    │   ├── SquashfsFormatError     a squashfs file whose tables do not parse (refused)
    │   ├── VerifyError             a published squashfs differs from a local conversion
    │   └── StalledError            a broadcast's chain where nothing moved for too long
    └── RecipeError                 imgpipe.recipes.errors: rendering, publishing, pulling
        ├── ShapeError              a shape that cannot keep the global batch (exit 2)
        ├── ProfileError            an unknown or invalid profile (exit 2)
        ├── SandboxError            imgpipe.recipes.sandbox: the local cluster
        └── ReportError             imgpipe.recipes.report: a results folder with nothing to show

Subsystem errors live beside their subsystem (drawn here so the whole tree is
in one place); import them from where they are defined.
"""

from __future__ import annotations

from collections.abc import Sequence


class ImgpipeError(Exception):
    """A failure the user can act on: one line of message, an optional hint."""

    exit_code = 1
    code = "failed"  # stable machine-readable code for --json envelopes

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


class ConfigError(ImgpipeError):
    """Invalid configuration or usage: names the file, the key and what is wrong."""

    exit_code = 2
    code = "config"


class CommandError(ImgpipeError):
    """An external program exited non-zero; keeps argv, exit code and stderr's tail."""

    code = "command"

    def __init__(
        self,
        message: str,
        argv: Sequence[str] = (),
        returncode: int | None = None,
        stderr: str = "",
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint)
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr


class ToolMissingError(CommandError):
    """A program imgpipe needs is not on PATH."""

    code = "tool-missing"
