"""Whether a published squashfs may stand in for a conversion, and fetching it when so.

A job pinned to ``repo@sha256:X`` runs exactly the layers of X because its squashfs is
derived from verified layers.  A squashfs fetched from the registry is derived from
nothing: anyone who may push could attach another one to X.  So one is used only when

- its blob digest equals a pin the publisher recorded (imgpipe.lock, the recipes'
  ``IMGPIPE_SQUASHFS_PINS``, or ``imgpipe verify`` after converting it here), or
- there is no pin and the site opted in (``enroot.published_unpinned``): then the
  image's layers are read too, and a set-id file they do not have refuses it;

and in both cases a fetched file holding a device node is refused.  Every decision is
said in one line; anything refused is converted as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from imgpipe.base.errors import ImgpipeError
from imgpipe.enroot.cache.storage import Storage, fetched_stem
from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.flatten.view import MergedView
from imgpipe.enroot.published.artifact import PublishedSquashfs, fetch, find_published
from imgpipe.enroot.published.pins import Pins
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.ranges import Verified


@dataclass(frozen=True)
class PublishedPolicy:
    """What a conversion may fetch instead of converting."""

    use: bool = True  # False: --no-published, enroot.published: false
    pins: frozenset[str] = field(default_factory=frozenset)  # trusted squashfs digests
    unpinned: bool = False  # enroot.published_unpinned: the site trusts its registry
    range_connections: int = 4  # enroot.range_connections: ranges fetched at once
    # hears each chunk of a fetch once checked, in order: the job's broadcast sends it on
    verified: Verified | None = field(default=None, compare=False)

    def pinned_for(self, image_digest: str,
                   environ: Mapping[str, str] = os.environ) -> PublishedPolicy:
        """This policy with the environment's pins of ``image_digest`` added."""
        extra = Pins.from_env(environ).for_image(image_digest)
        return replace(self, pins=self.pins | extra) if extra else self


@dataclass(frozen=True)
class Fetched:
    published: PublishedSquashfs
    path: Path  # the cache entry, named by the squashfs's own digest
    received: int
    entries: int
    cached: bool = False  # a usable entry of that digest was there already


def _choose(candidates: list[PublishedSquashfs], policy: PublishedPolicy, name: str,
            say: Callable[[str], None]) -> list[PublishedSquashfs]:
    """The candidates to try, in turn: under pins, one per pinned blob (the blob listed
    newest first), each with no size but the registry's own (a pusher's second artifact
    naming the genuine blob with another size must not make the fetch fail) and the chunking
    of the oldest artifact listed for it, the one published before the pin was taken (a
    pusher's newer one with small chunks made every fetch hundreds of requests); else, where
    the site opted in, the newest one."""
    if policy.pins:
        oldest: dict[str, PublishedSquashfs] = {}
        for candidate in candidates:
            if candidate.blob in policy.pins:
                oldest.setdefault(candidate.blob, candidate)
        newest_first = dict.fromkeys(c.blob for c in reversed(candidates) if c.blob in oldest)
        for blob in newest_first:
            if (named := sum(c.blob == blob for c in candidates)) > 1:
                say(f"{named} artifacts of {name} name pinned squashfs {blob[:19]}: fetching "
                    f"it by the oldest listed, {oldest[blob].artifact[:19]}")
        if not oldest:
            say(f"refused published squashfs {', '.join(c.blob for c in candidates)} of "
                f"{name}: pinned to {', '.join(sorted(policy.pins))}; converting")
        return [replace(oldest[blob], size=0) for blob in newest_first]
    if policy.unpinned:
        newest = candidates[-1]
        say(f"published squashfs {newest.blob} of {name} is not pinned; using it as "
            "enroot.published_unpinned allows, after checking it against the layers")
        return [newest]
    say(f"published squashfs {candidates[-1].blob[:19]} of {name} is not pinned: converting "
        "(pin it with `imgpipe verify`, or set enroot.published_unpinned)")
    return []


def fetch_trusted(client: RegistryClient, storage: Storage, repository: str, digest: str,
                 compression: str, policy: PublishedPolicy,
                 layers_view: Callable[[], MergedView], say: Callable[[str], None],
                 count: Callable[[int | None], Callable[[int], None]]) -> Fetched | None:
    """Fetch the published squashfs of ``repository@digest`` into the cache, under its own
    digest's name, when the policy trusts one (call with the digest's lock held); None:
    convert.  Whatever goes wrong with a candidate (its size, its digest, the transfer, the
    disk, what it holds) refuses that one in one line; nothing here fails the caller."""
    name = f"{repository}@{digest[:19]}"
    candidates = find_published(client, repository, digest, compression, say)
    if not candidates:
        say(f"no published squashfs of {name} ({compression}): converting")
        return None
    chosen = _choose(candidates, policy, name, say)
    for turn, candidate in enumerate(chosen, 1):
        existing = storage.find_squashfs(repository, digest, compression,
                                         frozenset({candidate.blob}), say)
        if existing is not None and existing.name.startswith(
                fetched_stem(repository, candidate.blob)):
            return Fetched(candidate, existing, 0, candidate.entries, cached=True)
        then = "trying the next" if turn < len(chosen) else "converting"
        try:
            fetched = _fetch_one(client, storage, candidate, policy, layers_view, say, count)
        except (ImgpipeError, OSError) as exc:
            # The names in it were escaped where they entered (shown), once.
            why = exc.message if isinstance(exc, ImgpipeError) else str(exc)
            say(f"refused published squashfs {candidate.blob[:19]}: {why}; {then}")
            continue
        say(f"fetched published squashfs {candidate.blob} of {name}")
        return fetched
    return None


def _fetch_one(client: RegistryClient, storage: Storage, candidate: PublishedSquashfs,
               policy: PublishedPolicy, layers_view: Callable[[], MergedView],
               say: Callable[[str], None],
               count: Callable[[int | None], Callable[[int], None]]) -> Fetched:
    pinned = candidate.blob in policy.pins
    if pinned:  # the size that counts is the registry's own for the pinned blob
        size = client.blob_size(candidate.repository, candidate.blob)
        if size is None:
            raise ConvertError("the registry does not hold that blob")
        candidate = replace(candidate, size=size)
    allowed = None if pinned else layers_view().setid_paths()
    say(f"fetch published squashfs {candidate.blob[:19]} ({candidate.size / 1e6:.1f} MB)")
    final = storage.fetched(candidate.repository, candidate.blob)
    received, entries = fetch(client, storage, candidate, final, allowed,
                              count(candidate.size), policy.range_connections, say,
                              policy.verified)
    return Fetched(candidate, final, received, entries)
