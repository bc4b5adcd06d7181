"""A compute node's image as a site has it before imgpipe comes (its own plugstack, Enroot
config and Pyxis plugin), for `imgpipe node-config --root`; and what its files hold."""

from __future__ import annotations

import hashlib
from pathlib import Path

PYXIS_VERSION_MARK = b"\x7fELF\0pyxis: version v0.24.0\0"  # what detect_pyxis reads


IMPORTER = "opt/imgpipe/bin/imgpipe-pyxis-importer"  # where the install lines put imgpipe


def node_image(root: Path, files: dict[str, str], plugin: str, imgpipe: bool = True) -> None:
    """``files`` (path under ``root`` -> text), a Pyxis 0.24 plugin at ``plugin`` and, with
    ``imgpipe``, imgpipe's importer in /opt/imgpipe as a node's admin installs it (a script
    of the node's Python, which every user may run)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / plugin).parent.mkdir(parents=True, exist_ok=True)
    (root / plugin).write_bytes(PYXIS_VERSION_MARK)
    if imgpipe:
        for path, text in ((IMPORTER, "#!/opt/imgpipe/bin/python3\n"),
                           ("usr/bin/python3.11", "\x7fELF\n")):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
            (root / path).chmod(0o755)
        (root / "opt/imgpipe/bin/python3").symlink_to("/usr/bin/python3.11")


def sums(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (links left out), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}
