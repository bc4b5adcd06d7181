"""Errors of the enroot subsystem (the whole tree is drawn in imgpipe.pipeline.errors)."""

from __future__ import annotations

from imgpipe.pipeline.errors import ImgpipeError


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
