"""Every hostile or broken layer of tests/hostile_layers.py, refused by the flattening code
alone (both passes, as a conversion runs them), in seconds; nothing written outside.
tests/e2e/test_hostile_layers.py sends the same cases through the registry and the CLI."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from imgpipe.enroot.errors import BlobDigestError, HostileLayerError
from imgpipe.enroot.flatten.layerreader import LayerSource
from imgpipe.enroot.flatten.view import merge
from imgpipe.enroot.flatten.viewwriter import write_stream, write_tree
from tests.hostile_layers import BASE, CASES, entry, layer


def sources(tmp_path: Path, blobs: list[bytes]) -> list[LayerSource]:
    made = []
    for number, blob in enumerate(blobs):
        path = tmp_path / f"layer{number}"
        path.write_bytes(blob)
        made.append(LayerSource("sha256:" + hashlib.sha256(blob).hexdigest(), path))
    return made


def flatten_to_bytes(layers: list[LayerSource]) -> bytes:
    out = io.BytesIO()
    write_stream(merge(layers), layers, out)
    return out.getvalue()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_layer_is_refused_naming_the_layer(case: str, tmp_path: Path) -> None:
    blobs, expected = CASES[case]
    layers = sources(tmp_path, blobs)
    with pytest.raises(HostileLayerError) as caught:
        flatten_to_bytes(layers)
    message = str(caught.value)
    assert expected in message, message
    assert any(message.startswith(f"layer {layer.digest[:19]}") for layer in layers), message


@pytest.mark.parametrize("case", sorted(CASES))
def test_writing_a_tree_refuses_and_writes_nothing_outside(case: str, tmp_path: Path) -> None:
    blobs, _ = CASES[case]
    (tmp_path / "blobs").mkdir()
    layers = sources(tmp_path / "blobs", blobs)
    root = tmp_path / "jail" / "root"
    root.mkdir(parents=True)
    with pytest.raises(HostileLayerError):
        write_tree(merge(layers), layers, root)
    escaped = [p for p in tmp_path.rglob("*") if p.name in ("pwned", "escape")]
    assert escaped == []
    assert not Path("/etc/pwned").exists() and not Path("/tmp/pwned").exists()


def test_a_clean_image_flattens_with_whiteouts_applied(tmp_path: Path) -> None:
    """The same code accepts what is not hostile: a file removed by a whiteout in a later
    layer is gone, an opaque directory loses its lower contents, the rest is there."""
    lower = layer(entry("etc/", tarfile.DIRTYPE), entry("etc/passwd", data=b"root\n"),
                  entry("opt/", tarfile.DIRTYPE), entry("opt/old", data=b"old\n"),
                  entry("gone", data=b"x\n"))
    upper = layer(entry(".wh.gone"), entry("opt/", tarfile.DIRTYPE),
                  entry("opt/.wh..wh..opq"), entry("opt/new", data=b"new\n"))
    stream = flatten_to_bytes(sources(tmp_path, [lower, upper]))
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        names = {m.name.rstrip("/") for m in tar.getmembers()}
        assert tar.extractfile("etc/passwd").read() == b"root\n"  # type: ignore[union-attr]
    assert {"etc/passwd", "opt/new"} <= names
    assert "gone" not in names and "opt/old" not in names


def test_a_changed_blob_is_caught_while_streaming(tmp_path: Path) -> None:
    """Pass 2 checks the bytes it reads against the digest (the cache may change between
    the passes): a blob swapped after pass 1 never reaches the output."""
    layers = sources(tmp_path, [BASE])
    view = merge(layers)
    layers[0].path.write_bytes(layer(entry("etc/", tarfile.DIRTYPE),
                                     entry("etc/passwd", data=b"evil:x:0:0\n")))
    with pytest.raises(BlobDigestError) as caught:
        write_stream(view, layers, io.BytesIO())
    assert caught.value.digest == layers[0].digest
