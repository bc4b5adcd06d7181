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
                       "/usr/lib/x86_64-linux-gnu/slurm-wlm/spank_pyxis.so",
                       "/usr/lib/aarch64-linux-gnu/slurm-wlm/spank_pyxis.so")
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
    changes: list[Change]


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


@dataclass(frozen=True)
class Change:
    """One line a node may need: where it goes, whose file that is, and what it does to the
    jobs a cluster already runs."""

    file: str
    line: str
    ours: bool  # imgpipe's own file (node-config --apply writes it) or the site's (shown)
    needed: bool  # imgpipe needs it; False: an option the site may take
    affects: str = ""  # how it changes existing users' jobs ("" when it does not)
    safer: str = ""  # the choice that leaves them as they are


ENROOT_CONF = "/etc/enroot/enroot.conf"
SITE_CONFIG_FILE = "/etc/imgpipe/imgpipe.yaml"
IMPORTER_AFFECTS = ("every job's --container-image then goes through imgpipe's importer: "
                    "imgpipe's registry's images from the shared cache, every other "
                    "registry's (nvcr.io, Docker Hub) imported by enroot exactly as before")


def _registry_lines(settings: Settings) -> list[Change]:
    """What Enroot would need to pull imgpipe's images itself.  The importer fetches them on
    its own (imgpipe's TLS and credentials), so none of it is needed where importer= is."""
    registry = settings.registry
    if registry.scheme == "http":
        return [Change(ENROOT_CONF, "ENROOT_ALLOW_HTTP yes", False, False,
                       "switches every registry Enroot pulls from, nvcr.io too, to http",
                       "not needed with importer=; else give the registry TLS "
                       "(imgpipe site init --registry-ca)")]
    if registry.ca_file:
        ca = settings.path(registry.ca_file).resolve()
        return [Change(ENROOT_CONF, f"SSL_CERT_FILE {ca}", False, False,
                       "replaces the CA bundle Enroot trusts for every registry",
                       f"not needed with importer=; else add {ca} to the system's bundle "
                       "(update-ca-certificates; RHEL: update-ca-trust), which keeps the "
                       "public CAs")]
    return []


@dataclass(frozen=True)
class PyxisOption:
    """A plugstack option that changes what the site's existing jobs do: offered commented
    out, with what it changes, unless ``--accept NAME`` takes it."""

    option: str  # as it goes on the line: importer=/usr/local/bin/imgpipe-pyxis-importer
    name: str  # what --accept names: importer | container_scope | squashfuse
    affects: str


CONTAINER_SCOPE_AFFECTS = ("a --container-name container no longer outlives its job: Pyxis "
                           "removes the job's containers when it ends (its default, global, "
                           "keeps them for later jobs)")
SQUASHFUSE_AFFECTS = ("jobs mount their image read-only through squashfuse instead of unpacking "
                      "it: a step that writes into the image's own root fails "
                      "(--container-name/--container-save steps still unpack)")
ACCEPTED_NAMES = ("pyxis", "importer", "container_scope", "squashfuse")


def _pyxis_options(settings: Settings, importer_path: str, pyxis_version: Version | None,
                   enroot_path: str | None, squashfuse: bool, mounting: bool,
                   notes: list[str]) -> tuple[list[str], list[PyxisOption]]:
    """Pyxis's plugstack options for a node without a Pyxis line yet: the ones that leave
    jobs as Pyxis's defaults would run them, and the ones that change them (marked); notes
    for the site."""
    options = ["runtime_path=/run/pyxis", "sbatch_support=1"]  # both Pyxis's defaults
    marked: list[PyxisOption] = []
    if pyxis_version is None:
        notes.append("Pyxis version unknown (no spank_pyxis.so found; pass --pyxis-version): "
                     "importer= left out, since Pyxis < 0.21 fails on it")
    elif pyxis_version >= IMPORTER_SINCE:
        marked.append(PyxisOption(f"importer={importer_path}", "importer", IMPORTER_AFFECTS))
    else:
        notes.append(f"Pyxis {_show(pyxis_version)} has no importer= (0.21+): jobs use "
                     "squashfs paths from the recipes")
    enroot_dir = str(Path(enroot_path).parent) if enroot_path else None
    if enroot_dir in CLEANUP_PATH:
        marked.append(PyxisOption("container_scope=job", "container_scope",
                                  CONTAINER_SCOPE_AFFECTS))
    else:
        where = enroot_path or "not found on this PATH"
        notes.append(f"enroot is {where}: container_scope=job would make Pyxis's end-of-job "
                     "cleanup (PATH=/usr/local/bin:/usr/bin:/bin) fail and drain the node; "
                     "Pyxis's default (global) stays")
    if mounting and pyxis_version is not None:
        marked.append(PyxisOption("use_squashfuse=1", "squashfuse", SQUASHFUSE_AFFECTS))
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
    return options, marked


