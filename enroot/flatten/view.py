"""The view: the root the layers make, folded from their headers, bottom layer first.

A layer's entries replace those of the layers below at the same path (a directory over a
directory keeps the lower one's children), whiteouts remove lower entries, and every entry
obeys the layer rules (``enroot.flatten.rules``), checked before it can matter: refusals name
the layer and the entry.  The fold runs over headers a caller already holds
(:class:`ViewBuilder`: the streamer collects them as it writes) or over headers read here
(:func:`merge`, the first of the two passes: two decoders read every other layer each,
data skipped).  The view is the truth both converter paths are held to: the streamer must
have written exactly its entries, the view writer writes them.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten.layerreader import LayerPipe, LayerSource
from imgpipe.enroot.flatten.rules import (
    MOUNT_POINT_MODE,
    RUNTIME_MOUNT_POINTS,
    check_symlink,
    dropped,
    hardlink_target,
    is_setid,
    kind_of,
    normalize,
    symlinked_parent,
    whiteout_of,
)
from imgpipe.enroot.flatten.tarreader import Member, read_layer
from imgpipe.enroot.flatten.tarwriter import Item, implicit_dir

HEADER_READERS = 2  # decoders reading layers' headers at once (every other layer each)
# Blob bytes past which a second decoder pays for its start (a process: about 0.1 s)
PARALLEL_FROM = 64 << 20
Entry = tuple[int, int]  # (layer index, member index within the layer)


@dataclass(slots=True)
class Node:
    kind: str  # dir | file | symlink | hardlink | fifo
    entry: Entry | None  # None: an implicit directory no layer described
    data: Entry | None = None  # for files and hard links: where the bytes are
    link: str | None = None


@dataclass
class LayerCounts:
    digest: str
    entries: int = 0
    whiteouts: int = 0
    opaque: int = 0
    devices_skipped: int = 0


@dataclass
class MergedView:
    nodes: dict[str, Node]
    children: dict[str, set[str]]
    counts: list[LayerCounts]
    members: list[list[Member]]
    extra_files: dict[str, tuple[bytes, int]] = field(default_factory=dict)

    def winners(self) -> set[Entry]:
        return {n.entry for n in self.nodes.values() if n.entry is not None}

    def member(self, entry: Entry) -> Member:
        return self.members[entry[0]][entry[1]]

    def implicit_dirs(self) -> Iterator[Item]:
        """The folders no layer described, only implied by paths below them."""
        for path, node in sorted(self.nodes.items()):
            if node.entry is None and node.kind == "dir":
                yield implicit_dir(path)

    def added_files(self) -> Iterator[Item]:
        """Enroot's files and the runtimes' mount points: written last."""
        for path, (content, mode) in sorted(self.extra_files.items()):
            yield Item(path, "file", mode, 0, len(content), io.BytesIO(content))

    def setid_paths(self) -> set[str]:
        """Paths of set-id files in the root (what a squashfs of these layers may hold)."""
        found = set()
        for path, node in self.nodes.items():
            where = node.data or node.entry
            if node.kind in ("file", "hardlink") and where is not None:
                if is_setid(self.member(where).mode):
                    found.add(path)
        return found

    @property
    def file_bytes(self) -> int:
        """Bytes of regular-file data in the final view (what an unpacked tree holds)."""
        total = sum(len(content) for content, _ in self.extra_files.values())
        for node in self.nodes.values():
            if node.kind == "file" and node.entry is not None:
                total += self.member(node.entry).size
        return total


class _Merger:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.children: dict[str, set[str]] = {"": set()}

    def remove(self, path: str, below_layer: int | None = None) -> None:
        """Remove ``path`` and its subtree (only entries from layers below ``below_layer``)."""
        node = self.nodes.get(path)
        if node is None:
            return
        if node.kind == "dir":
            for child in list(self.children.get(path, ())):
                self.remove(f"{path}/{child}" if path else child, below_layer)
            if below_layer is not None and self.children.get(path):
                return  # something from this layer lives below: keep the directory
            self.children.pop(path, None)
        if below_layer is not None and node.entry is not None and node.entry[0] >= below_layer:
            return
        del self.nodes[path]
        parent, _, base = path.rpartition("/")
        self.children.get(parent, set()).discard(base)

    def empty_dir(self, path: str, below_layer: int) -> None:
        for child in list(self.children.get(path, ())):
            self.remove(f"{path}/{child}" if path else child, below_layer)

    def ensure_parents(self, path: str, layer: LayerSource, shown: str) -> None:
        """Folders at every parent of ``path`` (implicit ones where no layer made them)."""
        parts = path.split("/")[:-1]
        prefix = ""
        for part in parts:
            parent = prefix
            prefix = f"{prefix}/{part}" if prefix else part
            node = self.nodes.get(prefix)
            if node is not None and node.kind == "symlink":
                raise symlinked_parent(prefix, node.link, layer.digest, shown)
            if node is None or node.kind != "dir":
                if node is not None:
                    self.remove(prefix)
                self.nodes[prefix] = Node("dir", None)
                self.children.setdefault(prefix, set())
                self.children.setdefault(parent, set()).add(part)

    def put(self, path: str, node: Node) -> None:
        existing = self.nodes.get(path)
        if existing is not None:
            if existing.kind == "dir" and node.kind == "dir":
                existing.entry = node.entry  # metadata from the newer layer, children kept
                return
            self.remove(path)
        self.nodes[path] = node
        if node.kind == "dir":
            self.children.setdefault(path, set())
        parent, _, base = path.rpartition("/")
        self.children.setdefault(parent, set()).add(base)


def layer_members(layers: list[LayerSource]) -> Generator[list[Member], None, None]:
    """Every layer's members, bottom first, read by HEADER_READERS decoders at once (each
    reads every other layer; decompression is most of the work), or by one for small
    layers.  Each layer is verified as
    it is read: the view places bytes by these headers, so they must come from the very
    bytes the digest names.  The first refused layer, in order, is the error raised."""
    results: list[Future[list[Member]]] = [Future() for _ in layers]
    stop = threading.Event()
    shares = HEADER_READERS if _blob_bytes(layers) >= PARALLEL_FROM else 1

    def read_share(first: int) -> None:
        numbers = range(first, len(layers), shares)
        try:
            with LayerPipe(len(numbers), lambda k: layers[numbers[k]]) as pipe:
                for number, reader in zip(numbers, pipe.readers(), strict=False):
                    if stop.is_set():
                        break
                    results[number].set_result(read_layer(reader.layer, reader))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, in order
            for number in numbers:
                if not results[number].done():
                    results[number].set_exception(exc)
                    break
        for number in numbers:
            results[number].cancel()  # those this share did not reach

    readers = [threading.Thread(target=read_share, args=(first,), daemon=True,
                                name="layer-headers")
               for first in range(min(shares, len(layers)))]
    for thread in readers:
        thread.start()
    try:
        for future in results:
            try:
                yield future.result()
            except CancelledError:
                raise AssertionError("a layer's headers were never read") from None
    finally:
        stop.set()
        for thread in readers:
            thread.join()


def _blob_bytes(layers: list[LayerSource]) -> int:
    total = 0
    for layer in layers:
        with contextlib.suppress(OSError):  # the decoder says what is wrong with it
            total += layer.path.stat().st_size
    return total


def merge(layers: list[LayerSource], rc_files: dict[str, tuple[str, int]] | None = None
          ) -> MergedView:
    """The view of ``layers`` (bottom first), every layer read for its headers."""
    builder = ViewBuilder()
    with contextlib.closing(layer_members(layers)) as read:  # a refusal stops the readers
        for layer, members in zip(layers, read, strict=True):
            builder.add_layer(layer, members)
    return builder.finish(rc_files)


class ViewBuilder:
    """The fold: layers' headers added bottom first, then the view."""

    def __init__(self) -> None:
        self.merger = _Merger()
        self.counts: list[LayerCounts] = []
        self.members: list[list[Member]] = []

    def add_layer(self, layer: LayerSource, members: list[Member],
                  paths: list[str | None] | None = None) -> None:
        """Fold in the next layer up; ``paths``: its members' names as ``normalize`` gave
        them already (None where it did not)."""
        number = len(self.members)
        count = LayerCounts(layer.digest)
        self.counts.append(count)
        self.members.append(members)
        for index, member in enumerate(members):
            path = paths[index] if paths is not None else None
            _merge_member(self.merger, number, index, member, layer, count,
                          normalize(member.name, layer.digest) if path is None else path)

    def finish(self, rc_files: dict[str, tuple[str, int]] | None = None) -> MergedView:
        """The view, with Enroot's rc files and the runtimes' mount points added on top."""
        merger = self.merger
        extra: dict[str, tuple[bytes, int]] = {}
        for path, (content, mode) in (rc_files or {}).items():
            merger.ensure_parents(path, LayerSource("(enroot files)", Path()), path)
            merger.remove(path)
            merger.put(path, Node("file", None))
            extra[path] = (content.encode(), mode)
        for path in RUNTIME_MOUNT_POINTS:
            if path not in merger.nodes and "etc" in merger.nodes:
                merger.put(path, Node("file", None))
                extra[path] = (b"", MOUNT_POINT_MODE)
        return MergedView(merger.nodes, merger.children, self.counts, self.members, extra)


