"""Errors of the enroot subsystem (the whole tree is drawn in imgpipe.base.errors)."""

from __future__ import annotations

from pathlib import Path

from imgpipe.base.errors import ImgpipeError


class ConvertError(ImgpipeError):
    """A conversion failed: a broken or hostile layer, a squash tool error, a bad cache."""

    code = "convert"


class HostileLayerError(ConvertError):
    """A layer entry that would write outside the root or cannot be trusted."""

    code = "hostile-layer"

    def __init__(self, layer: str, entry: str, why: str) -> None:
        shown = entry if len(entry) <= 120 else entry[:117] + "..."
        shown = shown.replace("\x00", "\\0").replace("\n", "\\n")
        super().__init__(f"layer {layer[:19]}: entry {shown!r}: {why}",
                         hint="the image is broken or hostile; rebuild it from a trusted base")
        self.layer = layer
        self.entry = entry


class BlobDigestError(ConvertError):
    """A cached blob whose bytes no longer match its digest (changed, truncated, swapped).

    The conversion evicts it and fetches it again once; the registry's copy is checked
    while streaming, so a second mismatch means the storage under the cache is failing.
    """

    code = "blob-digest"

    def __init__(self, digest: str, found: str, path: Path) -> None:
        super().__init__(f"cached blob {digest[:19]} does not match its digest (its bytes hash "
                         f"to {found[:19]})", hint=f"remove {path} and convert again")
        self.digest = digest
        self.path = path


class NoSpaceError(ConvertError):
    """The squashfs folder (or the work area) cannot hold the conversion."""

    code = "no-space"

    def __init__(self, folder: Path, needed: int, free: int) -> None:
        super().__init__(f"not enough space in {folder}: the conversion needs about "
                         f"{_mib(needed)}, {_mib(free)} free",
                         hint="free space there, or set outputs.squashfs_dir to a larger "
                         "file system; see imgpipe cache prune")
        self.folder, self.needed, self.free = folder, needed, free


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"


class VerifyError(ConvertError):
    """A published squashfs differs from a local conversion of its image, or none is
    published to compare with (``imgpipe verify``)."""

    code = "verify"
