"""A Debian base image with Python, made with debootstrap, for sites that cannot pull one.

Air-gapped build hosts (and CI here) cannot pull public images; this builds
the same kind of base from the Debian mirror they can reach and imports it
into the engine.  It is made once: an image already present is reused.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from imgpipe.base.engine import Engine
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
) -> tuple[str, bool]:
    """Return (tag, created): debootstrap and import unless ``tag`` already exists."""
    engine = engine or Engine(timeout=600)
    if not rebuild and engine.image_id(tag) is not None:
        return tag, False
    with tempfile.TemporaryDirectory(prefix="imgpipe-rootfs-") as work:
        root = Path(work) / "root"
        run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite,
             str(root), mirror], timeout=1800, what=f"debootstrap {suite} from {mirror}")
        # Apt lists and caches are not part of an image.
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / leftover).glob("*.deb"):
                entry.unlink()
        tarball = Path(work) / "root.tar"
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tarball), "."],
            timeout=600, what="tar of the root filesystem")
        engine.import_tarball(tarball, tag, ['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"])
    return tag, True
