"""The shared squashfs directory: one class owns its layout and its locks.

Layout under ``root`` (the cluster filesystem, shared by every node)::

    <repo>+sha256-<hex>+<compression>-f<N>.sqsh
                                  conversions, keyed by manifest digest, compression and
                                  FORMAT (what a conversion puts in one)
    <repo>+squashfs-sha256-<hex>.sqsh
                                  published squashfs files fetched from the registry,
                                  keyed by their own digest (what pins name)
    <either name>.u<uid>.sqsh     the same, made by job user <uid> in a shared cache
    .imgpipe/tmp/u<uid>/<either name>.sqsh
                                  a private image's entry (its registry asked for a login):
                                  user <uid>'s alone, 0600 in a 0700 folder, as are its blobs
    .imgpipe/VERSION              layout version
    .imgpipe/CACHEDIR.TAG         tells backup tools this is a cache
    .imgpipe/blobs/sha256/<hex>   registry blobs, shared by all images (hashed on every use)
    .imgpipe/locks/<hex>[.u<uid>].lock  one lock per digest (fcntl.lockf: works over NFS)
    .imgpipe/tmp/                 work areas of running conversions
    .imgpipe/tmp/u<uid>/          a user's partial downloads and private copies (0700)
    .imgpipe/uses/                which job steps use which entry (enroot.cache.uses)

Temporary names carry host and PID, so processes on many hosts never collide;
whoever holds a digest's lock may delete any temporary of that digest, since
nobody else can be writing it.

Shared by every user: Pyxis runs the importer as the job's user, so on a cluster the
root folder is world-writable with the sticky bit (1777) or group-writable with setgid
and sticky (3775), and root or the service account made the layout (``imgpipe
node-config --make-cache``).  Who is trusted with what is ``enroot.cache.trust``'s: entries
are found by exact name and used only when you, root or the service account wrote them
and nobody else can change them; a job user's conversions in a shared cache are its own
(``.u<uid>``), so nobody runs bytes another user chose.  Lock files are created
once, exclusively, and opened without following links.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

from imgpipe.base.files import (
    STALE_AFTER_S,
    TMP_PREFIX,
    atomic_write,
    orphaned,
    owner_tag,
    read_regular,
)
from imgpipe.base.removal import remove_tree
from imgpipe.base.terminal import shown
from imgpipe.enroot.cache.lock import digest_lock
from imgpipe.enroot.cache.rootpath import walk_admin_path
from imgpipe.enroot.cache.trust import (
    CacheTrust,
    check_entry,
    check_layout_folder,
    user_name,
)
from imgpipe.enroot.errors import ConvertError

LAYOUT_VERSION = "1"
# The content a conversion makes, beyond the layers: bumped when it changes (2: empty
# /etc/hosts and /etc/resolv.conf mount points, layers verified against their diff_ids),
# so a file made by an older imgpipe is never returned for a newer one's key.
FORMAT = "2"
RAM_DIR = Path("/dev/shm")
LOCK_TIMEOUT_S = 3600.0  # enroot.lock_timeout_s: a conversion holds its digest's lock
RAM_RESERVE = 1 << 30  # leave this much of /dev/shm to everyone else
CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This directory holds imgpipe's squashfs and blob cache.\n")


def digest_hex(digest: str) -> str:
    algorithm, _, hexpart = digest.partition(":")
    if algorithm != "sha256" or len(hexpart) != 64:
        raise ConvertError(f"not a sha256 digest: {digest!r}")
    return hexpart


class Storage:
    """Paths, entries and locks of one squashfs directory, and who may be trusted in it."""

    def __init__(self, root: Path, trust: CacheTrust | None = None,
                 lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.root = root
        self.trust = trust or CacheTrust.of()
        self.lock_timeout_s = lock_timeout_s
        self._walked = False
        # A private image (its registry asked for credentials): entries and blobs go to this
        # user's own folder, never to a name other users can read (convert sets it).
        self.private = False

    def check_admin_path(self, create: bool = False) -> None:
        """As root or the service account, refuse a cache path a job user could have
        prepared (``enroot.cache.rootpath``); with ``create``, make a missing one (0755).
        Nothing to check for a job user, who acts with its own rights only."""
        if self.trust.is_admin and not self._walked:
            walk_admin_path(self.root, self.trust, 0o755 if create else None)
            self._walked = True

    @property
    def meta(self) -> Path:
        return self.root / ".imgpipe"

    @property
    def blobs(self) -> Path:
        return self.meta / "blobs" / "sha256"

    @property
    def locks(self) -> Path:
        return self.meta / "locks"

    @property
    def tmp(self) -> Path:
        return self.meta / "tmp"

    @property
    def uses(self) -> Path:
        return self.meta / "uses"

    @property
    def version_file(self) -> Path:
        return self.meta / "VERSION"

    @property
    def cachedir_tag(self) -> Path:
        return self.meta / "CACHEDIR.TAG"

    def use_marker(self, name: str) -> Path:
        """A use marker's path (``enroot.cache.uses`` names them)."""
        return self.uses / name

    @property
    def shared(self) -> bool:
        """Whether users other than the root folder's owner may write in it."""
        try:
            return bool(self.root.lstat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))
        except FileNotFoundError:
            return False

    @property
    def _own_names(self) -> bool:
        """A job user in a shared cache writes entries under names of its own (``.u<uid>``):
        the shared names are written by root or the service account alone."""
        return self.shared and not self.trust.is_admin

    def _shared_mode(self) -> int:
        """Mode for the folders every user writes in: the root's (sticky and setgid kept)."""
        return stat.S_IMODE(self.root.stat().st_mode) & 0o3777

    def layout(self) -> list[tuple[Path, int]]:
        """Every folder of the layout with the mode it is made with."""
        everyone = self._shared_mode()
        readable = 0o755 if everyone & (stat.S_IWGRP | stat.S_IWOTH) else everyone
        return [(self.meta, readable), (self.blobs.parent, readable), (self.blobs, everyone),
                (self.locks, everyone), (self.tmp, everyone), (self.uses, everyone)]

    def prepare(self) -> None:
        """Create the layout (idempotent; in a shared cache only root or the service account
        may); refuse a layout of another version, folders another user could swap entries in,
        and shared folders a job user owns."""
        try:
            self.check_admin_path(create=True)
            if not self.root.exists():
                self.root.mkdir(parents=True, exist_ok=True)
            shared = self.shared
            check_layout_folder(self.root, self.trust, shared)
            for folder, mode in self.layout():
                if not folder.exists() and not folder.is_symlink():
                    if shared and not self.trust.is_admin:
                        raise ConvertError(
                            f"the shared squashfs directory {self.root} is not set up "
                            f"({folder.relative_to(self.root)} is missing)",
                            hint="as root (root-squashed storage: as enroot.cache_owner): "
                            f"imgpipe node-config --make-cache {self.root}")
                    if make_shared_dir(folder, mode):
                        continue
                check_layout_folder(folder, self.trust, shared)
            self._check_version()
        except PermissionError as exc:
            raise self._not_shared(exc) from exc
        except OSError as exc:
            raise ConvertError(f"cannot use squashfs directory {self.root}: {exc.strerror}",
                               hint="set outputs.squashfs_dir to a writable folder") from exc

    def _check_version(self) -> None:
        version_file = self.version_file
        why = check_entry(version_file, self.trust)
        if why == "":
            _publish_once(version_file, LAYOUT_VERSION + "\n")
            tag = self.cachedir_tag
            if not tag.exists():
                _publish_once(tag, CACHEDIR_TAG)
            return
        if why is not None:
            raise ConvertError(f"{version_file}: {why}",
                               hint="as root (root-squashed storage: as "
                               f"enroot.cache_owner): imgpipe node-config --make-cache "
                               f"{self.root}")
        found = read_regular(version_file).decode(errors="replace").strip()
        if found != LAYOUT_VERSION:
            raise ConvertError(f"{self.root} holds a cache of layout {shown(found)}, "
                               f"this imgpipe uses {LAYOUT_VERSION}",
                               hint="use another outputs.squashfs_dir")

    def _not_shared(self, exc: OSError) -> ConvertError:
        where = exc.filename or self.root
        return ConvertError(
            f"squashfs directory {self.root}: permission denied on {where}",
            hint=f"every job user must be able to write it: as root, imgpipe node-config "
            f"--make-cache {self.root} (mode 1777, or 3775 with a group of all job users)")

    def blob(self, digest: str) -> Path:
        """Where a blob is kept: the shared folder, or this user's own for a private image."""
        return self.private_blob(digest) if self.private else self.blobs / digest_hex(digest)

    @property
    def entry_mode(self) -> int:
        """The mode of the entries this process writes: 0600 for a private image's (a copy
        sbcast makes keeps it), 0644 otherwise (Pyxis reads as the job's user)."""
        return 0o600 if self.private else 0o644

    def entry_root(self, entry: Path) -> Path:
        """The cache folder an entry belongs to (a private entry lies in ``tmp/u<uid>``)."""
        private = entry.parent
        if private.name.startswith("u") and private.parent.name == "tmp" \
                and private.parent.parent.name == ".imgpipe":
            return private.parent.parent.parent
        return entry.parent

    def private_dir(self) -> Path:
        """This user's own folder for partial downloads and private copies
        (``tmp/u<uid>``, mode 0700): no other user can name or plant anything in it.  One
        planted by another user is refused with its owner named."""
        folder = self.tmp / f"u{self.trust.me}"
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            info = folder.lstat()
            if (not stat.S_ISDIR(info.st_mode) or info.st_uid != self.trust.me
                    or info.st_mode & 0o077):
                raise ConvertError(
                    f"{folder} is not your private folder ({user_name(info.st_uid)}, mode "
                    f"{stat.S_IMODE(info.st_mode):04o}): refused",
                    hint=f"ask an admin to remove it: it was planted in {self.tmp}") from None
        return folder

    def private_blob(self, digest: str) -> Path:
        """This user's own copy of a blob whose shared name another user planted on."""
        return self.private_dir() / digest_hex(digest)

    def private_config(self, digest: str) -> Path:
        """Where this user fetches an image config again whose cached bytes did not match."""
        return self.private_dir() / digest.replace(":", "-")

    def partial_download(self, blob: str) -> Path:
        """Where this user's download of a published squashfs collects: kept for a resume,
        swept after a day."""
        return self.private_dir() / f"sqsh-{digest_hex(blob)}.part"

    def private_work(self, purpose: str) -> Path:
        """A new work folder of this user's (``verify-…``): no other user can name it."""
        import tempfile  # not on the importer's fast path

        return Path(tempfile.mkdtemp(prefix=f"{purpose}-", dir=self.private_dir()))

    def _entry(self, stem: str) -> Path:
        if self.private:
            return self.private_dir() / f"{stem}.sqsh"
        return self.root / (f"{stem}.u{self.trust.me}.sqsh" if self._own_names
                            else f"{stem}.sqsh")

    def _candidates(self, stem: str) -> list[Path]:
        names = [f"{stem}.sqsh"]
        if self._own_names:
            names.append(f"{stem}.u{self.trust.me}.sqsh")
        found = [self.root / name for name in names]
        # this user's private entries (and one taken where another user planted its name),
        # looked at only in a folder that is this user's alone
        own = self.tmp / f"u{self.trust.me}"
        with contextlib.suppress(OSError):
            info = own.lstat()
            if stat.S_ISDIR(info.st_mode) and info.st_uid == self.trust.me \
                    and not info.st_mode & 0o077:
                found.append(own / f"{stem}.sqsh")
        return found

    def squashfs(self, repository: str, digest: str, compression: str) -> Path:
        """Where this user writes the conversion of (digest, compression, FORMAT)."""
        return self._entry(conversion_stem(repository, digest, compression))

    def fetched(self, repository: str, blob: str) -> Path:
        """Where this user writes a fetched published squashfs: named by its own digest, so
        a job pinned to one never finds another."""
        return self._entry(fetched_stem(repository, blob))

    def find_squashfs(self, repository: str, digest: str, compression: str,
                      pins: frozenset[str] = frozenset(),
                      say: Callable[[str], None] | None = None,
                      conversions: bool | None = None) -> Path | None:
        """The usable entry of ``repository@digest``: a fetched squashfs a pin names, or
        (``conversions``; by default only when nothing is pinned) the conversion.  Found by
        exact name; used only when a regular file that you, root or the service account
        wrote and nobody else may change; anything else at those names is ignored, with one
        line to ``say``.  A pinned job thus gets the pinned bytes or, once the pinned file
        could not be had, a conversion from the image's own layers: never another fetch."""
        stems = [fetched_stem(repository, pin) for pin in sorted(pins)]
        if conversions if conversions is not None else not pins:
            stems.append(conversion_stem(repository, digest, compression))
        for stem in stems:
            for path in self._candidates(stem):
                why = check_entry(path, self.trust)
                if why is None:
                    return path
                if why and say is not None:
                    say(f"ignored {path.name}: {why}")
        return None

    def lock(self, digest: str, on_wait: Callable[[str], None] | None = None,
             timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold the digest's exclusive lock (a job user's own lock in a shared cache, where
        its conversions are its own); ``on_wait`` hears who holds it, once.  Waiting longer
        than ``timeout_s`` ends in one line naming the holder."""
        suffix = f".u{self.trust.me}" if self._own_names or self.private else ""
        return digest_lock(self.locks / f"{digest_hex(digest)}{suffix}.lock", digest,
                           self.trust, bool(suffix), self._not_shared, on_wait,
                           self.lock_timeout_s if timeout_s is None else timeout_s)

    def clean_stale(self, digest: str) -> int:
        """Delete leftovers of crashed conversions of ``digest`` (call with its lock held)."""
        hexpart = digest_hex(digest)
        removed = 0
        # /dev/shm is the whole host's, not this cache's: another cache (another user, another
        # site folder) may be converting the same digest there under its own lock, so only
        # work trees whose process is gone are leftovers.
        now = time.time()
        in_ram = [path for path in (RAM_DIR.glob(f"imgpipe-{hexpart}~{socket.gethostname()}~*")
                                    if RAM_DIR.is_dir() else [])
                  if orphaned(path.name, _mtime(path), now)]
        for leftover in [*self.root.glob(f"{TMP_PREFIX}*sha256-{hexpart}*.sqsh.*"),
                         *self.tmp.glob(f"{hexpart}.*"),
                         *self.tmp.glob(f"{hexpart}~*"), *in_ram]:
            # Only this user's own leftovers: another user's stays until its owner (or an
            # admin) converts again, and nothing it made there can fail this conversion.
            removed += self._remove_own(leftover)
        return removed

    def _remove_own(self, path: Path) -> int:
        """Remove ``path`` (a tree too, without recursion or following a link) when this
        user owns it; 1 when removed.  Nothing another user made there raises."""
        try:
            if path.lstat().st_uid != self.trust.me:
                return 0
            remove_tree(path)
        except OSError:
            return 0
        return 1

    def sweep(self) -> int:
        """Remove what this user's crashed runs left, whatever digest: partial blobs,
        partial squashfs files and work trees (also in /dev/shm) whose process is gone (a
        dead pid on this host; on another host, nothing written for a day), and partial
        downloads untouched for a day.  Another user's files are never touched, and
        nothing they made fails it.  Returns how many."""
        now = time.time()
        candidates = [*self.root.glob(f"{TMP_PREFIX}*"), *self.blobs.glob(f"{TMP_PREFIX}*"),
                      *self.tmp.glob("*~*")]
        if RAM_DIR.is_dir():
            candidates += RAM_DIR.glob(f"imgpipe-*~{socket.gethostname()}~*")
        removed = 0
        for path in candidates:
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            if info.st_uid != self.trust.me or not orphaned(path.name, info.st_mtime, now):
                continue  # a user sweeps only its own leftovers
            removed += self._remove_own(path)
        return removed + self._sweep_partials(now) + self._sweep_staged(now)

    def _sweep_staged(self, now: float) -> int:
        """This user's sbcast copies (``tmp/sbcast.u<uid>.…``) no node took for a day: a
        job cancelled between its sbcast and its nodes' check."""
        removed = 0
        for path in self.tmp.glob(f"sbcast.u{self.trust.me}.*"):
            with contextlib.suppress(FileNotFoundError):
                info = path.lstat()
                if info.st_uid == self.trust.me and now - info.st_mtime > STALE_AFTER_S:
                    path.unlink()
                    removed += 1
        return removed

    def _sweep_partials(self, now: float) -> int:
        """This user's partial downloads nobody resumed for a day."""
        folder = self.tmp / f"u{self.trust.me}"
        try:
            info = folder.lstat()
        except FileNotFoundError:
            return 0
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != self.trust.me:
            return 0
        removed = 0
        # a ranged download's record of its done chunks (registry.chunkrecord) goes with it
        for path in [*folder.glob("*.part"), *folder.glob("*.part.chunks")]:
            with contextlib.suppress(FileNotFoundError):
                if now - path.lstat().st_mtime > STALE_AFTER_S:
                    path.unlink()
                    removed += 1
        return removed

    def work_dir(self, digest: str, needs_bytes: int = 0) -> Path:
        """A private work area for this process's conversion of ``digest``.

        In RAM (``/dev/shm``) when ``needs_bytes`` fits there with room to spare:
        an unpacked tree is thrown away after squashing, and on a busy disk its
        writeback dominated (bert's tree: 32 s on disk, 6 s in RAM).  Made exclusively,
        mode 0700, under a name nobody can guess.
        """
        name = f"{digest_hex(digest)}{owner_tag()}~{os.urandom(6).hex()}"
        parent = self.tmp
        if needs_bytes and RAM_DIR.is_dir():
            free = shutil.disk_usage(RAM_DIR).free
            if free > needs_bytes * 1.25 + RAM_RESERVE:
                parent = RAM_DIR
                name = f"imgpipe-{name}"
        path = parent / name
        path.mkdir(mode=0o700, exist_ok=False)
        return path


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return float("inf")  # gone meanwhile: not a leftover


