"""Conversions every user's jobs take: the cache's service account, reached through sudo.

In a shared cache a job user's conversion is that user's alone (``enroot.cache.trust``): another
user's jobs never run bytes a job user chose.  So that users still share conversions, a site
names the writer in its config, ``enroot.cache_writer``, and lets every job user run exactly
that command as the service account (``enroot.cache_owner``), for instance::

    # /etc/sudoers.d/imgpipe
    ALL ALL=(imgpipe-cache) NOPASSWD: /usr/local/bin/imgpipe-cache-writer \
        --config /etc/imgpipe/imgpipe.yaml *

The writer is the narrow privileged path: it takes one argument, ``REPOSITORY@sha256:HEX``
(nothing a shell or a path could make more of), reads only the site config the sudoers line
names (a file root or the service account owns and nobody else may write), ignores the
caller's environment (no pins, no opt-ins: sudo resets it, and the writer drops what is
left), converts from the registry the site configures, from layers verified on every byte,
and writes the shared entry.  The importer then takes that entry by its exact name and owner,
never by what the writer printed.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from imgpipe.base import process
from imgpipe.base.config import Settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.base.terminal import shown
from imgpipe.commands.node.audit import record, result_of, system_sudo
from imgpipe.commands.node.cache import prune_after_conversion
from imgpipe.commands.shared.wiring import registry_client, squash_options, storage
from imgpipe.enroot.cache.trust import user_name
from imgpipe.enroot.convert import convert, resolve_digest
from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.published.pins import PINS_ENV
from imgpipe.enroot.published.policy import PublishedPolicy
from imgpipe.registry.reference import Reference

COMPONENT = r"[a-z0-9]+(?:[._-][a-z0-9]+)*"  # the distribution spec's path component
PINNED = re.compile(rf"(?P<repository>{COMPONENT}(?:/{COMPONENT})*)"
                    r"@(?P<digest>sha256:[0-9a-f]{64})")
WRITER_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class Written:
    path: Path
    converted: bool
    seconds: float


def write_shared(settings: Settings, argument: str,
                 say: Callable[[str], None] = lambda _: None) -> Written:
    """Convert ``REPOSITORY@sha256:HEX`` into the shared entry, as root or the service account."""
    os.environ.pop(PINS_ENV, None)  # the caller's pins choose nothing here
    match = PINNED.fullmatch(argument)
    if match is None:
        raise ConvertError(f"the cache writer takes REPOSITORY@sha256:HEX, not {shown(argument)}",
                           hint="the importer calls it; it is not for people")
    cache = storage(settings)
    if not cache.trust.is_admin:
        raise ConvertError(f"imgpipe-cache-writer runs as {cache.trust.admin_names()} only, "
                           f"not as {user_name(cache.trust.me)}",
                           hint="run it through the sudoers line docs/threat-model.md shows")
    ref = Reference(settings.registry.address, match["repository"], tag=None,
                    digest=match["digest"])
    enroot = settings.enroot
    started = time.monotonic()
    done = convert(registry_client(settings), cache, ref, squash_options(settings), say,
                   connections=enroot.max_connections,
                   published=PublishedPolicy(enroot.published, frozenset(),
                                             enroot.published_unpinned,
                                             enroot.range_connections))
    if done.converted and enroot.cache_max_size:  # the shared entries are the writer's
        prune_after_conversion(cache, enroot.cache_max_size, done.path, say)
    # the service account's own line of the audit log (its config's, if it sets one)
    record("write", str(ref), done.digest, done.path, result_of(done),
           config=str(settings.source) if settings.source else None)
    return Written(done.path, done.converted, time.monotonic() - started)


def ask_writer(settings: Settings, ref: Reference, say: Callable[[str], None]) -> bool:
    """Have the service account convert ``ref`` into the shared entry (enroot.cache_writer);
    False, with one line, when it did not (the caller then converts for itself)."""
    command = settings.enroot.cache_writer
    owner = settings.enroot.cache_owner
    if not command or not owner:
        return False
    digest = ref.digest or resolve_digest(registry_client(settings), ref)
    argv = [system_sudo(), "-n", "-u", owner, *shlex.split(command),
            f"{ref.repository}@{digest}"]
    say(f"asking {owner} to convert {ref.repository}@{digest[:19]} for every user")
    try:
        process.run(argv, timeout=WRITER_TIMEOUT_S, what="the cache writer")
    except ImgpipeError as exc:
        say(f"the cache writer did not convert it ({shown(exc.message)}): converting for "
            "you alone")
        return False
    return True
