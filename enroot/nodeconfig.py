"""The enroot.conf and plugstack.conf lines a site installs on its compute nodes.

What is safe depends on the node's Pyxis and where Enroot lives (seen on a node):

- Pyxis older than 0.21 does not know ``importer=`` and fails its init on a
  ``required`` line that has it: every srun on the node then fails.  The importer
  is offered only for 0.21 and newer (a detected or given version).
- With ``container_scope=job``, Pyxis's end-of-job cleanup runs ``enroot list`` with
  ``PATH=/usr/local/bin:/usr/bin:/bin``: Enroot anywhere else fails the epilog and
  Slurm drains the node, so job scope is offered only when Enroot is on that PATH.
- Enroot starts containers through a login shell (``ENROOT_LOGIN_SHELL yes``):
  images whose ``/etc/profile`` resets PATH lose their tools unless they keep it in
  ``/etc/profile.d`` (imgpipe's images do), or nodes turn the login shell off.
- Pyxis runs the importer as the job's user on every node: imgpipe must be installed
  where every user can execute it, and the shared squashfs folder usable by all.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.process import run

PYXIS_SO_CANDIDATES = ("/usr/local/lib/slurm/spank_pyxis.so", "/usr/lib/slurm/spank_pyxis.so",
                       "/usr/lib64/slurm/spank_pyxis.so",
                       "/usr/lib/x86_64-linux-gnu/slurm-wlm/spank_pyxis.so")
PYXIS_VERSION_MARK = re.compile(rb"pyxis: version v(\d+)\.(\d+)(?:\.(\d+))?")
CLEANUP_PATH = ("/usr/local/bin", "/usr/bin", "/bin")  # Pyxis's PATH for `enroot list`
IMPORTER_SINCE = (0, 21)
DIGEST_REFERENCES_SINCE = (4, 0, 0)  # Enroot 3.x: "Invalid image reference" for @sha256
SQUASHFUSE_SINCE = (0, 22)           # use_squashfuse for image paths
SQUASHFUSE_IMPORTER_SINCE = (0, 24)  # ... and for images an importer returns
SQUASHFUSE_NEEDS = ("squashfuse and mountpoint on slurmd's PATH, /dev/fuse usable by job "
                    "users (mode 0666), Enroot's native overlayfs (its default)")
SYSTEM_VENV = "/opt/imgpipe"

Version = tuple[int, int, int]


@dataclass(frozen=True)
class NodeConfig:
    enroot_conf: str
    plugstack_conf: str
    credentials: str
    importer_path: str
    install: str
    pyxis_version: str | None
    notes: list[str]


def parse_version(text: str) -> Version:
    """``0.24``, ``0.24.0`` or ``v0.21.1`` -> (0, 24, 0); ValueError otherwise."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a version such as 0.24 or 0.24.0")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def detect_pyxis(candidates: tuple[str, ...] = PYXIS_SO_CANDIDATES
                 ) -> tuple[str, Version] | None:
    """(plugin path, version) of the node's Pyxis, read from the plugin's own version mark
    (Pyxis logs ``pyxis: version vX.Y.Z`` from a string compiled into it)."""
    for candidate in candidates:
        try:
            data = Path(candidate).read_bytes()
        except OSError:
            continue
        match = PYXIS_VERSION_MARK.search(data)
        if match:
            return candidate, (int(match.group(1)), int(match.group(2)),
                               int(match.group(3) or 0))
    return None


def detect_enroot(enroot: str | None = None) -> Version | None:
    """The version ``enroot version`` prints (this host's, or ``enroot``'s), None without one."""
    binary = enroot or shutil.which("enroot")
    if binary is None:
        return None
    # Enroot makes its cache, data and runtime folders on every command: asking its version
    # must leave nothing in the user's home (a head node with real Enroot), so they point at
    # a scratch folder that goes away.
    with tempfile.TemporaryDirectory(prefix="imgpipe-enroot-probe-") as scratch:
        places = {name: f"{scratch}/{name.split('_')[1].lower()}" for name in
                  ("ENROOT_RUNTIME_PATH", "ENROOT_CACHE_PATH", "ENROOT_DATA_PATH")}
        try:
            done = run([binary, "version"], check=False, timeout=20, what="enroot version",
                       env=places)
            return parse_version(done.stdout.strip().splitlines()[-1]) \
                if done.returncode == 0 else None
        except (ImgpipeError, ValueError, IndexError):
            return None


