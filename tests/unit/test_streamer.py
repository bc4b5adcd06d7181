"""The streamer (enroot.flatten.streamer) writes the root the two passes (enroot.flatten.view, then
enroot.flatten.viewwriter) write, whatever the layers hold, or says it cannot (TwoPassesNeeded) and
the converter merges first; it refuses every hostile layer the view refuses; its headers are
tarfile's bytes.  Random layer stacks (hundreds of decoder processes):
tests/e2e/test_streamer_random.py."""

from __future__ import annotations

import ctypes
import gzip
import hashlib
import io
import mmap
import os
import random
import tarfile
import threading
from pathlib import Path

import pytest
import zstandard

from imgpipe.enroot.errors import BlobDigestError, HostileLayerError
from imgpipe.enroot.flatten.layerreader import LayerSource
from imgpipe.enroot.flatten.streamer import TwoPassesNeeded, write_stream_once
from imgpipe.enroot.flatten.tarwriter import Item, _tarfile_header, tar_header
from imgpipe.enroot.flatten.view import merge
from imgpipe.enroot.flatten.viewwriter import write_stream
from imgpipe.registry.errors import RegistryError
from tests.hostile_layers import CASES, entry, layer

DIR, FILE, SYM, LNK = tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
RC = {"etc/rc": ("echo rc\n", 0o755), "etc/rc.local": ("", 0o644)}


def sources(folder: Path, blobs: list[bytes], diff_ids: bool = False) -> list[LayerSource]:
    folder.mkdir(exist_ok=True)
    made = []
    for number, blob in enumerate(blobs):
        path = folder / f"layer{number}"
        path.write_bytes(blob)
        diff_id = None
        if diff_ids:
            raw = blob
            if blob[:2] == b"\x1f\x8b":
                raw = gzip.decompress(blob)
            elif blob[:4] == b"\x28\xb5\x2f\xfd":
                raw = zstandard.ZstdDecompressor().decompressobj().decompress(blob)
            diff_id = f"sha256:{hashlib.sha256(raw).hexdigest()}"
        made.append(LayerSource("sha256:" + hashlib.sha256(blob).hexdigest(), path, diff_id))
    return made


def two_passes(layers: list[LayerSource], rc: dict | None = None) -> bytes:
    out = io.BytesIO()
    write_stream(merge(layers, rc), layers, out)
    return out.getvalue()


def one_pass(layers: list[LayerSource], rc: dict | None = None, diff_ids: bool = True
             ) -> bytes:
    out = io.BytesIO()
    write_stream_once(layers, rc, out, hash_tars=diff_ids)
    return out.getvalue()


def root_of(stream: bytes) -> dict[str, tuple]:
    """What tar2sqfs builds from ``stream``: each path's kind, mode, mtime and content (a
    hard link shows its target's); refuses a stream naming a path twice."""
    root: dict[str, tuple] = {}
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        for member in tar:
            name = member.name.rstrip("/")
            assert name not in root, f"{name} twice in the stream"
            if member.islnk():
                root[name] = root[member.linkname]
            elif member.isfile():
                content = tar.extractfile(member).read()  # type: ignore[union-attr]
                root[name] = ("file", member.mode, member.mtime, content)
            else:
                root[name] = (member.type, member.mode, member.mtime, member.linkname)
            assert member.uid == member.gid == 0
    return root


