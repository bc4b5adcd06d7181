"""How a job step runs: the same job description rendered for Pyxis, Charliecloud or the host.

Every job script describes its steps once, runtime-neutrally, with two shell
functions this module renders per runtime:

``mount_path HOST_PATH CONTAINER_PATH [ro]``
    The one place a path the program receives is translated: in a container the
    host folder is mounted at CONTAINER_PATH and ``REPLY`` is CONTAINER_PATH; on
    the host nothing is mounted and ``REPLY`` is HOST_PATH.  A host path can
    therefore never reach a program inside a container.

``launch PROGRAM ARG...``
    ``srun`` of the program in the step's image with the mounts collected so far,
    the working directory ``$WORKDIR``, and the job's environment.

Pyxis (``srun --container-image``) starts the image through Enroot, which sets the
image's ``/etc/environment`` and runs ``/etc/rc`` through a login shell.
Charliecloud's ``ch-run`` runs the same squashfs file (mounted with squashfuse,
unprivileged) but does neither, so its rendering does what Enroot does.  The host
runtime runs the programs installed on the nodes (``$PYTHON`` for ``python3``).
"""

from __future__ import annotations

from typing import Literal, get_args

Runtime = Literal["pyxis", "charliecloud", "host"]
RUNTIMES: tuple[str, ...] = get_args(Runtime)

# Enroot's start-up inside ch-run: the image's environment file, then /etc/rc through a
# login shell (ENROOT_LOGIN_SHELL's default), which runs the image's /etc/profile.
ENROOT_LIKE_START = (
    'if [ -r /etc/environment ]; then '
    'while IFS= read -r kv || [ -n "$kv" ]; do '
    'case "$kv" in [A-Za-z_]*=*) export "$kv" ;; esac; '
    'done < /etc/environment; fi; '
    'if [ -r /etc/rc ]; then exec /bin/sh -l /etc/rc "$@"; fi; exec "$@"'
)

_HEADER = '''\
# Paths a program receives are translated here and only here: mount_path HOST CONTAINER [ro]
# sets REPLY to the path the program sees.  Host paths may not hold ':' or ',' (mount syntax).
# `step` holds srun options for the next launch (e.g. -N1 -n1).
step=()
# A switch the user sets (SELFTEST, TRUST_CHECKPOINT, EXPORT): unset, empty, 0, no, false
# and off (any case) turn it off, everywhere; anything else turns it on.
switch_on() {
  case "${1,,}" in ''|0|no|false|off) return 1 ;; *) return 0 ;; esac
}
'''

_CONTAINER = _HEADER + '''\
# A file is mounted through its folder: CONTAINER is then that folder, REPLY the file in it.
WORKDIR=/workspace
mounts=()
mount_path() {
  local src=$1 dst=$2
  case "$1$2" in *:*|*,*) echo "${0##*/}: path '$1' holds ':' or ','" >&2; exit 2 ;; esac
  if [ -f "$src" ]; then dst="$2/${src##*/}"; src=$(dirname -- "$src"); fi
'''

_PRELUDES: dict[str, str] = {
    "pyxis": _CONTAINER + '''\
  mounts+=("$src:$2${3:+:$3}")
  REPLY=$dst
}
# Each step stays eligible for Pyxis's squashfuse mode: no --container-name or
# --container-save, and everything a step writes goes to a mount, never to the image.
launch() {
  local IFS=,
  srun "${step[@]}" --kill-on-bad-exit=1 --container-image="$CONT" \\
    --container-mounts="${mounts[*]}" --container-workdir="$WORKDIR" \\
    --no-container-mount-home "$@"
}
''',
    "charliecloud": _CONTAINER + '''\
  mounts+=("$src:$2")
  REPLY=$dst
}
# ch-run mounts the squashfs file with squashfuse, as the job's user, in a mount
# namespace of its own; the mount points must exist in the image.  Every task has its
# own ch-run and mount: with --join the first task's ch-run served the whole node's mount
# and unmounted it when its own task ended, and the node's other tasks died of SIGBUS.
# Tasks still meet through the host's /dev/shm and network (ch-run shares both).
# It neither reads /etc/environment nor runs /etc/rc, so the step does both, through a
# login shell as Enroot does by default.
# shellcheck disable=SC2016  # expanded by the shell inside the container
enroot_like_start=''' + "'" + ENROOT_LIKE_START + "'" + '''
# Slurm signals every process of a step (the time-limit warning, SIGUSR1, too): ch-run's
# own process, which serves the squashfuse mount, starts with SIGUSR1 ignored so that it
# outlives the trainer's checkpoint (the trainer installs its own handler).
launch() {
  local binds=() m
  for m in "${mounts[@]}"; do binds+=(-b "$m"); done
  srun "${step[@]}" --kill-on-bad-exit=1 /bin/sh -c 'trap "" USR1; exec ch-run "$@"' ch-run \\
    "${binds[@]}" -c "$WORKDIR" "$CONT" -- /bin/sh -c "$enroot_like_start" sh "$@"
}
''',
    "host": _HEADER + '''\
mount_path() {
  REPLY=$1
}
launch() {
  local program=$1
  shift
  if [ "$program" = python3 ]; then program=${PYTHON:-python3}; fi
  srun "${step[@]}" --kill-on-bad-exit=1 "$program" "$@"
}
''',
}


def prelude(runtime: str) -> str:
    """The ``mount_path`` and ``launch`` functions of ``runtime``, as bash."""
    return _PRELUDES[runtime]
