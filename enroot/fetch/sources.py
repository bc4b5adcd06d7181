"""An image's layers as the converters read them: blob, digest, the config's diff_id.

The layers are known before their blobs are (from the manifest and config), so a
conversion starts on the top layer while the rest are still fetched: :class:`Arrivals`
hands each layer over once its fetch has finished, as a source that says whether this
process hashed its bytes on the way (they are then not hashed again).
"""

from __future__ import annotations

from dataclasses import replace

from imgpipe.enroot.errors import ConvertError, HostileLayerError
from imgpipe.enroot.fetch.blobs import FetchedImage, ImageFetch
from imgpipe.enroot.flatten.layerreader import LayerSource

# Layer media types a conversion accepts (OCI and Docker schema 2); anything else, such as
# foreign (Windows) layers or artifacts, is refused rather than guessed at.
LAYER_MEDIA_TYPES = frozenset({
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd",
})


def layer_sources(image: FetchedImage) -> list[LayerSource]:
    """The image's layers with the diff_ids their config promises; refuses unknown types."""
    diff_ids = list((image.config.get("rootfs") or {}).get("diff_ids") or [])
    if len(diff_ids) != len(image.layers):
        raise ConvertError(f"{image.repository}: the config lists {len(diff_ids)} diff_id(s) "
                           f"for {len(image.layers)} layer(s)",
                           hint="the image is broken; rebuild and push it")
    for layer in image.layers:
        if layer.media_type not in LAYER_MEDIA_TYPES:
            raise HostileLayerError(layer.digest, "(manifest)",
                                    f"unknown layer media type {layer.media_type!r}")
    return [LayerSource(layer.digest, layer.path, diff_id, hashed=layer.fetched)
            for layer, diff_id in zip(image.layers, diff_ids, strict=True)]


class Arrivals:
    """The layers of an image being fetched, each handed over once it is in the cache."""

    def __init__(self, fetching: ImageFetch) -> None:
        self.fetching = fetching
        self.planned = layer_sources(fetching.planned())  # refused before a byte is read

    def ready(self, number: int) -> LayerSource:
        """Layer ``number`` (manifest order) once fetched; the fetch's error if it failed."""
        layer = self.fetching.layer(number)
        return replace(self.planned[number], path=layer.path, hashed=layer.fetched)

    def all(self) -> list[LayerSource]:
        """Every layer, once all are fetched."""
        return layer_sources(self.fetching.wait())

    @property
    def blob_bytes(self) -> int:
        """The layers' compressed size, as the manifest gives it."""
        return sum(self.fetching.layer_sizes)
