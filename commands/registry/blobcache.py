"""`imgpipe registry cache up|down|status|config`: the blob cache (nginx) in front of the
registry, for a rack or for many jobs at once (registry.blobcache)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.config import Settings
from imgpipe.base.files import atomic_write
from imgpipe.registry.blobcache import BlobCacheServer

__all__ = ["CacheStatus", "cache_config", "cache_down", "cache_status", "cache_up"]


@dataclass
class CacheStatus:
    running: bool
    url: str
    upstream: str
    pid: int | None
    cache_dir: Path
    cache_bytes: int
    answers: bool
    config_file: Path
    access_log: Path
    blob_cache_setting: str | None  # registry.blob_cache: what clients here are told to use
    started: bool = False


def _status(settings: Settings, server: BlobCacheServer, started: bool = False) -> CacheStatus:
    state = server.state()
    return CacheStatus(state.running, state.url, server.layout.upstream, state.pid,
                       state.cache_dir, state.cache_bytes, state.answers, server.config_file,
                       server.layout.access_log, settings.registry.blob_cache, started)


def cache_up(settings: Settings) -> CacheStatus:
    """Start the blob cache unless it runs (idempotent)."""
    server = BlobCacheServer(settings)
    _, started = server.up()
    return _status(settings, server, started)


def cache_down(settings: Settings) -> bool:
    """Stop it; True when it was running.  The cached blobs stay."""
    return BlobCacheServer(settings).down().running


def cache_status(settings: Settings) -> CacheStatus:
    return _status(settings, BlobCacheServer(settings))


def cache_config(settings: Settings, output: Path | None) -> str:
    """The nginx.conf ``up`` would run, written to ``output`` when given (for a rack host
    whose own nginx or systemd unit runs it)."""
    text = BlobCacheServer(settings).render_config()
    if output is not None:
        atomic_write(output, text, mode=0o644)
    return text