def nodes_enroot(settings: Settings) -> tuple[Version | None, str]:
    """The compute nodes' Enroot version, and where it was learnt (the config, this host)."""
    if settings.enroot.version:
        return parse_version(settings.enroot.version), "enroot.version in imgpipe.yaml"
    found = detect_enroot()
    return found, "the enroot on this host" if found else "nowhere: no enroot here"


def takes_digests(version: Version | None) -> bool:
    """Whether Enroot parses ``@sha256:`` references (4.0 and newer; unknown counts as yes)."""
    return version is None or version >= DIGEST_REFERENCES_SINCE


def _enroot_conf(settings: Settings, mounting: bool) -> list[str]:
    """The enroot.conf lines."""
    registry = settings.registry
    # Files Enroot makes itself: smallest (zstd) when jobs unpack them, fastest to read
    # through FUSE (lz4) when jobs mount them (bench/bench_squashfuse.py).
    squash_options = "-comp lz4" if mounting else "-comp zstd -Xcompression-level 3"
    lines = [
        "# /etc/enroot/enroot.conf (lines for imgpipe's head-node registry)",
        "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)",
        "ENROOT_CACHE_PATH /var/lib/enroot-cache/group-$(id -g)",
        "ENROOT_DATA_PATH /tmp/enroot-data/user-$(id -u)",
        "ENROOT_MOUNT_HOME no",
        f"ENROOT_SQUASH_OPTIONS {squash_options}",
        "ENROOT_CONFIG_PATH /etc/enroot",
        "# Containers start through a login shell (ENROOT_LOGIN_SHELL yes, the default).",
        "# imgpipe's images keep their PATH in /etc/profile.d, so they work either way; for",
        "# images whose /etc/profile resets PATH (Debian's does) and drops their tools, set:",
        "#ENROOT_LOGIN_SHELL no",
    ]
    if registry.scheme == "http":
        lines.append("# The registry speaks plain HTTP; this switches every registry to http.")
        lines.append("ENROOT_ALLOW_HTTP yes")
    elif registry.ca_file:
        ca = settings.path(registry.ca_file).resolve()
        lines.append(f"SSL_CERT_FILE {ca}")

    return lines


def _pyxis_options(settings: Settings, importer_path: str, pyxis_version: Version | None,
                   enroot_path: str | None, squashfuse: bool, mounting: bool,
                   notes: list[str]) -> list[str]:
    """Pyxis's plugstack options for this node; what the site should know goes to ``notes``."""
    options = ["runtime_path=/run/pyxis"]
    if pyxis_version is None:
        notes.append("Pyxis version unknown (no spank_pyxis.so found; pass --pyxis-version): "
                     "importer= left out, since Pyxis < 0.21 fails on it")
    elif pyxis_version >= IMPORTER_SINCE:
        options.append(f"importer={importer_path}")
    else:
        notes.append(f"Pyxis {_show(pyxis_version)} has no importer= (0.21+): jobs use "
                     "squashfs paths from the recipes")
    enroot_dir = str(Path(enroot_path).parent) if enroot_path else None
    if enroot_dir in CLEANUP_PATH:
        options.append("container_scope=job")
    else:
        where = enroot_path or "not found on this PATH"
        options.append("container_scope=global")
        notes.append(f"enroot is {where}: container_scope=job would make Pyxis's end-of-job "
                     "cleanup (PATH=/usr/local/bin:/usr/bin:/bin) fail and drain the node")
    options.append("sbatch_support=1")
    if mounting and pyxis_version is not None:
        # Pyxis then mounts the squashfs (squashfuse + overlayfs) instead of unpacking it
        # with `enroot create`: a 1.2 GB image starts in 0.4 s instead of 30 s.
        options.append("use_squashfuse=1")
        if pyxis_version < SQUASHFUSE_IMPORTER_SINCE:
            notes.append(f"Pyxis {_show(pyxis_version)}: use_squashfuse applies to squashfs "
                         "paths only (importer images too from 0.24)")
        notes.append(f"use_squashfuse needs {SQUASHFUSE_NEEDS}; `imgpipe doctor` on a node "
                     "checks them; --container-name/--container-save steps still unpack")
        if not settings.enroot.squashfuse:
            notes.append("set enroot.squashfuse: true in imgpipe.yaml: conversions then default "
                         "to lz4, which reads 1.7x faster than zstd through FUSE")
    elif squashfuse and pyxis_version is not None:
        notes.append(f"Pyxis {_show(pyxis_version)} has no use_squashfuse (0.22+): every "
                     "job unpacks its image first (tens of seconds for a GB image)")
    return options


