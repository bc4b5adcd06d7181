"""Images of two platforms on this x86 machine: Debian's static busybox for each, from the
Debian mirror (sha256-checked against its Packages index), as per-platform base images
that BuildKit builds on (arm64 under emulation, qemu-user-static's binfmt), and the
listings that compare a squashfs with `docker export` file by file, bytes included.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import requests

from tests import services

CACHE = Path("/var/cache/imgpipe-tests")
ARCHES = ("amd64", "arm64")
Listing = dict[str, tuple[str, int | None, str | None, str | None]]


def _packages_entry(arch: str, package: str) -> dict[str, str]:
    url = f"{services.DEBIAN_MIRROR}/dists/bookworm/main/binary-{arch}/Packages.xz"
    text = lzma.decompress(requests.get(url, timeout=300).content).decode()
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                      if ": " in line and not line.startswith(" "))
        if fields.get("Package") == package:
            return fields
    raise AssertionError(f"{package} is not in {url}")


def busybox(arch: str) -> Path:
    """Debian bookworm's busybox-static binary for ``arch``, downloaded once per machine."""
    target = CACHE / f"busybox-{arch}"
    if target.is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    entry = _packages_entry(arch, "busybox-static")
    deb = requests.get(f"{services.DEBIAN_MIRROR}/{entry['Filename']}", timeout=300).content
    assert hashlib.sha256(deb).hexdigest() == entry["SHA256"], "busybox-static: bad sha256"
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "b.deb").write_bytes(deb)
        subprocess.run(["dpkg-deb", "-x", str(Path(work) / "b.deb"), work], check=True)
        partial = target.with_suffix(".part")
        partial.write_bytes((Path(work) / "bin" / "busybox").read_bytes())
        os.chmod(partial, 0o755)
        partial.rename(target)
    return target


BASE_DOCKERFILE = """\
FROM scratch
COPY skeleton/ /
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
"""
# What a root filesystem has for runtimes to mount over (ch-run needs each to exist)
SKELETON_DIRS = ("dev", "proc", "sys", "tmp", "home", "mnt", "workspace", "etc")
SKELETON_FILES = ("etc/passwd", "etc/group", "etc/hosts", "etc/resolv.conf")


def base_tag(arch: str) -> str:
    return f"imgpipe-test/busybox:{arch}-2"


def busybox_base(arch: str) -> str:
    """``imgpipe-test/busybox:<arch>-2``: a base image of that platform in the engine (the
    engine keeps one platform per tag), made by BuildKit, its RUN step under emulation for a
    platform this host cannot run."""
    tag = base_tag(arch)
    if subprocess.run([services.DOCKER, "image", "inspect", tag], capture_output=True
                      ).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as context:
        for folder in SKELETON_DIRS:
            (Path(context) / "skeleton" / folder).mkdir(parents=True)
        for name in SKELETON_FILES:
            (Path(context) / "skeleton" / name).touch()
        os.chmod(Path(context) / "skeleton" / "tmp", 0o1777)
        (Path(context) / "busybox").write_bytes(busybox(arch).read_bytes())
        os.chmod(Path(context) / "busybox", 0o755)
        (Path(context) / "Dockerfile").write_text(BASE_DOCKERFILE)
        subprocess.run([services.DOCKER, "build", "--network=host", "--platform",
                        f"linux/{arch}", "-t", tag, context], check=True, capture_output=True,
                       timeout=600, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    return tag


def _mode(member: tarfile.TarInfo, enroot_fix: bool) -> str:
    """The entry's mode as ls shows it; ``enroot_fix``: as Enroot leaves it (the owner may
    read every file and enter every folder)."""
    kind = {tarfile.DIRTYPE: stat.S_IFDIR, tarfile.SYMTYPE: stat.S_IFLNK,
            tarfile.FIFOTYPE: stat.S_IFIFO, tarfile.CHRTYPE: stat.S_IFCHR,
            tarfile.BLKTYPE: stat.S_IFBLK}.get(member.type, stat.S_IFREG)
    bits = member.mode
    if enroot_fix and kind == stat.S_IFDIR:
        bits |= 0o700
    elif enroot_fix and kind in (stat.S_IFREG, stat.S_IFIFO):
        bits |= 0o400
    elif kind == stat.S_IFLNK:
        bits = 0o777
    return stat.filemode(kind | bits)


def tar_listing(data: bytes, enroot_fix: bool = False) -> Listing:
    """path -> (mode, size, link target, sha256 of the bytes) of every entry of a tar."""
    listing: Listing = {}
    contents: dict[str, tuple[int, str]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar:
            name = member.name.removeprefix("./").strip("/")
            if not name:
                continue
            size = digest = None
            if member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                body = handle.read()
                size, digest = len(body), hashlib.sha256(body).hexdigest()
                contents[name] = (size, digest)
            elif member.islnk():
                size, digest = contents[member.linkname.removeprefix("./").strip("/")]
            listing[name] = (_mode(member, enroot_fix and not member.islnk()), size,
                             member.linkname if member.issym() else None, digest)
    return listing


def export_listing(image: str, platform: str) -> Listing:
    """`docker export` of a container of ``image`` made for ``platform``."""
    # a command for images with none: the container is never started
    container = subprocess.run([services.DOCKER, "create", "--platform", platform, image, "sh"],
                               check=True, capture_output=True, text=True).stdout.strip()
    try:
        exported = subprocess.run([services.DOCKER, "export", container], check=True,
                                  capture_output=True, timeout=600).stdout
    finally:
        subprocess.run([services.DOCKER, "rm", container], capture_output=True)
    return tar_listing(exported, enroot_fix=True)


def squashfs_listing(path: Path) -> Listing:
    """The squashfs's entries, through squashfs-tools-ng's sqfs2tar (the bytes as stored)."""
    data = subprocess.run(["sqfs2tar", "--no-skip", str(path)], check=True,
                          capture_output=True, timeout=600).stdout
    return tar_listing(data)
