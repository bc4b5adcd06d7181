"""The blob cache's lifecycle: nginx in front of the registry, run from a state folder.

``up`` renders ``nginx.conf`` (registry.blobcacheconf) into ``registry.cache_server.
state_dir`` and starts Debian's nginx as ``nginx -c CONF -p STATE -e ERRLOG`` in a session
of its own (``daemon off``: the process started is the master, its pid in ``nginx.pid``);
it is ready when its health path answers.  ``down`` stops it; both are idempotent.  As root
the workers run as ``cache_server.user`` (default ``nobody``), and the folders they write
are given to that account.  A rack host that runs nginx itself takes the same file from
``render_config`` (``imgpipe registry cache config``).

Root runs this on a configured path, so the state folder (and a separate cache folder) is
walked without following links and adopted only when root or the workers' account made it
and it holds only the cache's own files (``imgpipe.base.adminpath``); the logs are made
exclusively, 0600 (they name repositories and digests); the folders the workers write are
theirs alone, 0700 (cached blobs of private images); ``down`` signals the pid in
``nginx.pid`` only when that process's command line names this state folder's config and
its owner is one the caller may stop (``imgpipe.base.daemon``).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from imgpipe.base import process
from imgpipe.base.adminpath import (
    Admins,
    as_path,
    create_private,
    only_names,
    open_admin_folder,
)
from imgpipe.base.config import Settings
from imgpipe.base.daemon import Daemon, daemon_in_file
from imgpipe.base.files import TMP_PREFIX, atomic_write
from imgpipe.registry.blobcacheconf import (
    HEALTH_BODY,
    HEALTH_PATH,
    TEMP_FOLDERS,
    NginxLayout,
    render,
)
from imgpipe.registry.errors import LocalRegistryError
from imgpipe.registry.local import port_in_use
from imgpipe.registry.localfiles import dir_bytes, short

__all__ = ["BlobCacheServer", "CacheState"]

START_DEADLINE_S = 15.0
STOP_DEADLINE_S = 15.0
DEFAULT_USER = "nobody"
LOGS = ("error.log", "access.log", "nginx.out")
STATE_NAMES = frozenset({"nginx.conf", "nginx.pid", "tmp", "blobs", *LOGS})


@dataclass(frozen=True)
class CacheState:
    """Whether this state folder's nginx runs, and where it listens."""

    running: bool
    url: str
    pid: int | None
    cache_dir: Path
    cache_bytes: int
    answers: bool = False


