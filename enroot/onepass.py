"""Layers -> the flattened root as one tar stream, reading each layer once, top layer first.

The two-pass converter (``enroot.merge`` then ``enroot.flatten``) decompresses every layer
twice: once for its headers, once for its bytes.  At NGC scale that second decompression
is a quarter of the work, so the default path reads the layers from the top down and
decides each entry from what the layers above it hold, while its bytes are at hand:

* a path an upper layer also has is hidden (an upper directory over a lower one takes the
  lower's place but keeps its children: the lower entry is skipped, its subtree is not);
* a path below an upper non-directory, whiteout or opaque directory is hidden;
* a lower non-directory where an upper layer has something below is hidden (the upper
  layer's directory, written or implied, replaces it).

tar2sqfs places entries by path, whatever their order (it makes parents on the way and
takes a directory's own entry later), so the stream needs no sorting.  Hard links carry
no data and are written last, from the final view, pointing at a file already written.

Nothing here is trusted on its own.  The headers are collected as they stream by, and at
the end the same bottom-up merge the two-pass converter uses runs over them (refusing a
hostile layer with the same errors) and must find exactly the entries this pass wrote.
Anything it cannot place this way (a path twice in one layer, a whiteout beside new
entries below it in the same layer, a hard link to bytes that no surviving file holds and
that were not kept) raises :class:`TwoPassesNeeded` and the caller converts in two passes:
the output is the same view either way.  As in pass 2, every blob is checked against its
digest and every tar against its ``diff_id`` while it streams.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import stat
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten import (
    END_OF_ARCHIVE,
    Exact,
    Item,
    fixed_mode,
    tar_header,
    write_item,
)
from imgpipe.enroot.layerpipe import LayerPipe, PipeReader
from imgpipe.enroot.layerstream import COPY_CHUNK, LayerSource
from imgpipe.enroot.members import Member
from imgpipe.enroot.merge import (
    OPAQUE,
    WHITEOUT,
    Entry,
    MergedView,
    ViewBuilder,
    check_end,
    layer_errors,
    normalize,
)
from imgpipe.enroot.tarinfo import FastTarInfo

SPOOL_IN_MEMORY = 64 << 20  # bytes of a kept file held in memory before it spills to disk
SPLICE_FROM = 64 << 10  # a file's bytes left, past which they move pipe to pipe (splice)


class _WriteFailed(Exception):
    """Writing the stream failed (the squash tool stopped reading, a full disk): not the
    layer's fault, whatever OSError it was."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Out:
    """The stream's consumer."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.is_pipe = False  # the squash tool's stdin: bytes may be spliced into it
        with contextlib.suppress(OSError, ValueError):
            self.is_pipe = stat.S_ISFIFO(os.fstat(raw.fileno()).st_mode)

    def write(self, data: bytes | memoryview, /) -> int:
        try:
            self.raw.write(data)
        except OSError as exc:
            raise _WriteFailed(exc) from exc
        return len(data)

    def splice(self, source: int, count: int) -> int:
        """Up to ``count`` bytes moved from the pipe ``source`` into this one, after what
        is buffered."""
        try:
            self.raw.flush()
            return os.splice(source, self.raw.fileno(), count)
        except OSError as exc:
            raise _WriteFailed(exc) from exc

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError as exc:
            raise _WriteFailed(exc) from exc


class TwoPassesNeeded(Exception):
    """The layers hold something one top-down pass cannot place; convert in two passes."""


@dataclass
class _Above:
    """What the layers read so far (all above the current one) do to lower entries."""

    covered: set[str] = field(default_factory=set)  # a lower entry here is hidden
    dirs: set[str] = field(default_factory=set)  # a directory here: lower non-dirs hidden
    buried: set[str] = field(default_factory=set)  # everything lower below here is hidden
    holds_below: set[str] = field(default_factory=set)  # something lives below here
    wanted: set[str] = field(default_factory=set)  # hard link targets: bytes maybe needed

    def bury(self, path: str) -> None:
        self.covered.add(path)
        self.buried.add(path)

    def hold_parents(self, path: str) -> None:
        parent = path.rpartition("/")[0]
        while parent and parent not in self.holds_below:
            self.holds_below.add(parent)
            parent = parent.rpartition("/")[0]


@dataclass
class OnePass:
    """One top-down pass over ``layers`` (bottom first, as the manifest lists them)."""

    layers: list[LayerSource]
    rc_files: dict[str, tuple[str, int]] | None
    out: _Out
    on_blob_bytes: Callable[[int], None] = lambda n: None
    hash_tars: bool = True
    # layer number -> its source once the blob is in place (waits for its fetch); None:
    # ``layers`` are all there
    ready: Callable[[int], LayerSource] | None = None
    written: int = 0
    _above: _Above = field(default_factory=_Above)
    _emitted: set[Entry] = field(default_factory=set)
    _emitted_paths: dict[str, bool] = field(default_factory=dict)  # path -> is a directory
    _kept: dict[Entry, tempfile.SpooledTemporaryFile[bytes]] = field(default_factory=dict)
    _members: dict[int, list[Member]] = field(default_factory=dict)
    _paths: dict[int, list[str | None]] = field(default_factory=dict)
    _buried_memo: dict[str, bool] = field(default_factory=dict)

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
                self._above.bury(path)
                self._above.hold_parents(path)
            order = list(reversed(range(len(self.layers))))
            ready = self.ready or self.layers.__getitem__
            arrived: dict[int, LayerSource] = {}
            with LayerPipe(len(order), lambda k: ready(order[k]), self.hash_tars) as pipe:
                for number, source in zip(order, pipe.readers(), strict=True):
                    arrived[number] = source.layer
                    self._stream_layer(number, source.layer, source)
            builder = ViewBuilder()
            for number in range(len(self.layers)):
                builder.add_layer(arrived[number], self._members.pop(number),
                                  self._paths.pop(number))
            view = builder.finish(self.rc_files)
            self._finish(view)
            return view
        except _WriteFailed as failed:
            raise failed.error from None  # the squash tool's end: its exit status says why
        finally:
            for spool in self._kept.values():
                spool.close()
            if collecting:
                gc.enable()

    # -- one layer -------------------------------------------------------------------------

    def _stream_layer(self, number: int, layer: LayerSource, source: PipeReader) -> None:
        self._buried_memo = {}
        paths: list[str | None] = []
        members: list[Member] = []
        read = 0
        end = 0
        with layer_errors(layer, source):
            with tarfile.open(fileobj=source, mode="r:", errorlevel=2,
                              tarinfo=FastTarInfo) as tar:
                while (info := tar.next()) is not None:
                    member = Member(info)
                    members.append(member)
                    paths.append(self._place(number, len(members) - 1, member, layer, source))
                    read = self._report(source, read)
                end = tar.offset
        with layer_errors(layer, source):
            check_end(source, end, layer)
            source.verify(layer)
        self._report(source, read)
        self._members[number] = members
        self._paths[number] = paths
        self._record(members, paths)

    def _report(self, source: PipeReader, before: int) -> int:
        now = source.blob_bytes
        if now > before:
            self.on_blob_bytes(now - before)
        return now

    def _place(self, number: int, index: int, member: Member, layer: LayerSource,
               source: PipeReader) -> str | None:
        """Write ``member`` when no upper layer hides it; its normalized path (None: the
        root, a device node or a whiteout, which write nothing)."""
        path = normalize(member.name, layer.digest)
        if not path or member.ischr() or member.isblk() or path.startswith("dev/"):
            return None
        parent, _, base = path.rpartition("/")
        if base.startswith(WHITEOUT):
            return path
        is_dir = member.isdir()
        above = self._above
        if self._is_buried(parent) or path in above.covered:
            self._keep_if_wanted(number, index, member, path, layer, source)
            return path
        if path in above.dirs or (not is_dir and path in above.holds_below):
            if not is_dir:
                self._keep_if_wanted(number, index, member, path, layer, source)
            return path  # an upper directory stands here (its entry wins; children merge)
        if member.islnk():
            return path  # written at the end, from the final view
        self._emit(number, index, member, path, is_dir, layer, source)
        return path

    def _is_buried(self, directory: str) -> bool:
        """True when an upper layer hides everything lower below ``directory``."""
        known = self._buried_memo.get(directory)
        if known is None:
            known = directory in self._above.buried or (
                directory != "" and self._is_buried(directory.rpartition("/")[0]))
            self._buried_memo[directory] = known
        return known

    def _emit(self, number: int, index: int, member: Member, path: str, is_dir: bool,
              layer: LayerSource, source: PipeReader) -> None:
        if path in self._emitted_paths or self._below_written_file(path):
            raise TwoPassesNeeded(f"{member.name!r} of layer {layer.digest[:19]}, placed once "
                                  "already or below a non-directory of the same layer")
        if member.isfile():
            kind = "file"
        elif is_dir:
            kind = "dir"
        elif member.issym():
            kind = "symlink"
        elif member.isfifo():
            kind = "fifo"
        else:
            raise HostileLayerError(layer.digest, member.name,
                                    f"unsupported entry type {member.type!r}")
        self._emitted_paths[path] = is_dir
        self._emitted.add((number, index))
        item = Item(path, kind, fixed_mode(kind, member.mode), member.mtime,
                    member.size if kind == "file" else 0, None,
                    member.linkname if kind == "symlink" else None)
        if kind == "file" and member.size:
            self._copy_file(item, member, layer, source)
        else:
            write_item(item, self.out)
        self.written += 1

    def _copy_file(self, item: Item, member: Member, layer: LayerSource,
                   source: PipeReader) -> None:
        """A file's header, then its bytes, straight from the pipe's buffer."""
        self.out.write(tar_header(item))
        left = member.size
        while left:
            if (self.out.is_pipe and left >= SPLICE_FROM
                    and (moved := source.splice_into(self.out.splice, left))):
                left -= moved
                continue
            view = source.read_view(min(left, COPY_CHUNK))
            if not view:
                raise HostileLayerError(layer.digest, member.name, "truncated or corrupt "
                                        f"layer at byte {source.position}: it ends inside "
                                        "this file")
            self.out.write(view)
            left -= len(view)
        if member.size % tarfile.BLOCKSIZE:
            self.out.write(bytes(tarfile.BLOCKSIZE - member.size % tarfile.BLOCKSIZE))

    def _below_written_file(self, path: str) -> bool:
        """True when this layer already wrote a non-directory at an ancestor of ``path``."""
        parent = path.rpartition("/")[0]
        while parent:
            is_dir = self._emitted_paths.get(parent)
            if is_dir is not None:
                return not is_dir
            parent = parent.rpartition("/")[0]
        return False

    def _keep_if_wanted(self, number: int, index: int, member: Member, path: str,
                        layer: LayerSource, source: PipeReader) -> None:
        """Hidden bytes an upper hard link may still show (overlayfs keeps them): spooled."""
        if member.isfile() and path in self._above.wanted:
            spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
            reader = Exact(source, member.size, layer, member)
            while chunk := reader.read(COPY_CHUNK):
                spool.write(chunk)
            self._kept[(number, index)] = spool

    def _record(self, members: list[Member], paths: list[str | None]) -> None:
        """What this layer does to the layers below it (whatever of it is itself hidden)."""
        above = self._above
        for member, path in zip(members, paths, strict=True):
            if path is None:
                continue
            above.hold_parents(path)
            parent, _, base = path.rpartition("/")
            if base == OPAQUE:
                above.buried.add(parent)
            elif base.startswith(WHITEOUT):
                above.bury(f"{parent}/{base[len(WHITEOUT):]}" if parent else
                           base[len(WHITEOUT):])
            elif member.isdir():
                above.dirs.add(path)
            else:
                above.bury(path)
                if member.islnk():
                    above.wanted.add("/".join(part for part in member.linkname.split("/")
                                              if part not in ("", ".")))

    # -- the end of the stream -------------------------------------------------------------

    def _finish(self, view: MergedView) -> None:
        """Check the stream against the view; write directories no layer described, hard
        links, Enroot's files and the end-of-archive."""
        expected = {node.entry for node in view.nodes.values()
                    if node.entry is not None and node.kind != "hardlink"}
        if expected != self._emitted:
            extra, missing = self._emitted - expected, expected - self._emitted
            raise TwoPassesNeeded(f"{len(extra)} entr(ies) written that the view lacks, "
                                  f"{len(missing)} it has that were not written")
        data_owner = {node.data: path for path, node in view.nodes.items()
                      if node.kind == "file" and node.data is not None}
        for path, node in sorted(view.nodes.items()):
            if node.entry is None and node.kind == "dir":
                write_item(Item(path, "dir", 0o755, 0), self.out)
                self.written += 1
        links = sorted((node.entry, path, node) for path, node in view.nodes.items()
                       if node.kind == "hardlink" and node.entry is not None)
        for (number, index), path, node in links:
            member = view.members[number][index]
            mode = fixed_mode("hardlink", member.mode)
            owner = data_owner.get(node.data) if node.data is not None else None
            if owner is not None:
                write_item(Item(path, "hardlink", mode, member.mtime, link=owner), self.out)
            else:
                spool = self._kept.get(node.data) if node.data is not None else None
                if spool is None or node.data is None:
                    raise TwoPassesNeeded(f"{path!r}: a hard link to bytes no surviving "
                                          "file holds")
                size = spool.seek(0, io.SEEK_END)
                spool.seek(0)
                write_item(Item(path, "file", mode, member.mtime, size, spool), self.out)
                data_owner[node.data] = path  # later links point here
            self.written += 1
        for path, (content, mode) in sorted(view.extra_files.items()):
            write_item(Item(path, "file", mode, 0, len(content), io.BytesIO(content)),
                       self.out)
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
    usable written) when the layers need the two-pass converter, HostileLayerError when
    they are refused."""
    one = OnePass(layers, rc_files, _Out(out), on_blob_bytes, hash_tars, ready)
    view = one.run()
    return view, one.written
