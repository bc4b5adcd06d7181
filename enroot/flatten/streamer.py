"""The streamer: layers -> the flattened root as one tar stream, each layer read once, top
layer first (the default converter path).

Reading the view first and the layers again (``enroot.flatten.view``, ``enroot.flatten.viewwriter``)
decompresses every layer twice; at NGC scale that second decompression is a quarter of the
work.  The streamer reads the layers from the top down and decides each entry from what the
layers above it hold, while its bytes are at hand (:class:`Above`):

* a path an upper layer also has is hidden (an upper directory over a lower one takes the
  lower's place but keeps its children: the lower entry is skipped, its subtree is not);
* a path below an upper non-directory, whiteout or opaque directory is hidden;
* a lower non-directory where an upper layer has something below is hidden (the upper
  layer's directory, written or implied, replaces it).

What each entry is, and what is refused, is the layer rules' (``enroot.flatten.rules``).
tar2sqfs places entries by path, whatever their order (it makes parents on the way and
takes a directory's own entry later), so the stream needs no sorting.  Hard links carry no
data and are written last, from the view, pointing at a file already written
(``enroot.flatten.links``).

Nothing here is trusted on its own.  The headers are collected as they stream by, and at
the end the view is folded from them (refusing a hostile layer with the view's errors); it
must hold exactly the entries this pass wrote.  Anything the top-down reading cannot place
(a path twice in one layer, a whiteout beside new entries below it in the same layer, a
hard link to bytes no surviving file holds and that were not kept) raises
:class:`TwoPassesNeeded` and the caller converts in two passes: the output is the same
view either way.  Every blob is checked against its digest, and every tar against its
``diff_id`` when asked, while it streams.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from imgpipe.enroot.flatten.layerreader import LayerPipe, LayerReader, LayerSource
from imgpipe.enroot.flatten.links import HiddenBytes, file_owners, link_item
from imgpipe.enroot.flatten.rules import (
    dropped,
    fixed_mode,
    hardlink_target,
    kind_of,
    normalize,
    whiteout_of,
)
from imgpipe.enroot.flatten.tarreader import Member, read_layer
from imgpipe.enroot.flatten.tarwriter import (
    COPY_CHUNK,
    END_OF_ARCHIVE,
    Exact,
    Item,
    Out,
    WriteFailed,
    tar_header,
    write_item,
    write_padding,
)
from imgpipe.enroot.flatten.view import Entry, MergedView, ViewBuilder

SPLICE_FROM = 64 << 10  # a file's bytes left, past which they move pipe to pipe (splice)


class TwoPassesNeeded(Exception):
    """The layers hold something one top-down pass cannot place; convert in two passes."""


@dataclass
class Above:
    """What the layers read so far (all above the current one) do to lower entries."""

    covered: set[str] = field(default_factory=set)  # a lower entry here is hidden
    dirs: set[str] = field(default_factory=set)  # a directory here: lower non-dirs hidden
    buried: set[str] = field(default_factory=set)  # everything lower below here is hidden
    holds_below: set[str] = field(default_factory=set)  # something lives below here
    wanted: set[str] = field(default_factory=set)  # hard link targets: bytes maybe needed
    _buried_memo: dict[str, bool] = field(default_factory=dict)

    def bury(self, path: str) -> None:
        self.covered.add(path)
        self.buried.add(path)

    def hold_parents(self, path: str) -> None:
        parent = path.rpartition("/")[0]
        while parent and parent not in self.holds_below:
            self.holds_below.add(parent)
            parent = parent.rpartition("/")[0]

    def hides(self, path: str, is_dir: bool) -> bool:
        """True when the layers above hide a lower entry at ``path``."""
        parent = path.rpartition("/")[0]
        if self._is_buried(parent) or path in self.covered:
            return True
        # An upper directory stands here (its entry wins; children merge), or something
        # upper lives below a lower non-directory.
        return path in self.dirs or (not is_dir and path in self.holds_below)

    def _is_buried(self, directory: str) -> bool:
        known = self._buried_memo.get(directory)
        if known is None:
            known = directory in self.buried or (
                directory != "" and self._is_buried(directory.rpartition("/")[0]))
            self._buried_memo[directory] = known
        return known

    def add_layer(self, members: list[Member], paths: list[str | None], layer: str) -> None:
        """What a layer just read does to the layers below it (whatever of it is hidden)."""
        self._buried_memo = {}
        for member, path in zip(members, paths, strict=True):
            if path is None:
                continue
            self.hold_parents(path)
            whiteout = whiteout_of(path, layer, member.name)
            if whiteout is not None:
                hidden, opaque = whiteout
                if opaque:
                    self.buried.add(hidden)
                else:
                    self.bury(hidden)
            elif (kind := kind_of(member, layer)) == "dir":
                self.dirs.add(path)
            else:
                self.bury(path)
                if kind == "hardlink":
                    self.wanted.add(hardlink_target(member, layer))


@dataclass
class _Layer:
    """The layer being read: where it is, what of it was written."""

    number: int
    source: LayerReader
    members: list[Member] = field(default_factory=list)
    paths: list[str | None] = field(default_factory=list)
    written: dict[str, bool] = field(default_factory=dict)  # path -> is a directory

    @property
    def layer(self) -> LayerSource:
        return self.source.layer


@dataclass
class Streamer:
    """One top-down pass over ``layers`` (bottom first, as the manifest lists them)."""

    layers: list[LayerSource]
    rc_files: dict[str, tuple[str, int]] | None
    out: Out
    on_blob_bytes: Callable[[int], None] = lambda n: None
    hash_tars: bool = True
    # layer number -> its source once the blob is in place (waits for its fetch); None:
    # ``layers`` are all there
    ready: Callable[[int], LayerSource] | None = None
    written: int = 0
    above: Above = field(default_factory=Above)
    emitted: set[Entry] = field(default_factory=set)
    hidden: HiddenBytes = field(default_factory=HiddenBytes)

    def run(self) -> MergedView:
        """Write the stream; return the view it was checked against."""
        # The pass makes a few objects per tar member and keeps most of them to the end
        # (300,000+ members): the cyclic collector, run every 700 of them, walked them all
        # again and again (6 % of this process's time at 5 GB) and finds nothing, since the
        # pass makes no cycles.  It is off while the pass runs.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for path in self.rc_files or {}:  # Enroot's files replace the image's
                self.above.bury(path)
                self.above.hold_parents(path)
            order = list(reversed(range(len(self.layers))))
            ready = self.ready or self.layers.__getitem__
            read: dict[int, _Layer] = {}
            with LayerPipe(len(order), lambda k: ready(order[k]), self.hash_tars) as pipe:
                for number, source in zip(order, pipe.readers(), strict=True):
                    read[number] = self._stream_layer(_Layer(number, source))
            builder = ViewBuilder()
            for number in range(len(self.layers)):
                done = read.pop(number)
                builder.add_layer(done.layer, done.members, done.paths)
            view = builder.finish(self.rc_files)
            self._finish(view)
            return view
        except WriteFailed as failed:
            raise failed.error from None  # the squash tool's end: its exit status says why
        finally:
            self.hidden.close()
            if collecting:
                gc.enable()

    def _stream_layer(self, current: _Layer) -> _Layer:
        reported = [0]

        def place(member: Member) -> None:
            current.members.append(member)
            current.paths.append(self._place(current, member))
            self._report(current.source, reported)

        read_layer(current.layer, current.source, place)
        self._report(current.source, reported)
        self.above.add_layer(current.members, current.paths, current.layer.digest)
        return current

    def _report(self, source: LayerReader, reported: list[int]) -> None:
        if source.blob_bytes > reported[0]:
            self.on_blob_bytes(source.blob_bytes - reported[0])
            reported[0] = source.blob_bytes

    def _place(self, current: _Layer, member: Member) -> str | None:
        """Write ``member`` when no upper layer hides it; its normalized path (None: an
        entry the root never holds)."""
        layer = current.layer.digest
        path = normalize(member.name, layer)
        if dropped(member, path):
            return None
        if whiteout_of(path, layer, member.name) is not None:
            return path
        kind = kind_of(member, layer)
        if self.above.hides(path, kind == "dir"):
            if kind == "file" and path in self.above.wanted:  # an upper hard link's bytes
                entry = (current.number, len(current.members) - 1)
                self.hidden.keep(entry, Exact(current.source, member.size, current.layer,
                                              member))
        elif kind != "hardlink":  # hard links are written at the end, from the view
            self._emit(current, member, path, kind)
        return path

    def _emit(self, current: _Layer, member: Member, path: str, kind: str) -> None:
        if path in current.written or self._below_written_file(current, path):
            raise TwoPassesNeeded(f"{member.name!r} of layer {current.layer.digest[:19]}, "
                                  "placed once already or below a non-directory of the "
                                  "same layer")
        current.written[path] = kind == "dir"
        self.emitted.add((current.number, len(current.members) - 1))
        item = Item(path, kind, fixed_mode(kind, member.mode), member.mtime,
                    member.size if kind == "file" else 0, None,
                    member.linkname if kind == "symlink" else None)
        if kind == "file" and member.size:
            self._copy_file(item, member, current)
        else:
            write_item(item, self.out)
        self.written += 1

    def _copy_file(self, item: Item, member: Member, current: _Layer) -> None:
        """A file's header, then its bytes, straight from the pipe's buffer."""
        self.out.write(tar_header(item))
        source = current.source
        data = Exact(source, member.size, current.layer, member)
        while data.left:
            if (self.out.is_pipe and data.left >= SPLICE_FROM
                    and (moved := source.splice_into(self.out.splice, data.left))):
                data.left -= moved
                continue
            self.out.write(data.read(COPY_CHUNK))
        write_padding(member.size, self.out)

    @staticmethod
    def _below_written_file(current: _Layer, path: str) -> bool:
        """True when this layer already wrote a non-directory at an ancestor of ``path``."""
        parent = path.rpartition("/")[0]
        while parent:
            is_dir = current.written.get(parent)
            if is_dir is not None:
                return not is_dir
            parent = parent.rpartition("/")[0]
        return False

    def _finish(self, view: MergedView) -> None:
        """Check the stream against the view; write directories no layer described, hard
        links, Enroot's files and the end-of-archive."""
        expected = {node.entry for node in view.nodes.values()
                    if node.entry is not None and node.kind != "hardlink"}
        if expected != self.emitted:
            extra, missing = self.emitted - expected, expected - self.emitted
            raise TwoPassesNeeded(f"{len(extra)} entr(ies) written that the view lacks, "
                                  f"{len(missing)} it has that were not written")
        owners = file_owners(view)
        links = sorted((node.entry, path, node) for path, node in view.nodes.items()
                       if node.kind == "hardlink" and node.entry is not None)
        items = list(view.implicit_dirs())
        for _, path, node in links:
            item = link_item(view, path, node, owners, self.hidden)
            if item is None:
                raise TwoPassesNeeded(f"{path!r}: a hard link to bytes no surviving file "
                                      "holds")
            items.append(item)
        for item in [*items, *view.added_files()]:
            write_item(item, self.out)
            self.written += 1
        self.out.write(END_OF_ARCHIVE)


def write_stream_once(layers: list[LayerSource], rc_files: dict[str, tuple[str, int]] | None,
                      out: IO[bytes], on_blob_bytes: Callable[[int], None] = lambda n: None,
                      hash_tars: bool = True,
                      ready: Callable[[int], LayerSource] | None = None
                      ) -> tuple[MergedView, int]:
    """The flattened root of ``layers`` as one tar stream, each layer read once; returns the
    view and the entries written.  ``ready(number)`` waits until a layer's blob is in place
    (the layers are fetched while the top ones stream).  Raises TwoPassesNeeded (nothing
    usable written) when the layers need two passes, HostileLayerError when they are
    refused."""
    streamer = Streamer(layers, rc_files, Out(out), on_blob_bytes, hash_tars, ready)
    view = streamer.run()
    return view, streamer.written