class BlobCacheServer:
    """The nginx that ``registry.cache_server`` describes, in front of ``registry``."""

    def __init__(self, settings: Settings) -> None:
        registry = settings.registry
        server = registry.cache_server
        state = as_path(settings.path(server.state_dir))  # as written: never through a link
        cache = as_path(settings.path(server.cache_dir)) if server.cache_dir else state / "blobs"
        as_root = os.geteuid() == 0
        self.user = (server.user or DEFAULT_USER) if as_root else None
        self.admins = Admins.of(self.user) if as_root else Admins(
            frozenset({0, os.geteuid()}), "root or you")
        self.layout = NginxLayout(
            upstream=registry.url, bind=server.bind, port=server.port, state_dir=state,
            cache_dir=cache, max_size=server.max_size, allow=tuple(server.allow),
            user=self._user_and_group() if self.user else None,
            ca_file=as_path(settings.path(registry.ca_file)) if registry.ca_file else None)
        self.probe_host = "127.0.0.1" if server.bind in ("0.0.0.0", "::") else server.bind
        self.probe_url = f"http://{self.probe_host}:{server.port}"
        self.url = f"http://{server.bind}:{server.port}"

    # -- files ------------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.layout.state_dir / "nginx.conf"

    @property
    def output_log(self) -> Path:
        return self.layout.state_dir / "nginx.out"

    def render_config(self) -> str:
        return render(self.layout)

    def _user_and_group(self) -> str:
        assert self.user is not None
        try:
            entry = pwd.getpwnam(self.user)
        except KeyError:
            raise LocalRegistryError(f"registry.cache_server.user: no account {self.user!r} "
                                     "on this host", hint="name an existing account") from None
        try:
            group = grp.getgrgid(entry.pw_gid).gr_name
        except KeyError:
            group = str(entry.pw_gid)
        return f"{self.user} {group}"

    def _prepare(self) -> None:
        """The state folder (walked, adopted only if ours), the workers' folders (theirs
        alone, 0700), the logs (made exclusively, 0600) and no stale pid file."""
        layout = self.layout
        fd, _ = open_admin_folder(layout.state_dir, self.admins, create_mode=0o755,
                                  adopt=_state_names, refuse=_refuse,
                                  what="a blob cache's state folder")
        assert fd is not None
        try:
            temp = self._worker_folder(fd, "tmp", layout.temp_dir)
            try:
                for name in TEMP_FOLDERS:
                    os.close(self._worker_folder(temp, name, layout.temp_dir / name))
            finally:
                os.close(temp)
            if layout.cache_dir == layout.state_dir / "blobs":
                os.close(self._worker_folder(fd, "blobs", layout.cache_dir))
            for name in LOGS:
                os.close(create_private(fd, name, self.admins, 0o600, _refuse,
                                        str(layout.state_dir)))
            with contextlib.suppress(FileNotFoundError):
                os.unlink("nginx.pid", dir_fd=fd)
        finally:
            os.close(fd)
        if layout.cache_dir != layout.state_dir / "blobs":
            cache, _ = open_admin_folder(layout.cache_dir, self.admins, create_mode=0o700,
                                         adopt=_cache_names, refuse=_refuse,
                                         what="a blob cache's folder")
            assert cache is not None
            try:
                self._give_to_workers(cache, layout.cache_dir)
            finally:
                os.close(cache)

    def _worker_folder(self, parent: int, name: str, where: Path) -> int:
        """``name`` below ``parent``, made 0700 or found (a folder, never a link, of root's
        or the workers'), given to the workers' account; its descriptor."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=parent)
        except OSError:
            raise _refuse(f"{where} is not a folder (a link or a file stands there): refused",
                          "remove it, then run this again") from None
        try:
            self._give_to_workers(fd, where)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _give_to_workers(self, fd: int, where: Path) -> None:
        info = os.fstat(fd)
        if info.st_uid not in self.admins.uids:
            raise _refuse(f"{where} belongs to uid {info.st_uid}, not {self.admins.names}: "
                          "refused", f"move it aside (mv {where} {where}.suspect)")
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.fchown(fd, entry.pw_uid, entry.pw_gid)
        os.fchmod(fd, 0o700)

    def _check_reachable(self) -> None:
        """As root: refuse a folder the workers' account cannot reach (a checkout under
        /root, pytest's folders), which would fail every blob request with a 500."""
        if self.user is None:
            return
        entry = pwd.getpwnam(self.user)
        groups = {entry.pw_gid, *os.getgrouplist(self.user, entry.pw_gid)}
        for folder in (self.layout.temp_dir, self.layout.cache_dir):
            for above in reversed(folder.parents):
                try:
                    info = above.stat()
                except FileNotFoundError:
                    break  # made by _prepare, with the umask's modes
                if info.st_uid == entry.pw_uid:
                    bit = stat.S_IXUSR
                else:
                    bit = stat.S_IXGRP if info.st_gid in groups else stat.S_IXOTH
                if not info.st_mode & bit:
                    raise LocalRegistryError(
                        f"nginx's workers run as {self.user} and cannot reach {folder}: "
                        f"{above} (mode {stat.S_IMODE(info.st_mode):04o}) is closed to them",
                        hint="choose a registry.cache_server.state_dir (and cache_dir) they "
                        "can reach, such as /var/lib/imgpipe/blob-cache, or set "
                        "registry.cache_server.user")

    # -- state ------------------------------------------------------------------------------

    def daemon(self) -> Daemon | None:
        """The live process ``nginx.pid`` names, with whether it is this folder's nginx."""
        return daemon_in_file(self.layout.pid_file, str(self.config_file))

    def pid(self) -> int | None:
        """The master's pid, when this state folder's nginx runs."""
        found = self.daemon()
        return found.pid if found is not None and found.ours else None

    def answers(self) -> bool:
        """Whether this port answers as an imgpipe blob cache (its health path)."""
        try:
            reply = requests.get(self.probe_url + HEALTH_PATH, timeout=(2, 5),
                                 allow_redirects=False)
        except requests.RequestException:
            return False
        return reply.status_code == 200 and reply.text.strip() == HEALTH_BODY

    def state(self) -> CacheState:
        pid = self.pid()
        return CacheState(pid is not None, self.url, pid, self.layout.cache_dir,
                          dir_bytes(self.layout.cache_dir), pid is not None and self.answers())

    # -- up and down ------------------------------------------------------------------------

    def up(self) -> tuple[CacheState, bool]:
        """Start nginx unless it runs; returns its state and whether this call started it."""
        if self.pid() is not None:
            return self.state(), False
        server = self.layout
        if port_in_use(self.probe_host, server.port):
            raise LocalRegistryError(
                f"port {server.port} on {server.bind} is in use by another program",
                hint="stop it, or choose another registry.cache_server.port in imgpipe.yaml")
        binary = process.require("nginx")
        self._check_reachable()  # before any folder is made: a refusal leaves nothing
        self._prepare()
        atomic_write(self.config_file, self.render_config(), mode=0o644)
        with contextlib.suppress(FileNotFoundError):
            server.pid_file.unlink()
        spawned = process.spawn([binary, "-c", str(self.config_file), "-p",
                                 str(server.state_dir), "-e", str(server.error_log)],
                                self.output_log)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if spawned.exited():
                _reap(spawned.pid)
                raise LocalRegistryError(f"nginx exited at start: {self._error_tail()}",
                                         hint=f"its log is {server.error_log}")
            if self.answers():
                return self.state(), True
            time.sleep(0.1)
        _stop(spawned.pid)
        raise LocalRegistryError(f"nginx did not answer on {self.url} within "
                                 f"{START_DEADLINE_S:.0f} s: {self._error_tail()}",
                                 hint=f"its log is {server.error_log}")

    def down(self) -> CacheState:
        """Stop what ``up`` started (fine when nothing runs); the cached blobs stay.  A pid
        file naming any other process, or one the caller may not stop, is refused in one
        line and nothing is signalled."""
        if self.user is not None and os.path.lexists(self.layout.state_dir.parent):
            fd, _ = open_admin_folder(self.layout.state_dir, self.admins, adopt=_state_names,
                                      refuse=_refuse, what="a blob cache's state folder")
            if fd is not None:
                os.close(fd)
        found = self.daemon()
        if found is None:
            return self.state()
        found.check_signal(f"the blob cache of {self.layout.state_dir}")
        before = self.state()
        _stop(found.pid)
        with contextlib.suppress(FileNotFoundError):
            self.layout.pid_file.unlink()
        return before

    def _error_tail(self) -> str:
        lines: list[str] = []
        for path in (self.layout.error_log, self.output_log):
            with contextlib.suppress(OSError):
                lines += path.read_text(errors="replace").strip().splitlines()
        for line in reversed(lines):
            if "[emerg]" in line or "[alert]" in line or "[crit]" in line:
                return short(line)
        return short(lines[-1]) if lines else "(no log)"


def _refuse(what: str, hint: str) -> LocalRegistryError:
    return LocalRegistryError(what, hint=hint)


def _state_names(names: list[str]) -> str | None:
    """What a state folder may hold: the cache's own files (and atomic writes' leftovers)."""
    other = [name for name in names if name not in STATE_NAMES
             and not name.startswith(TMP_PREFIX)]
    return only_names((), "a blob cache's state folder")(other)


def _cache_names(names: list[str]) -> str | None:
    """What a separate cache folder may hold: nginx's two-hex-digit level folders."""
    other = [name for name in names if not (len(name) == 2 and all(
        c in "0123456789abcdef" for c in name))]
    return only_names((), "a blob cache's folder")(other)


def _reap(pid: int) -> bool:
    """Collect ``pid`` when it is this process's exited child; True when it is gone."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return True
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stop(pid: int) -> None:
    """SIGTERM (nginx's fast shutdown), wait, then SIGKILL the master."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_DEADLINE_S
    while time.monotonic() < deadline:
        if _reap(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    _reap(pid)
