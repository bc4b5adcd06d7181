"""Hard links in the flattened root, and the bytes of hidden files they still show.

A hard link of the view is written as a link to the surviving file that holds its bytes.
When a later layer replaced or removed that file, the link still shows the old bytes (as
overlayfs does): they are kept in a spool while their layer streams by (in memory up to
64 MiB, then on disk) and the link is written as a regular file of them; later links to
the same bytes then point at it.  Both converter paths write links through here.
"""

from __future__ import annotations

import io
import tempfile

from imgpipe.enroot.flatten.rules import fixed_mode
from imgpipe.enroot.flatten.tarwriter import COPY_CHUNK, Item, Readable
from imgpipe.enroot.flatten.view import Entry, MergedView, Node

SPOOL_IN_MEMORY = 64 << 20  # bytes of a kept file held in memory before it spills to disk


class HiddenBytes:
    """Spools of hidden files' bytes, by the layer entry that held them."""

    def __init__(self) -> None:
        self._spools: dict[Entry, tempfile.SpooledTemporaryFile[bytes]] = {}

    def keep(self, entry: Entry, data: Readable) -> None:
        """Keep every byte ``data`` gives (one member's data, read to its end)."""
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
        while chunk := data.read(COPY_CHUNK):
            spool.write(chunk)
        self._spools[entry] = spool

    def close(self) -> None:
        for spool in self._spools.values():
            spool.close()
        self._spools.clear()

    def as_file(self, entry: Entry, item: Item) -> Item | None:
        """``item`` as a regular file of the bytes kept for ``entry``; None if none were."""
        spool = self._spools.get(entry)
        if spool is None:
            return None
        size = spool.seek(0, io.SEEK_END)
        spool.seek(0)
        return Item(item.path, "file", item.mode, item.mtime, size, spool)


def file_owners(view: MergedView) -> dict[Entry, str]:
    """Which surviving file holds each entry's bytes."""
    return {node.data: path for path, node in view.nodes.items()
            if node.kind == "file" and node.data is not None}


def orphaned(view: MergedView, owners: dict[Entry, str]) -> set[Entry]:
    """The entries whose bytes a hard link shows but no surviving file holds: to keep."""
    return {node.data for node in view.nodes.values()
            if node.kind == "hardlink" and node.data is not None and node.data not in owners}


def link_item(view: MergedView, path: str, node: Node, owners: dict[Entry, str],
              hidden: HiddenBytes) -> Item | None:
    """The hard link at ``path`` as written: a link to the file holding its bytes, or a file
    of the kept bytes (``owners`` then names it for later links); None when neither is
    there."""
    assert node.entry is not None and node.data is not None
    member = view.members[node.entry[0]][node.entry[1]]
    item = Item(path, "hardlink", fixed_mode("hardlink", member.mode), member.mtime,
                link=owners.get(node.data))
    if item.link is not None:
        return item
    written = hidden.as_file(node.data, item)
    if written is not None:
        owners[node.data] = path  # later links point here
    return written
