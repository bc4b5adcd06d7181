"""Opening a regular file, never through a link: what every reader of a shared folder uses.

Its own module, importing only ``os`` and ``stat``, so that the decoder process
(``enroot.flatten.decoder``), which starts for every conversion, starts in a few milliseconds.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["NotRegularFileError", "open_regular"]


class NotRegularFileError(OSError):
    """A path where a regular file belongs holds a link, a FIFO, a device or a folder."""


def open_regular(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file at ``path``, never through a link: in a folder other
    users write, a link or a FIFO planted at a cache path must not redirect or hang a read.
    Raises NotRegularFileError (an OSError) for anything but a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFileError(errno.EINVAL, "not a regular file (refused)", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
