"""Layers -> the final view of the root filesystem, from their tar headers (pass 1).

``merge`` reads every layer's headers in order and builds the final
view: OCI whiteouts applied (``.wh.NAME`` removes NAME from lower layers,
``.wh..wh..opq`` empties a directory of its lower contents), later entries
replacing earlier ones, device nodes and ``dev/*`` dropped.  Every entry is
checked before it can matter; these are refused with the layer digest and the
entry named (compare charliecloud's ``validate_members``):
* absolute paths, ``..`` components, NUL bytes, names over 4095 bytes or
  components over 255 bytes;
* an entry whose parent, in the view so far, is a symlink (writing through
  it could leave the root: the "absolute symlink, then write through it" attack);
* hard links whose target leaves the root or does not exist;
* symlinks whose relative target climbs above the root;
* truncated or corrupt compressed streams, and anything that is not a tar;
* a header that does not parse in the middle of a layer, a missing end-of-archive
  and bytes after it (Python's tarfile takes a bad header for the end of the
  archive and stops silently: here the end is checked explicitly, with the offset);
* whiteouts of names that are not plain names (``.wh..``, ``.wh..wh.x``).

``ViewBuilder`` is the same fold for headers a caller already holds (the one-pass
converter, ``enroot.onepass``, collects them while it streams).
"""

from __future__ import annotations

import contextlib
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.layerstream import (
    COPY_CHUNK,
    STREAM_ERRORS,
    LayerSource,
    TarSource,
    open_layer,
)
from imgpipe.enroot.members import Member
from imgpipe.enroot.tarinfo import FastTarInfo

MAX_NAME = 4095
MAX_COMPONENT = 255
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
HEADER_READERS = 2  # layers whose headers pass 1 reads at once
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

    @property
    def file_bytes(self) -> int:
        """Bytes of regular-file data in the final view (what an unpacked tree holds)."""
        total = sum(len(content) for content, _ in self.extra_files.values())
        for node in self.nodes.values():
            if node.kind == "file" and node.entry is not None:
                total += self.members[node.entry[0]][node.entry[1]].size
        return total


def check_end(raw: TarSource, end: int, layer: LayerSource) -> None:
    """What follows the last member must be the end-of-archive (zero blocks) and nothing
    else: tarfile stops quietly at a header it cannot parse, at a short read, or at the
    end of the stream, and reads all three as the end of the archive."""
    if raw.last_start == end:
        block = raw.last
    else:  # tarfile did not read there: the stream ended earlier
        block = b""
    if len(block) < tarfile.BLOCKSIZE:
        raise HostileLayerError(layer.digest, "(stream)",
                                f"truncated at byte {max(raw.position, end)}: no "
                                "end-of-archive")
    if block.strip(b"\0"):
        raise HostileLayerError(layer.digest, "(stream)",
                                f"a header that does not parse at byte {end}")
    position = end + tarfile.BLOCKSIZE
    while chunk := raw.read(COPY_CHUNK):
        if chunk.strip(b"\0"):
            offset = position + len(chunk) - len(chunk.lstrip(b"\0"))
            raise HostileLayerError(layer.digest, "(stream)",
                                    f"data after the end-of-archive at byte {offset}")
        position += len(chunk)


@contextlib.contextmanager
def layer_errors(layer: LayerSource, source: TarSource) -> Iterator[None]:
    """A broken compressed stream or a tar that does not parse, as the layer's error with
    the byte it happened at; a layer with no entries is legal (its first block ends the
    archive, which tarfile calls an empty file)."""
    try:
        yield
    except (*STREAM_ERRORS, tarfile.ReadError) as exc:  # type: ignore[misc]
        why = str(exc) or type(exc).__name__
        if not (isinstance(exc, tarfile.ReadError) and "empty file" in why):
            raise HostileLayerError(layer.digest, "(stream)", "truncated or corrupt layer "
                                    f"at byte {source.position}: {why}") from exc


def read_members(layer: LayerSource) -> list[Member]:
    """Every member header of a layer, in order (data skipped by seeking forward)."""
    try:
        # Pass 1 verifies the blob too: pass 2 places bytes by the headers and offsets read
        # here, so they must come from the very bytes the digest names (a shared cache's
        # blob can change between the passes; pass 2 verifies its own read again).
        raw = open_layer(layer.path, tar_hashing=layer.diff_id is not None)
    except OSError as exc:
        raise HostileLayerError(layer.digest, "(blob)", f"cannot read: {exc}") from exc
    with raw:
        members: list[Member] = []
        end = 0
        with layer_errors(layer, raw):
            # Random-access mode on a forward-seekable decompressor: headers are parsed
            # and file data is skipped by seeking, never copied through Python.
            with tarfile.open(fileobj=raw, mode="r:", errorlevel=2,
                              tarinfo=FastTarInfo) as tar:
                # The layer's TarInfo objects go with ``tar``: only the slim records stay.
                members = [Member(info) for info in tar.getmembers()]
                end = tar.offset
        with layer_errors(layer, raw):
            check_end(raw, end, layer)
            raw.verify(layer)
        return members


