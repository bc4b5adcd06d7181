"""What a node's broadcast task needs of the site's settings before the job's MPI step is
ready (``commands.node.broadcast``): where the registry is and the node's squashfs cache.

Read with the importer's fast reader (``importer.quick_settings``: yaml and imgpipe's light
modules, as a cache hit's ``get`` reads them), because every task of the step reads them
before the chain can start: 16 tasks that load pydantic and requests on a node's cores cost
the whole step their start (issue #61: on the 2-core sandbox the step's last task was ready
at 2.7 s with them, 1.2 s without).  Anything the fast reader does not interpret takes the full
loader."""

from __future__ import annotations

from dataclasses import dataclass

from imgpipe.base.errors import ImgpipeError
from imgpipe.commands.node.importer import _quick
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.trust import CacheTrust
from imgpipe.registry.reference import Reference


@dataclass(frozen=True)
class NodeSite:
    address: str  # the registry's host:port, a URI's default registry
    host: str  # the registry's host: every node listens on its own address toward it
    cache: Storage  # the node's squashfs cache, private where the registry asks for logins

    def pinned(self, uri: str) -> Reference:
        """``uri`` parsed; ImgpipeError unless it names a digest."""
        ref = Reference.parse(uri, default_registry=self.address)
        if ref.digest is None:
            raise ImgpipeError(f"{uri} is not pinned to a digest: staging copies one image's "
                               "bytes to every node",
                               hint="render the recipes from imgpipe.lock")
        return ref


def node_site() -> NodeSite:
    """The registry and the cache, as the node's one config file sets them."""
    quick = _quick()
    if quick is None:
        from imgpipe.commands.node.fanout import node_settings
        from imgpipe.commands.shared.wiring import storage

        settings = node_settings()
        cache = storage(settings)
        cache.private = settings.registry.credentials.source != "none"
        return NodeSite(settings.registry.address, settings.registry.host, cache)
    trust = CacheTrust.of(quick["cache_owner"])
    # as commands.shared.wiring.storage: root and the service account take the path as
    # written (a link on it is refused, never followed), a job user acts with its own rights
    cache = Storage(quick["squashfs_dir_as_written" if trust.is_admin else "squashfs_dir"],
                    trust)
    # a login registry's image is private; a receiver cannot ask the registry, so where the
    # site has credentials every copy is kept as a private one (0600, own folder)
    cache.private = quick["credentials"] != "none"
    return NodeSite(quick["address"], quick["host"], cache)
