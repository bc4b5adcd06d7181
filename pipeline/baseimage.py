"""A Debian base image with Python, made with debootstrap, for sites that cannot pull one.

Air-gapped build hosts (and CI here) cannot pull public images; this builds
the same kind of base from the Debian mirror they can reach and imports it
into the engine.  It is made once: an image already present is reused.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from imgpipe.base.engine import BuildRequest, Engine, find_build_client, run_build
from imgpipe.base.platforms import Platform
from imgpipe.base.process import run

DEFAULT_TAG = "imgpipe/debian-python:bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_PACKAGES = ("python3", "python3-venv", "ca-certificates")


def ensure_base_image(
    tag: str = DEFAULT_TAG,
    suite: str = "bookworm",
    mirror: str = DEFAULT_MIRROR,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
    engine: Engine | None = None,
    rebuild: bool = False,
    platform: Platform | None = None,
) -> tuple[str, bool]:
    """Return (tag, created): debootstrap and import unless ``tag`` already exists.
    ``platform`` another than the host's: ``debootstrap --arch``, whose second stage runs
    the target's programs under emulation (qemu-user-static's binfmt)."""
    engine = engine or Engine(timeout=600)
    if not rebuild and engine.image_id(tag) is not None:
        return tag, False
    with tempfile.TemporaryDirectory(prefix="imgpipe-rootfs-") as work:
        root = Path(work) / "root"
        arch = [f"--arch={platform.architecture}"] if platform else []
        run(["debootstrap", *arch, "--variant=minbase", f"--include={','.join(packages)}",
             suite, str(root), mirror], timeout=3600, what=f"debootstrap {suite} from {mirror}")
        # Apt lists and caches are not part of an image.
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / leftover).glob("*.deb"):
                entry.unlink()
        tarball = Path(work) / "root.tar"
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tarball), "."],
            timeout=600, what="tar of the root filesystem")
        if platform is None:
            engine.import_tarball(tarball, tag, ['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"])
        else:  # `docker import --platform` keeps the host's architecture: BuildKit says it
            _import_for(tarball, tag, platform)
    return tag, True


def _import_for(tarball: Path, tag: str, platform: Platform) -> None:
    """The root filesystem as an image of ``platform`` (its config says so), by BuildKit;
    ADD unpacks the tar, nothing of the target runs."""
    (tarball.parent / "Dockerfile").write_text(
        "FROM scratch\nADD root.tar /\nENV LANG=C.UTF-8\nCMD [\"/bin/bash\"]\n")
    (tarball.parent / ".dockerignore").write_text("root\n")
    request = BuildRequest(context=tarball.parent, dockerfile=tarball.parent / "Dockerfile",
                           tags=[tag], platform=str(platform), timeout_s=1800)
    run_build(find_build_client(), request, lambda _line: None)
