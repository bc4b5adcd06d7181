"""The files Enroot writes into a root filesystem from the image config.

Enroot's runtime reads them when it starts a container: ``/etc/environment``
(one ``KEY=value`` line per ``Env`` entry), ``/etc/fstab`` (a bind line per
``Volumes`` entry), ``/etc/rc`` (change to ``WorkingDir``, source a non-empty
``/etc/rc.local``, exec the entrypoint with the arguments given, or
``Entrypoint`` + ``Cmd`` when none, ``/bin/sh`` when neither) and
``/etc/rc.local``.  Labels appear in ``/etc/rc`` as comments.
"""

from __future__ import annotations

import shlex
from typing import Any


def _config(image_config: dict[str, Any]) -> dict[str, Any]:
    return image_config.get("config") or image_config.get("Config") or {}


def environment(image_config: dict[str, Any]) -> str:
    return "".join(f"{entry}\n" for entry in _config(image_config).get("Env") or [])


def fstab(image_config: dict[str, Any]) -> str:
    lines = []
    for volume in sorted(_config(image_config).get("Volumes") or {}):
        target = volume.lstrip("/")
        lines.append(f"${{ENROOT_ROOTFS}}/{target} /{target} none x-create=dir,bind,rw,nosuid,"
                     "nodev 0 0\n")
    return "".join(lines)


def rc(image_config: dict[str, Any]) -> str:
    config = _config(image_config)
    workdir = config.get("WorkingDir") or "/"
    entrypoint = list(config.get("Entrypoint") or [])
    cmd = list(config.get("Cmd") or [])
    lines = []
    for key, value in sorted((config.get("Labels") or {}).items()):
        text = f"{key}={value}".replace("\n", " ")
        lines.append(f"# {text}")
    lines += [
        f"mkdir -p {shlex.quote(workdir)} 2> /dev/null",
        f"cd {shlex.quote(workdir)} && unset OLDPWD || exit 1",
        "",
        "if [ -s /etc/rc.local ]; then",
        "    . /etc/rc.local",
        "fi",
        "",
    ]
    entry = " ".join(shlex.quote(arg) for arg in entrypoint)
    default = " ".join(shlex.quote(arg) for arg in cmd)
    if entrypoint and cmd:
        lines += ['if [ $# -gt 0 ]; then', f'    exec {entry} "$@"', 'else',
                  f'    exec {entry} {default}', 'fi']
    elif entrypoint:
        lines.append(f'exec {entry} "$@"')
    elif cmd:
        lines += ['if [ $# -gt 0 ]; then', '    exec "$@"', 'else', f'    exec {default}', 'fi']
    else:
        lines += ['if [ $# -gt 0 ]; then', '    exec "$@"', 'else', '    exec /bin/sh', 'fi']
    return "\n".join(lines) + "\n"


RC_LOCAL = "# Sourced by /etc/rc before the entrypoint; add site setup here.\n"


def rc_files(image_config: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Path (relative to the root) -> (content, mode) of every file Enroot expects."""
    return {
        "etc/environment": (environment(image_config), 0o644),
        "etc/fstab": (fstab(image_config), 0o644),
        "etc/rc": (rc(image_config), 0o755),
        "etc/rc.local": (RC_LOCAL, 0o755),
    }
