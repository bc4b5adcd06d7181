"""`imgpipe node-config`: what compute nodes need (enroot.conf, plugstack.conf and the
install lines, by the nodes' Pyxis and Enroot), and setting the shared cache up."""

from __future__ import annotations

from imgpipe.base.config import Settings
from imgpipe.commands.site.nodeboot import make_cache
from imgpipe.enroot.nodeconfig import (
    ACCEPTED_NAMES,
    PYXIS_SO_CANDIDATES,
    NodeConfig,
    Version,
    detect_pyxis,
    enroot_location,
    find_plugstack,
    importer_path,
    parse_version,
    render,
)

__all__ = ["ACCEPTED_NAMES", "make_cache", "node_setup", "parse_version"]


def node_setup(settings: Settings, pyxis_version: Version | None, pyxis_plugin: str | None,
               enroot_path: str | None, importer: str | None, squashfuse: bool,
               accept: frozenset[str] = frozenset(), plugstack: str | None = None
               ) -> NodeConfig:
    """The nodes' configuration for the Pyxis found here (or named), and its plugin path;
    the lines that change jobs taken where ``accept`` names them."""
    detected = detect_pyxis((pyxis_plugin,) if pyxis_plugin else PYXIS_SO_CANDIDATES)
    version = pyxis_version or (detected[1] if detected else None)
    plugin = pyxis_plugin or (detected[0] if detected else PYXIS_SO_CANDIDATES[0])
    return render(settings, importer or importer_path(), version, plugin,
                  enroot_path or enroot_location(), squashfuse=squashfuse, accept=accept,
                  plugstack=(plugstack, "--plugstack") if plugstack else find_plugstack())
