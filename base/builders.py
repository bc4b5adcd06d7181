"""Who builds which platform: the build host's engine natively, a native engine that
``build.builders`` names (a Grace host's, over ssh or tcp), or the host's engine under
emulation (qemu-user-static's binfmt entries, with the fix-binary flag so that they work
inside containers)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from imgpipe.base.engine import BuildClient, probe_client
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.platforms import Platform, host_platform

__all__ = ["BINFMT_DIR", "build_route", "builder_for", "emulator"]


BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")


def emulator(platform: Platform) -> str | None:
    """The binfmt entry that runs ``platform``'s programs here (``qemu-aarch64``), when one
    is registered and enabled with the fix-binary flag (so it works inside containers)."""
    name = f"qemu-{platform.machine}"
    try:
        text = (BINFMT_DIR / name).read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("flags:")), "")
    return name if text.startswith("enabled") and "F" in flags else None


def build_route(platform: Platform, builders: Mapping[str, str]) -> str:
    """How ``platform`` is built here, in words: by the native engine build.builders names
    for it, natively (the build host's own platform), or under emulation (binfmt).
    ImgpipeError, with the fix, when none of the three can."""
    remote = builders.get(str(platform))
    if remote:
        return f"native builder {remote}"
    if platform == host_platform():
        return "native"
    found = emulator(platform)
    if found is None:
        raise ImgpipeError(f"this host ({host_platform()}) cannot build {platform}: no "
                           f"emulator is registered and build.builders names no engine for it",
                           hint="apt-get install qemu-user-static binfmt-support && "
                           f"update-binfmts --enable qemu-{platform.machine}; or set "
                           f"build.builders.{platform} to a native engine's DOCKER_HOST")
    return f"emulated: binfmt {found}"


def builder_for(client: BuildClient, platform: Platform, builders: Mapping[str, str]
                ) -> tuple[BuildClient, str]:
    """Who builds ``platform`` (``build_route``): the client to build with, and how."""
    route = build_route(platform, builders)
    remote = builders.get(str(platform))
    if remote:
        return probe_client(client.path, {"DOCKER_HOST": remote}).with_host(remote), route
    return client, route