def pyxis_line(pyxis_so: str, options: list[str], marked: list[PyxisOption],
               accept: frozenset[str]) -> str:
    """The ``required`` line: Pyxis's defaults plus the marked options ``accept`` names."""
    taken = [m.option for m in marked if m.name in accept]
    return " ".join(["required", pyxis_so, *options, *taken])


def marked_lines(marked: list[PyxisOption], accept: frozenset[str]) -> list[str]:
    """The options left out, each a comment saying what it would change and how to take it."""
    return [f"# option, changes existing jobs: {m.affects} (take it: --accept {m.name}):\n"
            f"#   {m.option}" for m in marked if m.name not in accept]


SLURM_CONF_CANDIDATES = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf",
                         "/usr/local/etc/slurm.conf")


def slurm_conf(root: Path = Path("/")) -> Path | None:
    """slurm.conf as slurmd finds it: ``$SLURM_CONF`` on this host, else the first of
    SLURM_CONF_CANDIDATES under ``root``; None where there is none (configless Slurm)."""
    import os

    if root == Path("/") and os.environ.get("SLURM_CONF"):
        return Path(os.environ["SLURM_CONF"])
    return next((Path(c) for c in SLURM_CONF_CANDIDATES if (root / c.lstrip("/")).is_file()),
                None)


def slurm_conf_value(root: Path, key: str) -> str | None:
    """A key of slurm.conf (case-insensitive, as Slurm reads it), None when unset."""
    conf = slurm_conf(root)
    if conf is None:
        return None
    try:
        text = (root / str(conf).lstrip("/")).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.split("#", 1)[0].strip().partition("=")
        if name.strip().lower() == key.lower() and value.strip():
            return value.strip()
    return None


def find_plugstack(root: Path = Path("/")) -> tuple[str, str]:
    """(the plugstack file slurmd reads, how that was learnt), the way slurmd finds it:
    slurm.conf's ``PlugStackConfig``, else ``plugstack.conf`` beside slurm.conf (Slurm's
    configuration folder: /etc/slurm, /etc/slurm-llnl on older Debian packages).  slurm.conf
    is ``$SLURM_CONF`` on this host, else the first of SLURM_CONF_CANDIDATES."""
    conf = slurm_conf(root)
    if conf is None:
        return "/etc/slurm/plugstack.conf", "Slurm's default (no slurm.conf found)"
    value = slurm_conf_value(root, "PlugStackConfig")
    if value:
        return value, f"PlugStackConfig in {conf}"
    return str(conf.parent / "plugstack.conf"), f"beside {conf} (no PlugStackConfig there)"


def cache_lines(squashfs: Path, distribution: str) -> list[str]:
    """What the squashfs folder needs, by how the cluster keeps it (enroot.distribution)."""
    make = f"{SYSTEM_VENV}/bin/imgpipe node-config --make-cache {squashfs}"
    if distribution == "shared":
        return ["# The shared squashfs folder (on the cluster file system, once), its layout "
                "root's", "# (or enroot.cache_owner's):", make]
    lines = ["# enroot.distribution: "
             f"{distribution}: {squashfs} is node-local; make it on every node at each boot",
             "# (before slurmd starts; a tmpfs or local NVMe folder starts empty):", make]
    if distribution == "broadcast":
        lines += ["# broadcast: Open MPI and mpi4py on every node (apt-get install openmpi-bin",
                  "# python3-mpi4py; a venv of the system Python loads Debian's mpi4py), and",
                  "# Slurm's pmix plugin (`srun --mpi=list` names pmix; Debian's loads",
                  "# libpmix.so, which libpmix-dev installs); where nodes share /tmp, mpi.conf's",
                  "# PMIxCliTmpDirBase on a node-local folder. Missing any: sbcast, in one line."]
    if distribution in ("sbcast", "broadcast"):
        lines += ["# sbcast on every node's PATH (Slurm's client commands): the job's batch host",
                  "# runs it; slurm.conf needs nothing (BcastParameters may set defaults,",
                  "# BcastAddr may put its traffic on another network)."]
    return lines


