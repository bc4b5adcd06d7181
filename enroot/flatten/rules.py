"""The layer rules: what one tar entry of a layer means for the root, each rule written once.

Every path that reads layers asks here: the stream (``streamer``), the view (``view``) and
its writer (``viewwriter``), the check of the stream against the view, and the set-id listing
a published squashfs is held to.  A change to a rule is a
change to this module only.

* **Names** (:func:`normalize`): relative, slash-joined; refused when absolute, with ``..``,
  a NUL byte, over 4095 bytes, or a component over 255 bytes.
* **Dropped entries** (:func:`dropped`): the root itself, device nodes and anything under
  ``dev/`` (the runtime mounts its own ``/dev``).
* **Whiteouts** (:func:`whiteout_of`): ``.wh.NAME`` hides NAME of the layers below,
  ``.wh..wh..opq`` hides everything the layers below hold under its folder; a whiteout of
  something that is not a plain name is refused.
* **Kinds** (:func:`kind_of`): directories, regular files, symbolic links, hard links and
  FIFOs; anything else is refused.
* **Links**: a symbolic link whose relative target climbs above the root, or holds a NUL
  byte, is refused (:func:`check_symlink`); a hard link names its target by a path that
  obeys the name rule (:func:`hardlink_target`); the view refuses one whose target is no
  file of the image, or itself.
* **Parents** (:func:`symlinked_parent`): nothing may be written below a path that is a
  symbolic link (writing through it could leave the root).
* **Modes** (:func:`fixed_mode`): Enroot's permission fix; every entry is owned by root.
* **What the layers did not describe**: a folder only implied by a path below it is mode
  0755, time 0 (:data:`IMPLICIT_DIR_MODE`); Enroot's files (``/etc/rc`` and its siblings,
  from the image config) replace the image's and are written last; ``/etc/hosts`` and
  ``/etc/resolv.conf`` are added empty where missing, for ch-run to bind over
  (:data:`RUNTIME_MOUNT_POINTS`).
* **Hard links to hidden bytes**: a hard link whose target a later layer replaced still
  shows the old bytes (as overlayfs does): they are kept while the layers stream and
  written as a regular file (``enroot.flatten.links``).
"""

from __future__ import annotations

from typing import Literal

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten.tarreader import Member

MAX_NAME = 4095
MAX_COMPONENT = 255
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
IMPLICIT_DIR_MODE = 0o755  # a folder no layer described, only implied by a path below it
# Files that container runtimes bind the host's over (Docker injects them at run time, so
# images lack them).  Enroot creates them itself; Charliecloud's ch-run binds only onto
# files that exist in the image, so each squashfs carries them, empty, where missing.
RUNTIME_MOUNT_POINTS = ("etc/hosts", "etc/resolv.conf")
MOUNT_POINT_MODE = 0o644

Kind = Literal["dir", "file", "symlink", "hardlink", "fifo"]


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


def dropped(member: Member, path: str) -> bool:
    """True for entries the root never holds: the root itself, device nodes, ``dev/*``."""
    return not path or member.ischr() or member.isblk() or path.startswith("dev/")


def whiteout_of(path: str, layer: str, name: str) -> tuple[str, bool] | None:
    """For a whiteout at ``path``: (what it hides, True when that is the folder's lower
    contents rather than the path itself); None for any other entry."""
    parent, _, base = path.rpartition("/")
    if not base.startswith(WHITEOUT):
        return None
    if base == OPAQUE:
        return parent, True
    hidden = base[len(WHITEOUT):]
    if hidden in ("", ".", "..") or hidden.startswith(WHITEOUT):
        raise HostileLayerError(layer, name, f"a whiteout of {hidden!r}, which is not a plain "
                                "name")
    return (f"{parent}/{hidden}" if parent else hidden), False


def kind_of(member: Member, layer: str) -> Kind:
    """The kind of entry ``member`` puts in the root; refuses kinds a root cannot hold."""
    if member.isfile():
        return "file"
    if member.isdir():
        return "dir"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    if member.isfifo():
        return "fifo"
    raise HostileLayerError(layer, member.name, f"unsupported entry type {member.type!r}")


def check_symlink(path: str, member: Member, layer: str) -> None:
    """Refuses a symbolic link whose relative target climbs above the root, or holds NUL."""
    if _climbs_out(path, member.linkname):
        raise HostileLayerError(layer, member.name,
                                f"symlink target {member.linkname!r} climbs above the root")
    if "\x00" in member.linkname:
        raise HostileLayerError(layer, member.name, "NUL byte in the symlink target")


def hardlink_target(member: Member, layer: str) -> str:
    """The path a hard link shares its bytes with, under the name rule."""
    return normalize(member.linkname, layer, "hard link target")


def symlinked_parent(prefix: str, link: str | None, layer: str, name: str) -> HostileLayerError:
    """The refusal of an entry whose parent ``prefix`` is a symbolic link (to ``link``)."""
    return HostileLayerError(layer, name, f"its parent {prefix!r} is a symlink (to {link!r}); "
                             "writing through it could leave the root")


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


def fixed_mode(kind: str, mode: int) -> int:
    """Enroot's permission fix: the owner reads everything and owns directories fully."""
    if kind == "dir":
        return (mode & 0o7777) | 0o700
    if kind == "symlink":
        return 0o777
    return (mode & 0o7777) | 0o400


def is_setid(mode: int) -> bool:
    """A setuid or setgid mode: what a published squashfs may hold only where the layers do."""
    return bool(mode & 0o6000)