def render(settings: Settings, importer_path: str, pyxis_version: Version | None = None,
           pyxis_so: str = PYXIS_SO_CANDIDATES[0], enroot_path: str | None = None,
           squashfuse: bool = True) -> NodeConfig:
    registry = settings.registry
    squashfs = settings.path(settings.outputs.squashfs_dir).resolve()
    notes: list[str] = []
    mounting = squashfuse and pyxis_version is not None and pyxis_version >= SQUASHFUSE_SINCE
    lines = _enroot_conf(settings, mounting)
    options = _pyxis_options(settings, importer_path, pyxis_version, enroot_path, squashfuse,
                             mounting, notes)
    plugstack = [
        "# /etc/slurm/plugstack.conf.d/pyxis.conf"
        + (f" (Pyxis {_show(pyxis_version)})" if pyxis_version else ""),
        f"required {pyxis_so} {' '.join(options)}",
        *[f"# note: {note}" for note in notes],
    ]
    credentials = [
        "# /etc/enroot/.credentials (netrc; the port is stripped when matching)",
        f"machine {registry.host} login <user> password <password>",
    ] if registry.credentials.source != "none" else []
    install = [
        "# On every compute node: imgpipe where every job user can execute it (Pyxis runs",
        "# the importer as the job's user; a venv under root's home is not executable by",
        "# others), and the same site config and shared squashfs folder.",
        f"python3 -m venv {SYSTEM_VENV} && {SYSTEM_VENV}/bin/pip install imgpipe",
        f"ln -sf {SYSTEM_VENV}/bin/imgpipe-pyxis-importer /usr/local/bin/",
        "install -D -m 0644 imgpipe.yaml /etc/imgpipe/imgpipe.yaml",
        "# The per-user Enroot folders of the enroot.conf lines above live under these:",
        "install -d -m 1777 /run/enroot /var/lib/enroot-cache /tmp/enroot-data",
        "# The shared squashfs folder: every user's jobs create lock files and may convert,",
        "# so it is world-writable with the sticky bit (or 3775 with --group), and its layout",
        "# belongs to root (or enroot.cache_owner), never to the first job user to run:",
        f"imgpipe node-config --make-cache {squashfs}",
    ]
    return NodeConfig("\n".join(lines) + "\n", "\n".join(plugstack) + "\n",
                      "\n".join(credentials) + ("\n" if credentials else ""),
                      importer_path, "\n".join(install) + "\n",
                      _show(pyxis_version) if pyxis_version else None, notes)


def _show(version: Version) -> str:
    return ".".join(map(str, version))


def importer_path() -> str:
    """Where the install lines put the importer (a link into the system-wide venv)."""
    return "/usr/local/bin/imgpipe-pyxis-importer"


def enroot_location() -> str | None:
    return shutil.which("enroot")