def install_lines(squashfs: Path, distribution: str = "shared") -> list[str]:
    """Getting imgpipe onto a node: a wheel built from the checkout, never a package index."""
    return [
        "# Once, on the build host, in imgpipe's checkout (no root): imgpipe's wheel and every",
        "# wheel it needs, for x86 nodes (dist/nodes/x86_64) and Grace nodes (dist/nodes/aarch64).",
        "./setup.sh node-wheels",
        "# On every compute node (a venv of the system Python: Pyxis runs the importer as the",
        "# job's user, and a venv under root's home is not executable by others; Python 3.11+:",
        "# on RHEL, Rocky or AlmaLinux 9, whose python3 is 3.9: dnf install python3.11 and",
        "# python3.11 -m venv, or python3.12 with PYTHON_VERSION=3.12 ./setup.sh node-wheels;",
        "# their glibc is 2.34: NODE_GLIBC=2.34 ./setup.sh node-wheels):",
        f"python3 -m venv {SYSTEM_VENV} && {SYSTEM_VENV}/bin/pip install --no-index \\",
        "    --find-links dist/nodes/$(uname -m) imgpipe",
        f"{SYSTEM_VENV}/bin/imgpipe node-config --check    # what this node has and lacks",
        f"{SYSTEM_VENV}/bin/imgpipe node-config --apply    # imgpipe's own files only",
        *cache_lines(squashfs, distribution),
    ]


def render(settings: Settings, importer_path: str, pyxis_version: Version | None = None,
           pyxis_so: str = PYXIS_SO_CANDIDATES[0], enroot_path: str | None = None,
           squashfuse: bool = True, accept: frozenset[str] = frozenset(),
           plugstack: tuple[str, str] = ("/etc/slurm/plugstack.conf",
                                         "Slurm's default")) -> NodeConfig:
    """What a node needs, for a node without a Pyxis line yet (``check`` compares with a
    node's own files).  Only imgpipe's own files are needed; lines that would change the
    site's jobs (Enroot's settings, Pyxis's options) are commented out and marked unless
    ``accept`` names them."""
    squashfs = settings.path(settings.outputs.squashfs_dir).resolve()
    notes: list[str] = []
    mounting = squashfuse and pyxis_version is not None and pyxis_version >= SQUASHFUSE_SINCE
    options, marked = _pyxis_options(settings, importer_path, pyxis_version, enroot_path,
                                     squashfuse, mounting, notes)
    line = pyxis_line(pyxis_so, options, marked, accept)
    if settings.enroot.distribution != "shared" and pyxis_version is not None \
            and pyxis_version >= IMPORTER_SINCE:
        notes.append(f"enroot.distribution: {settings.enroot.distribution} needs importer= on "
                     "every node's Pyxis line: stage_image and each node's take run the "
                     "importer (--accept importer)")
    changes = [
        Change(SITE_CONFIG_FILE, "(the site config, from imgpipe site init)", True, True),
        Change(importer_path, f"-> {SYSTEM_VENV}/bin/imgpipe-pyxis-importer", True, True),
        Change(plugstack[0], line, False, True,
               IMPORTER_AFFECTS if "importer" in accept else "",
               "without importer=, the recipes pin squashfs paths (imgpipe convert on the "
               "login node) and nothing of Pyxis changes"),
        *_registry_lines(settings),
    ]
    enroot = [f"# option, {c.affects} ({c.safer}):\n#{c.line}" for c in changes
              if c.file == ENROOT_CONF]
    text = [f"# {plugstack[0]} ({plugstack[1]}), where the node has no Pyxis line yet"
            + (f" (Pyxis {_show(pyxis_version)})" if pyxis_version else "")
            + "; node-config --apply writes it only with --accept pyxis",
            line, *marked_lines(marked, accept), *[f"# note: {note}" for note in notes]]
    registry = settings.registry
    credentials = [
        "# The job user's own credentials for imgpipe's registry: the importer reads",
        f"# registry.credentials ({registry.credentials.source}); Enroot's are not touched.",
    ] if registry.credentials.source != "none" else []
    enroot_text = ["# /etc/enroot/enroot.conf: nothing is needed (the importer fetches from "
                   "imgpipe's registry itself)", *enroot]
    return NodeConfig("\n".join(enroot_text) + "\n", "\n".join(text) + "\n",
                      "\n".join(credentials) + ("\n" if credentials else ""),
                      importer_path, "\n".join(install_lines(
                          squashfs, settings.enroot.distribution)) + "\n",
                      _show(pyxis_version) if pyxis_version else None, notes, changes)


def _show(version: Version) -> str:
    return ".".join(map(str, version))


def importer_path() -> str:
    """Where the install lines put the importer (a link into the system-wide venv)."""
    return "/usr/local/bin/imgpipe-pyxis-importer"


def enroot_location() -> str | None:
    return shutil.which("enroot")