def normalize(name: str, layer: str, what: str = "path") -> str:
    """Relative, slash-joined form of a tar name; refuses anything that can leave the root."""
    if "\x00" in name:
        raise HostileLayerError(layer, name, f"NUL byte in the {what}")
    if len(name.encode(errors="surrogateescape")) > MAX_NAME:
        raise HostileLayerError(layer, name, f"{what} longer than {MAX_NAME} bytes")
    if name.startswith("/"):
        raise HostileLayerError(layer, name, f"absolute {what}")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise HostileLayerError(layer, name, f"'..' in the {what}")
    for part in parts:
        if len(part.encode(errors="surrogateescape")) > MAX_COMPONENT:
            raise HostileLayerError(layer, name, f"a {what} component longer than "
                                    f"{MAX_COMPONENT} bytes")
    return "/".join(parts)


def _climbs_out(link_path: str, target: str) -> bool:
    """True when a relative symlink target climbs above the root (lexically)."""
    if target.startswith("/"):
        return False  # resolved inside the container's root at run time
    depth = link_path.count("/")  # directories between the root and the link
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


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
        parts = path.split("/")[:-1]
        prefix = ""
        for part in parts:
            parent = prefix
            prefix = f"{prefix}/{part}" if prefix else part
            node = self.nodes.get(prefix)
            if node is not None and node.kind == "symlink":
                raise HostileLayerError(layer.digest, shown,
                                        f"its parent {prefix!r} is a symlink (to "
                                        f"{node.link!r}); writing through it could leave "
                                        "the root")
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


# Files that container runtimes bind the host's over (Docker injects them at run time, so
# images lack them).  Enroot creates them itself; Charliecloud's ch-run binds only onto
# files that exist in the image, so each squashfs carries them, empty, where missing.
RUNTIME_MOUNT_POINTS = ("etc/hosts", "etc/resolv.conf")


def merge(layers: list[LayerSource], rc_files: dict[str, tuple[str, int]] | None = None
          ) -> MergedView:
    """Pass 1: the final view of ``layers`` (bottom first), validated entry by entry."""
    builder = ViewBuilder()
    # Headers are read two layers at a time (decompression and hashing leave the GIL for
    # part of their work: 9.1 s -> 6.6 s on the 5 GiB generated image) and merged in order.
    readers = ThreadPoolExecutor(max_workers=HEADER_READERS, thread_name_prefix="layer-headers")
    try:
        for layer, members in zip(layers, readers.map(read_members, layers), strict=True):
            builder.add_layer(layer, members)
    finally:
        readers.shutdown(wait=True, cancel_futures=True)  # a refused layer stops the rest
    return builder.finish(rc_files)


class ViewBuilder:
    """The merge as a fold: layers' headers added bottom first, then the view."""

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
                extra[path] = (b"", 0o644)
        return MergedView(merger.nodes, merger.children, self.counts, self.members, extra)


def _merge_member(merger: _Merger, number: int, index: int, member: Member,
                  layer: LayerSource, count: LayerCounts, path: str) -> None:
    count.entries += 1
    if not path:
        return  # the root itself
    if member.ischr() or member.isblk() or path.startswith("dev/"):
        count.devices_skipped += 1
        return
    parent, _, base = path.rpartition("/")
    if base.startswith(WHITEOUT):
        merger.ensure_parents(path, layer, member.name)
        if base == OPAQUE:
            count.opaque += 1
            merger.empty_dir(parent, below_layer=number)
        else:
            count.whiteouts += 1
            name = base[len(WHITEOUT):]
            if name in ("", ".", "..") or name.startswith(WHITEOUT):
                raise HostileLayerError(layer.digest, member.name,
                                        f"a whiteout of {name!r}, which is not a plain name")
            hidden = f"{parent}/{name}" if parent else name
            merger.remove(hidden, below_layer=number)
        return
    merger.ensure_parents(path, layer, member.name)
    entry = (number, index)
    if member.isdir():
        merger.put(path, Node("dir", entry))
    elif member.issym():
        if _climbs_out(path, member.linkname):
            raise HostileLayerError(layer.digest, member.name,
                                    f"symlink target {member.linkname!r} climbs above the root")
        if "\x00" in member.linkname:
            raise HostileLayerError(layer.digest, member.name, "NUL byte in the symlink target")
        merger.put(path, Node("symlink", entry, link=member.linkname))
    elif member.islnk():
        target = normalize(member.linkname, layer.digest, "hard link target")
        source = merger.nodes.get(target)
        if source is None or source.kind not in ("file", "hardlink"):
            raise HostileLayerError(layer.digest, member.name,
                                    f"hard link to {member.linkname!r}, which is not a file "
                                    "in the image")
        if target == path:
            raise HostileLayerError(layer.digest, member.name, "hard link to itself")
        merger.put(path, Node("hardlink", entry, data=source.data, link=target))
    elif member.isfile():
        merger.put(path, Node("file", entry, data=entry))
    elif member.isfifo():
        merger.put(path, Node("fifo", entry))
    else:
        raise HostileLayerError(layer.digest, member.name,
                                f"unsupported entry type {member.type!r}")
