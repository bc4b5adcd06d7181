"""Squashing a flattened tar stream into a squashfs file.

Measured on the bert image (1.2 GB, 34k files, 2 cores): tar2sqfs fed one
tar stream with zstd took 4.6 s, while mksquashfs needs the tree unpacked
first (11 s for a Python unpack, 10 s for GNU tar) and then 5.6 s.  So the
default path streams into tar2sqfs (squashfs-tools-ng) and nothing is
unpacked.  Enroot's exact options (``-comp lzo -noD``: data blocks left
uncompressed) and no compression at all exist only in mksquashfs; for those
the flattened view is written straight into a private tree first (from the
same pass that feeds tar2sqfs: piping it through GNU ``tar -x`` instead took
26 s for the bert image against 6 s for tar reading a file, pipes being
expensive in system time here).  lz4 also goes that way: squashfs-tools 4.5's
unsquashfs reports tar2sqfs 1.2's lz4 images as corrupt (its zstd images read
fine), and a file the node's tools cannot read is worse than a slower one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, cast, get_args

from imgpipe.base import process
from imgpipe.base.errors import CommandError
from imgpipe.base.process import last_line, require
from imgpipe.base.removal import remove_tree
from imgpipe.enroot.errors import ConvertError

Compression = Literal["zstd", "lz4", "lzo-enroot", "none"]
COMPRESSIONS: tuple[str, ...] = get_args(Compression)


def usable_cores() -> int:
    """The cores this process may run on (a Slurm job's cpuset, not the whole node)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compression_of(text: str) -> Compression:
    """``text`` as a compression, or ConvertError naming the ones there are."""
    if text not in COMPRESSIONS:
        raise ConvertError(f"unknown squashfs compression {text!r}",
                           hint="one of " + ", ".join(COMPRESSIONS))
    return cast(Compression, text)
ENROOT_OPTIONS = ["-comp", "lzo", "-noD"]
# A 1 MiB pipe instead of Linux's 64 KiB: measured on the bert image, the stream into
# tar2sqfs took 15.9 s through the default pipe and 8.7 s through this one.
PIPE_SIZE = 1 << 20
SQUASH_TIMEOUT_S = 3 * 3600


@dataclass(frozen=True)
class SquashOptions:
    compression: Compression = "zstd"
    zstd_level: int = 3
    processors: int = 0  # 0: every core
    # Hash each layer's tar against the config's diff_id (enroot.verify_diff_ids).
    diff_ids: bool = False

    @property
    def jobs(self) -> int:
        """Compressor threads when the squash tool has the machine to itself (mksquashfs
        over a finished tree): every core this process may run on."""
        return self.processors or usable_cores()

    @property
    def stream_jobs(self) -> int:
        """tar2sqfs's compressor threads: the one pass feeding it keeps two cores busy (the
        decoder and the converter), so every other core, one at least.  On two
        cores one job instead of two took 3 % less CPU and 2-3 % less time (5.46 GB image,
        blobs cached, three runs each), the threads no longer waking each other for every
        128 KiB block."""
        return self.processors or max(1, usable_cores() - 2)

    @property
    def tool(self) -> str:
        return "tar2sqfs" if self.compression == "zstd" else "mksquashfs"


def _tar2sqfs_argv(options: SquashOptions, output: Path) -> list[str]:
    argv = [require("tar2sqfs"), "--quiet", "--no-xattr", "--force",
            "--defaults", "uid=0,gid=0,mode=0755", "--num-jobs", str(options.stream_jobs)]
    argv += ["--compressor", "zstd", "--comp-extra", f"level={options.zstd_level}"]
    return [*argv, str(output)]


def _mksquashfs_argv(options: SquashOptions, tree: Path, output: Path) -> list[str]:
    # mksquashfs stamps the run's time into the superblock and the root folder: fixed here,
    # so that a digest converts to the same bytes in every compression (publish, verify).
    argv = [require("mksquashfs"), str(tree), str(output), "-all-root", "-noappend",
            "-no-progress", "-quiet", "-processors", str(options.jobs), "-exit-on-error",
            "-mkfs-time", "0", "-root-time", "0"]
    if options.compression == "lzo-enroot":
        return argv + ENROOT_OPTIONS
    if options.compression == "lz4":
        return argv + ["-comp", "lz4"]
    return argv + ["-noI", "-noD", "-noF", "-noX"]


def _run_fed(argv: list[str], write: Callable[[IO[bytes]], object], what: str,
             cwd: Path | None = None) -> None:
    """Run ``argv`` while ``write`` fills its stdin; the writer's own error wins."""
    try:
        done = process.feed(argv, write, timeout=SQUASH_TIMEOUT_S, cwd=cwd,
                            pipe_size=PIPE_SIZE, what=what)
    except CommandError as exc:
        raise ConvertError(exc.message) from exc
    if done.returncode != 0:
        _raise_if_full(argv[-1], done.stderr)
        raise ConvertError(f"{what} failed (exit {done.returncode}): {last_line(done.stderr)}")


def squash_stream(feed: Callable[[IO[bytes]], object], output: Path,
                  options: SquashOptions) -> None:
    """Squash the tar stream ``feed`` writes into ``output`` with tar2sqfs (zstd)."""
    _run_fed(_tar2sqfs_argv(options, output), feed, "tar2sqfs")


def squash_tree(fill: Callable[[Path], object], output: Path, options: SquashOptions,
                work: Path) -> None:
    """Let ``fill`` write the root under a private tree, then mksquashfs it into ``output``."""
    tree = work / "rootfs"
    tree.mkdir()
    try:
        fill(tree)
        try:
            result = process.run(_mksquashfs_argv(options, tree, output), check=False,
                                 timeout=SQUASH_TIMEOUT_S, what="mksquashfs")
        except CommandError as exc:
            raise ConvertError(exc.message) from exc
        if result.returncode != 0:
            detail = last_line(result.stderr or result.stdout)
            _raise_if_full(str(output), f"{result.stderr}\n{result.stdout}")
            raise ConvertError(f"mksquashfs failed (exit {result.returncode}): {detail}")
    finally:
        with contextlib.suppress(OSError):  # an image may carry a tree 10,000 deep
            remove_tree(tree)


FULL_BELOW = 4 << 20  # free bytes under which a failed write means a full file system


def _raise_if_full(output: str, stderr: str) -> None:
    """A squash tool that ran out of disk says so on some line before its last one (and
    mksquashfs removes its output): turn that into ENOSPC, which the caller reports with
    the folder and the numbers.  A file system left with almost nothing free counts too."""
    folder = Path(output).parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if "No space left on device" in stderr or free < FULL_BELOW:
        raise OSError(errno.ENOSPC, f"no space left in {folder}", str(folder))
