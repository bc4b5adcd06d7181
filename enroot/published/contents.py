"""What a fetched or received squashfs must hold before it becomes a cache entry, checked from
its binary tables (``inodes``), and the rename that makes it one.  Light on purpose: every
receiving node of a broadcast (``enroot.published.relay``) runs it at the end, without the
registry's client."""

from __future__ import annotations

import os
from pathlib import Path

from imgpipe.base.files import atomic_path
from imgpipe.base.terminal import shown
from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.published.inodes import Entry, entries, kinds, owners_and_xattrs

ALLOWED_KINDS = {"dir", "file", "slink", "pipe"}  # what a conversion makes


def check_contents(path: Path, allowed_setuid: set[str] | None) -> int:
    """Refuse a fetched squashfs holding what no conversion makes: files of an owner other
    than root, extended attributes (file capabilities), device files, sockets, and (when
    ``allowed_setuid`` is given: the image's layers' own) setuid or setgid files the layers
    did not have.  All of it is read from the file's binary tables (``inodes``): no name can
    make an entry read as another mode, and a table that does not parse refuses the file.
    Returns the entry count."""
    owners, has_xattrs = owners_and_xattrs(path)
    if owners - {0}:
        raise ConvertError(f"the published squashfs owns files by uid/gid "
                           f"{', '.join(map(str, sorted(owners - {0})))}, which no conversion "
                           "makes: refused")
    if has_xattrs:
        raise ConvertError("the published squashfs has extended attributes (file capabilities "
                           "live there), which no conversion makes: refused")
    if allowed_setuid is None:  # no names needed unless one is refused (a receiver's check)
        counted = kinds(path)
        if not set(counted) - ALLOWED_KINDS:
            return sum(counted.values())
    listed = entries(path)
    for entry in listed:
        if entry.kind not in ALLOWED_KINDS:
            raise ConvertError(f"the published squashfs holds {entry.kind} "
                               f"/{shown(entry.path, 300)}, which no conversion makes: refused")
    if allowed_setuid is not None:
        _refuse_new_setid(listed, allowed_setuid)
    return len(listed)


def _refuse_new_setid(listed: list[Entry], allowed_setuid: set[str]) -> None:
    """A fetch's last check: no set-id file the image's layers did not have (a receiver's
    check has no layers to ask, and never imports the layers' rules)."""
    from imgpipe.enroot.flatten.rules import is_setid

    for entry in listed:
        if entry.kind == "file" and is_setid(entry.mode) and entry.path not in allowed_setuid:
            raise ConvertError(f"the published squashfs has a set-id file "
                               f"/{shown(entry.path, 300)} (mode {entry.mode:o}) that the "
                               "image's layers do not have: refused")


def publish_partial(partial: Path, final: Path, allowed_setuid: set[str] | None,
                    mode: int = 0o644) -> int:
    """Check a downloaded (or received) squashfs's contents and rename it into place as
    ``final``; the partial file is gone either way.  Returns the entry count."""
    try:
        count = check_contents(partial, allowed_setuid)
        with atomic_path(final, mode=mode) as tmp:
            os.replace(partial, tmp)
    finally:
        partial.unlink(missing_ok=True)
    return count