def conversion_stem(repository: str, digest: str, compression: str) -> str:
    return (f"{repository.replace('/', '+')}+sha256-{digest_hex(digest)}"
            f"+{compression}-f{FORMAT}")


def converted_digest(name: str) -> str | None:
    """The image manifest digest a conversion's file name (``conversion_stem``) carries."""
    match = re.search(r"\+sha256-([0-9a-f]{64})\+[a-z0-9-]+-f\d+(?:\.u\d+)?\.sqsh$", name)
    return f"sha256:{match.group(1)}" if match else None


def fetched_stem(repository: str, blob: str) -> str:
    return f"{repository.replace('/', '+')}+squashfs-sha256-{digest_hex(blob)}"


def _publish_once(path: Path, text: str) -> None:
    """Write a file every user's run may try to write first: whoever loses the race (in a
    sticky folder the rename onto another user's file is refused) finds it there."""
    try:
        atomic_write(path, text)
    except PermissionError:
        if not path.is_file():
            raise


def make_shared_dir(folder: Path, mode: int) -> bool:
    """Create ``folder`` with exactly ``mode`` in one step (True), or find it there (False).
    Not mkdir-then-chmod: between the two, another user's job would meet the umask's mode
    and be refused."""
    old = os.umask(0)
    try:
        os.mkdir(folder, mode)
        return True
    except FileExistsError:
        return False
    finally:
        os.umask(old)
