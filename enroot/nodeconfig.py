"""The enroot.conf and plugstack.conf lines a site installs on its compute nodes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpipe.pipeline.config import Settings


@dataclass(frozen=True)
class NodeConfig:
    enroot_conf: str
    plugstack_conf: str
    credentials: str
    importer_path: str


def render(settings: Settings, importer_path: str) -> NodeConfig:
    registry = settings.registry
    squashfs = settings.path(settings.outputs.squashfs_dir).resolve()
    lines = [
        "# /etc/enroot/enroot.conf (lines for imgpipe's head-node registry)",
        "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)",
        "ENROOT_CACHE_PATH /var/lib/enroot-cache/group-$(id -g)",
        "ENROOT_DATA_PATH /tmp/enroot-data/user-$(id -u)",
        "ENROOT_MOUNT_HOME no",
        "ENROOT_SQUASH_OPTIONS -comp zstd -Xcompression-level 3",
        "ENROOT_CONFIG_PATH /etc/enroot",
    ]
    if registry.scheme == "http":
        lines.append("# The registry speaks plain HTTP; this switches every registry to http.")
        lines.append("ENROOT_ALLOW_HTTP yes")
    elif registry.ca_file:
        ca = settings.path(registry.ca_file).resolve()
        lines.append(f"SSL_CERT_FILE {ca}")
    plugstack = [
        "# /etc/slurm/plugstack.conf.d/pyxis.conf",
        "required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis "
        f"importer={importer_path} container_scope=job sbatch_support=1",
    ]
    credentials = [
        "# /etc/enroot/.credentials (netrc; the port is stripped when matching)",
        f"machine {registry.host} login <user> password <password>",
    ] if registry.credentials.source != "none" else []
    site = [
        "# /etc/imgpipe/imgpipe.yaml on every node: the same registry, and the shared",
        f"# squashfs directory {squashfs} mounted at the same path",
    ]
    return NodeConfig("\n".join(lines) + "\n", "\n".join(plugstack + site) + "\n",
                      "\n".join(credentials) + ("\n" if credentials else ""),
                      importer_path)


def importer_path() -> str:
    import shutil

    found = shutil.which("imgpipe-pyxis-importer")
    return found or str(Path("/usr/local/bin/imgpipe-pyxis-importer"))
