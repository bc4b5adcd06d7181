"""The view written out: the flattened root as one tar stream or an unpacked tree, from the
view (``enroot.flatten.view``) and a second read of the layers, bottom first.

Only the entries that survived are written, with Enroot's permission fix and every entry
owned by root (``enroot.flatten.rules``); hard links whose bytes a later layer hid come from
spools (``enroot.flatten.links``); Enroot's rc files come last.  Every byte is verified on use,
while it is read anyway: the blob against its digest and the tar against the config's
``diff_id`` (a cached blob may have changed since the view was made: what was written is
what is checked).  Nothing is written to disk for a stream: the consumer (tar2sqfs) gets a
stream that can only describe the root.  A tree (for mksquashfs) is made only of the
view's paths, never through a symlink.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from imgpipe.enroot.flatten.layerreader import LayerPipe, LayerReader, LayerSource
from imgpipe.enroot.flatten.links import HiddenBytes, file_owners, link_item, orphaned
from imgpipe.enroot.flatten.rules import fixed_mode
from imgpipe.enroot.flatten.tarreader import Member, layer_errors
from imgpipe.enroot.flatten.tarwriter import COPY_CHUNK, END_OF_ARCHIVE, Exact, Item, write_item
from imgpipe.enroot.flatten.view import Entry, MergedView


def flattened(view: MergedView, layers: list[LayerSource]) -> Iterator[Item]:
    """Every surviving entry, with its bytes, parents before children.  Each layer is read
    by the offsets its headers gave the view, and verified at its end."""
    owners = file_owners(view)
    # Hard links whose bytes no surviving file holds: those bytes are kept while streaming.
    wanted = orphaned(view, owners)
    by_entry = {node.entry: path for path, node in view.nodes.items() if node.entry is not None}
    yield from view.implicit_dirs()
    hidden = HiddenBytes()
    try:
        with LayerPipe(len(layers), layers.__getitem__) as pipe:
            for number, reader in enumerate(pipe.readers()):
                for index, member in enumerate(view.members[number]):
                    entry = (number, index)
                    if entry in wanted:  # the bytes of a file (a view's data entry)
                        reader.seek(member.offset_data)
                        hidden.keep(entry, Exact(reader, member.size, reader.layer, member))
                    path = by_entry.get(entry)
                    if path is not None:
                        yield _item(view, path, member, reader, owners, hidden)
                # What was streamed is what the digests promise, or nothing is published.
                with layer_errors(reader.layer, reader):
                    reader.verify(reader.layer)
    finally:
        hidden.close()
    yield from view.added_files()


def _item(view: MergedView, path: str, member: Member, reader: LayerReader,
          owners: dict[Entry, str], hidden: HiddenBytes) -> Item:
    node = view.nodes[path]
    if node.kind == "hardlink":
        item = link_item(view, path, node, owners, hidden)
        if item is None:
            raise AssertionError(f"{path!r}: the bytes of its hard link were not kept")
        return item
    mode = fixed_mode(node.kind, member.mode)
    if node.kind == "file":
        reader.seek(member.offset_data)
        return Item(path, "file", mode, member.mtime, member.size,
                    Exact(reader, member.size, reader.layer, member))
    return Item(path, node.kind, mode, member.mtime, link=node.link)


def write_stream(view: MergedView, layers: list[LayerSource], out: IO[bytes]) -> int:
    """The flattened root as one tar stream (for tar2sqfs); returns the entries written."""
    written = 0
    for item in flattened(view, layers):
        write_item(item, out)
        written += 1
    out.write(END_OF_ARCHIVE)
    return written


def write_tree(view: MergedView, layers: list[LayerSource], root: Path) -> int:
    """The flattened root unpacked under ``root`` (for mksquashfs); returns the entries written.

    Only paths of the validated view are created, never through a symlink
    (``O_NOFOLLOW``, and the view has no symlinked parents), so nothing can
    land outside ``root``.  Directory modes are applied last.
    """
    made: set[str] = {""}
    dirs: list[tuple[str, int, int]] = []
    written = 0

    def parent_ready(path: str) -> None:
        parent = path.rpartition("/")[0]
        if parent not in made:
            os.makedirs(root / parent, exist_ok=True)
            made.add(parent)

    for item in flattened(view, layers):
        target = root / item.path
        parent_ready(item.path)
        if item.kind == "dir":
            if item.path not in made:
                os.makedirs(target, exist_ok=True)
                made.add(item.path)
            dirs.append((item.path, item.mode, item.mtime))
        elif item.kind == "file":
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                assert item.data is not None
                while chunk := item.data.read(COPY_CHUNK):
                    out.write(chunk)
            os.chmod(target, item.mode)
            os.utime(target, (item.mtime, item.mtime))
        elif item.kind == "hardlink":
            os.link(root / (item.link or ""), target, follow_symlinks=False)
        elif item.kind == "symlink":
            os.symlink(item.link or "", target)
            os.utime(target, (item.mtime, item.mtime), follow_symlinks=False)
        elif item.kind == "fifo":
            os.mkfifo(target, item.mode)
        written += 1
    for path, mode, mtime in reversed(dirs):  # children first: parents keep their times
        os.chmod(root / path, mode)
        os.utime(root / path, (mtime, mtime))
    return written