def _merge_member(merger: _Merger, number: int, index: int, member: Member,
                  layer: LayerSource, count: LayerCounts, path: str) -> None:
    count.entries += 1
    if dropped(member, path):
        if path:
            count.devices_skipped += 1
        return
    merger.ensure_parents(path, layer, member.name)
    whiteout = whiteout_of(path, layer.digest, member.name)
    if whiteout is not None:
        hidden, opaque = whiteout
        if opaque:
            count.opaque += 1
            merger.empty_dir(hidden, below_layer=number)
        else:
            count.whiteouts += 1
            merger.remove(hidden, below_layer=number)
        return
    entry = (number, index)
    kind = kind_of(member, layer.digest)
    if kind == "symlink":
        check_symlink(path, member, layer.digest)
        merger.put(path, Node("symlink", entry, link=member.linkname))
    elif kind == "hardlink":
        target = hardlink_target(member, layer.digest)
        source = merger.nodes.get(target)
        if source is None or source.kind not in ("file", "hardlink"):
            raise HostileLayerError(layer.digest, member.name,
                                    f"hard link to {member.linkname!r}, which is not a file "
                                    "in the image")
        if target == path:
            raise HostileLayerError(layer.digest, member.name, "hard link to itself")
        merger.put(path, Node("hardlink", entry, data=source.data, link=target))
    else:
        merger.put(path, Node(kind, entry, data=entry if kind == "file" else None))
