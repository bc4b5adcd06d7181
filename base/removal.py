"""Removing a folder tree that someone else may have shaped: no link followed, no recursion.

``shutil.rmtree`` recurses once per level in Python 3.11: a folder 3,000 levels deep (a user
can make one in a minute, and an image layer can carry one) ends it with ``RecursionError``,
which no ``ignore_errors`` catches.  ``remove_tree`` walks down and back up with two
descriptors at a time: it opens each child folder relative to its parent without following a
link, goes back up through ``..`` only after checking it reaches the very folder it came
from, and unlinks everything else where it stands.  Its only errors are ``OSError``.
"""

from __future__ import annotations

import os
import stat

__all__ = ["remove_tree"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _first_folder(fd: int) -> str | None:
    """Unlink what is not a folder in ``fd``; the name of the first folder left, if any."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            os.unlink(entry.name, dir_fd=fd)
    return None


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` and everything below it (a link or a file at ``path`` itself is
    unlinked, never followed).  Raises OSError; FileNotFoundError when nothing is there."""
    text = os.path.normpath(os.fspath(path))
    parent_fd = os.open(os.path.dirname(text) or ".",
                        os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    name = os.path.basename(text)
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=parent_fd)
            return
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        above: list[tuple[int, int, str]] = []  # (dev, ino) of each folder above, and our name
        try:
            while True:
                child = _first_folder(fd)
                if child is not None:
                    here = os.fstat(fd)
                    below = os.open(child, _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = below
                    above.append((here.st_dev, here.st_ino, child))
                    continue
                if not above:
                    break
                dev, ino, done = above.pop()
                up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = up
                info = os.fstat(fd)
                if (info.st_dev, info.st_ino) != (dev, ino):
                    raise OSError(f"{text}: a folder was moved while it was removed")
                os.rmdir(done, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
