"""Settings that each validate but cannot work together: one line each, for `config show`
and `site init` to say (and site init to refuse) before a job finds out."""

from __future__ import annotations

from imgpipe.base.config import Settings

__all__ = ["conflicts"]


def conflicts(settings: Settings) -> list[str]:
    """What cannot work as configured, a line each naming the keys and the way out."""
    found: list[str] = []
    enroot = settings.enroot
    wanted = enroot.default_compression
    if wanted not in enroot.publish_compressions:
        why = ("enroot.compression" if enroot.compression
               else "enroot.squashfuse: true" if enroot.squashfuse else "the default")
        found.append(f"enroot.publish_compressions {enroot.publish_compressions} lacks "
                     f"{wanted}, the compression nodes ask for ({why}): push publishes files "
                     f"no node uses and every node converts; add {wanted} to "
                     "enroot.publish_compressions")
    if enroot.distribution != "shared" and enroot.pyxis_importer is not True:
        said = ("is false" if enroot.pyxis_importer is False
                else "is not set (say true once they have it)")
        found.append(f"enroot.distribution: {enroot.distribution} stages images through "
                     f"imgpipe's importer on the nodes, but enroot.pyxis_importer {said}: give "
                     "the nodes' Pyxis line importer= (node-config --accept importer) or use "
                     "shared")
    data_dir = settings.registry.server.data_dir
    from_cwd = settings.source is None or settings.source.parent.resolve() != settings.root
    if not data_dir.is_absolute() and "registry.server.data_dir" not in settings.origins \
            and from_cwd:  # no project's or --config's file: relative to where it runs
        found.append(f"registry.server.data_dir is {data_dir}, relative to the folder "
                     f"imgpipe runs in (now {settings.path(data_dir)}): `registry up` "
                     "elsewhere starts an empty registry; set an absolute path "
                     "(e.g. /var/lib/imgpipe/registry) in the site config")
    return found