SCENARIOS = {
    "whiteout and opaque directory": [
        layer(entry("usr/", DIR), entry("usr/lib/", DIR), entry("usr/lib/a", data=b"a"),
              entry("usr/lib/b", data=b"b"), entry("opt/", DIR), entry("opt/x", data=b"x")),
        layer(entry("usr/lib/.wh.a"), entry("opt/.wh..wh..opq"), entry("opt/y", data=b"y")),
    ],
    "a file over a directory and a directory over a file": [
        layer(entry("d/", DIR), entry("d/inner", data=b"i"), entry("f", data=b"f")),
        layer(entry("d", data=b"now a file"), entry("f/", DIR), entry("f/child", data=b"c")),
    ],
    "a file implied into a directory by a later layer": [
        layer(entry("p", data=b"file"), entry("q", data=b"q")),
        layer(entry("p/below", data=b"b")),
    ],
    "hard links within and across layers": [
        layer(entry("bin/", DIR), entry("bin/tool", data=b"tool v1"),
              entry("bin/alias", LNK, link="bin/tool")),
        layer(entry("bin/other", LNK, link="bin/tool")),
    ],
    "a hard link whose target a later layer replaces": [
        layer(entry("lib/", DIR), entry("lib/libx.so", data=b"old bytes")),
        layer(entry("lib/libx.so.1", LNK, link="lib/libx.so")),
        layer(entry("lib/libx.so", data=b"new bytes")),
    ],
    "symlinks, whiteouts of directories, rc files over the image's": [
        layer(entry("etc/", DIR), entry("etc/rc", data=b"image rc"), entry("tree/", DIR),
              entry("tree/a/", DIR), entry("tree/a/deep", data=b"d"),
              entry("link", SYM, link="tree/a")),
        layer(entry(".wh.tree"), entry("link2", SYM, link="/etc")),
    ],
    "names past 100 bytes and a directory's metadata from the top layer": [
        layer(entry("long/", DIR), entry("long/" + "n" * 150, data=b"long"),
              entry("long/s", SYM, link="t" * 140)),
        layer(entry("long/", DIR), entry("long/more", data=b"m")),
    ],
    "devices dropped, empty layers kept": [
        layer(entry("dev/null", tarfile.CHRTYPE), entry("a", data=b"a")),
        layer(),
        layer(entry("b", data=b"b" * 70000), compress=False),
    ],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_one_pass_writes_the_root_two_passes_write(name: str, tmp_path: Path) -> None:
    layers = sources(tmp_path, SCENARIOS[name], diff_ids=True)
    assert root_of(one_pass(layers, RC)) == root_of(two_passes(layers, RC))


def test_zstd_and_plain_layers_read_the_same(tmp_path: Path) -> None:
    raw = layer(entry("z/", DIR), entry("z/file", data=b"zz" * 5000), compress=False)
    blobs = [zstandard.ZstdCompressor().compress(raw), raw, gzip.compress(raw)]
    layers = sources(tmp_path, blobs, diff_ids=True)
    root = root_of(one_pass(layers))
    assert root["z/file"][3] == b"zz" * 5000 and root == root_of(two_passes(layers))


def test_a_path_twice_in_one_layer_needs_two_passes(tmp_path: Path) -> None:
    layers = sources(tmp_path, [layer(entry("x", data=b"first"), entry("x", data=b"second"))])
    with pytest.raises(TwoPassesNeeded, match="placed once already"):
        one_pass(layers)
    assert root_of(two_passes(layers))["x"][3] == b"second"


def test_a_whiteout_beside_new_entries_below_it_needs_two_passes(tmp_path: Path) -> None:
    layers = sources(tmp_path, [
        layer(entry("d/", DIR), entry("d/old", data=b"o")),
        layer(entry("d/new", data=b"n"), entry(".wh.d")),
    ])
    with pytest.raises(TwoPassesNeeded):
        one_pass(layers)


def as_converted(layers: list[LayerSource]) -> bytes:
    """As `imgpipe convert` streams into tar2sqfs: one pass, or two when it cannot."""
    try:
        return one_pass(layers)
    except TwoPassesNeeded:
        return two_passes(layers)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_pass_refuses_every_hostile_layer(case: str, tmp_path: Path) -> None:
    blobs, expected = CASES[case]
    layers = sources(tmp_path, blobs)
    with pytest.raises(HostileLayerError) as caught:
        as_converted(layers)
    message = str(caught.value)
    assert expected in message, message
    assert any(message.startswith(f"layer {layer.digest[:19]}") for layer in layers), message


def test_diff_ids_are_checked_when_asked(tmp_path: Path) -> None:
    [good] = sources(tmp_path, [layer(entry("f", data=b"f"))], diff_ids=True)
    lying = LayerSource(good.digest, good.path, "sha256:" + "0" * 64)
    with pytest.raises(HostileLayerError, match="not to the image config's diff_id"):
        one_pass([lying])
    assert root_of(one_pass([lying], diff_ids=False))["f"][3] == b"f"


def test_a_blob_changed_on_disk_is_caught_unless_this_process_hashed_it(tmp_path: Path
                                                                        ) -> None:
    [source] = sources(tmp_path, [layer(entry("f", data=b"original"))])
    source.path.write_bytes(layer(entry("f", data=b"tampered")))
    with pytest.raises(BlobDigestError):
        one_pass([source])
    fetched_now = LayerSource(source.digest, source.path, hashed=True)
    assert root_of(one_pass([fetched_now]))["f"][3] == b"tampered"


def test_headers_are_tarfiles_bytes() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        kind = rng.choice(["dir", "file", "symlink", "hardlink", "fifo"])
        name = "/".join(rng.choice(["usr", "é", "x" * rng.randint(1, 70)])
                        for _ in range(rng.randint(1, 3)))
        link = "../" * rng.randint(0, 3) + "t" * rng.randint(1, 99) if kind in (
            "symlink", "hardlink") else None
        size = rng.choice([0, 1, 511, 512, 8**11 - 1, 8**11, 3 << 33]) if kind == "file" else 0
        item = Item(name, kind, rng.randint(0, 0o7777), rng.choice([0, 1 << 30, 8**11]), size,
                    None, link)
        assert tar_header(item) == _tarfile_header(item), item


class _Seen(io.BytesIO):
    """An output that says when some bytes have gone through it."""

    def __init__(self, marker: bytes) -> None:
        super().__init__()
        self.marker, self.seen = marker, threading.Event()

    def write(self, data) -> int:  # type: ignore[no-untyped-def, override]
        written = super().write(data)
        if self.marker in self.getvalue()[-(len(data) + len(self.marker)):]:
            self.seen.set()
        return written


def test_the_top_layer_streams_while_the_lower_ones_are_still_fetched(tmp_path: Path
                                                                      ) -> None:
    blobs = [layer(entry("usr/", DIR), entry("usr/base", data=b"bottom bytes")),
             layer(entry("usr/mid", data=b"middle bytes")),
             layer(entry("usr/top", data=b"TOP-LAYER-BYTES" * 1000))]
    layers = sources(tmp_path, blobs, diff_ids=True)
    out = _Seen(b"TOP-LAYER-BYTES")
    asked: list[int] = []

    def ready(number: int) -> LayerSource:  # a fetch: the lower layers land only later
        asked.append(number)
        if number < 2:
            assert out.seen.wait(10), "the top layer was not written while this one waited"
        return layers[number]

    write_stream_once(layers, RC, out, ready=ready)
    assert asked == [2, 1, 0]
    assert root_of(out.getvalue()) == root_of(two_passes(layers, RC))


def test_a_fetch_that_fails_is_the_error_raised(tmp_path: Path) -> None:
    layers = sources(tmp_path, [layer(entry("a", data=b"a")), layer(entry("b", data=b"b"))])

    def ready(number: int) -> LayerSource:
        if number == 0:
            raise RegistryError("download of the bottom layer broke off")
        return layers[number]

    with pytest.raises(RegistryError, match="broke off"):
        write_stream_once(layers, None, io.BytesIO(), ready=ready)


def test_large_files_moved_pipe_to_pipe_arrive_whole(tmp_path: Path) -> None:
    """Into a pipe (the squash tool's stdin) a large file's bytes are spliced from the
    decoder's pipe, not copied through this one: the stream is the same bytes."""
    rng = random.Random(5)
    big, odd = rng.randbytes(9 << 20), rng.randbytes((3 << 20) + 777)
    layers = sources(tmp_path, [
        layer(entry("lib/", DIR), entry("lib/big.so", data=big), entry("lib/small", data=b"s")),
        layer(entry("lib/odd.so", data=odd), entry("lib/.wh.small"),
              entry("top", data=rng.randbytes(70_000)))])
    read_end, write_end = os.pipe()
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.extend(iter(
        lambda: os.read(read_end, 1 << 20), b"")))
    reader.start()
    with open(write_end, "wb", buffering=1 << 20) as out:
        write_stream_once(layers, None, out)
    reader.join()
    os.close(read_end)
    piped = b"".join(received)
    assert piped == one_pass(layers, diff_ids=False)
    root = root_of(piped)
    assert root["lib/big.so"][3] == big and root["lib/odd.so"][3] == odd
    assert "lib/small" not in root


def resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    size = path.stat().st_size
    with open(path, "rb") as handle:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0)
    assert address not in (None, ctypes.c_void_p(-1).value)
    pages = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    try:
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) == 0
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(page & 1 for page in pages)


def test_blobs_read_through_leave_the_page_cache(tmp_path: Path) -> None:
    """A conversion reads each blob once: its pages must not push a node's other files
    (the squashfs it is about to run) out of memory."""
    [made] = sources(tmp_path, [layer(entry("lib/big.so",
                                            data=random.Random(3).randbytes(4 << 20)))])
    with open(made.path, "rb+") as handle:
        os.fsync(handle.fileno())  # written back: clean pages, which the kernel may drop
        while handle.read(1 << 20):
            pass
    assert resident_pages(made.path) > 0
    assert root_of(one_pass([made], diff_ids=False))["lib/big.so"][3][:4]
    assert resident_pages(made.path) == 0
