"""The shared squashfs cache on its own: digest-keyed names, a planted link is no answer,
uses recorded per job step, and pruning that never removes a file in use or being converted."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

from imgpipe.base.units import human_bytes, parse_size
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.uses import entries, prune, record_use, release_use

DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def storage(tmp_path: Path) -> Storage:
    root = tmp_path / "cache"
    root.mkdir(mode=0o1777, parents=True)
    os.chmod(root, 0o1777)
    made = Storage(root)
    made.prepare()
    return made


def published(store: Storage, digest: str, size: int, age_s: float = 0) -> Path:
    path = store.squashfs("imgpipe/bert", digest, "zstd")
    path.write_bytes(b"s" * size)
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


def test_names_are_keyed_by_digest_and_a_planted_link_is_not_an_answer(tmp_path: Path) -> None:
    store = storage(tmp_path)
    path = store.squashfs("imgpipe/bert", DIGEST, "zstd")
    assert path.name == f"imgpipe+bert+sha256-{'a' * 64}+zstd-f2.sqsh"
    assert store.find_squashfs("imgpipe/bert", DIGEST, "zstd") is None
    os.symlink("/etc/passwd", path)
    assert store.find_squashfs("imgpipe/bert", DIGEST, "zstd") is None
    path.unlink()
    published(store, DIGEST, 10)
    assert store.find_squashfs("imgpipe/bert", DIGEST, "zstd") == path
    assert store.find_squashfs("imgpipe/bert", DIGEST, "lz4") is None


def test_prune_takes_the_least_recently_used_and_spares_files_in_use(tmp_path: Path) -> None:
    store = storage(tmp_path)
    old = published(store, DIGEST, 1000, age_s=3600)
    new = published(store, OTHER, 1000)
    marker = record_use(store, old, job="42", step="0")
    assert [e.users for e in entries(store) if e.path == old] == [[marker.name.split('~', 1)[1]]]
    done = prune(store, max_size=1500)
    assert old.exists() and not new.exists()  # the old one is in use: the new one goes
    assert [e.path for e in done.kept_in_use] == [old]
    release_use(marker)
    release_use(marker)  # Pyxis may release twice
    done = prune(store, max_size=0)
    assert not old.exists() and done.total_after == 0


def test_prune_leaves_a_file_whose_digest_is_being_converted(tmp_path: Path) -> None:
    store = storage(tmp_path)
    path = published(store, DIGEST, 100, age_s=10)
    holding, release = multiprocessing.Event(), multiprocessing.Event()

    def converter() -> None:  # another process, as a conversion on another node would be
        with store.lock(DIGEST):
            holding.set()
            release.wait(30)

    child = multiprocessing.get_context("fork").Process(target=converter)
    child.start()
    try:
        assert holding.wait(30)
        assert prune(store, max_size=0).removed == []
    finally:
        release.set()
        child.join(30)
    assert path.exists()
    assert [e.path for e in prune(store, max_size=0).removed] == [path]


def test_prune_needs_a_limit() -> None:
    with pytest.raises(Exception, match="say how much to prune"):
        prune(Storage(Path("/nonexistent")))


def test_sizes_read_and_shown() -> None:
    assert parse_size("500G") == 500 << 30
    assert parse_size("1.5T") == int(1.5 * (1 << 40))
    assert parse_size("800MiB") == 800 << 20 and parse_size("0") == 0
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"


def test_a_live_conversion_of_the_same_digest_from_another_cache_keeps_its_work_tree(
        tmp_path: Path) -> None:
    """/dev/shm is the host's: two caches (two users, two site folders) converting one digest
    each hold only their own cache's lock.  Cleaning up one's leftovers must leave the other's
    live work tree alone (it vanished mid-squash: "llistxattr ... No such file")."""
    from imgpipe.enroot.cache.storage import RAM_DIR

    digest = "sha256:" + os.urandom(32).hex()
    mine, theirs = storage(tmp_path / "a"), storage(tmp_path / "b")
    live = theirs.work_dir(digest, needs_bytes=1)  # this process: alive
    assert live.parent == RAM_DIR
    dead = RAM_DIR / f"imgpipe-{digest[7:]}~{os.uname().nodename}~999999999~1"
    dead.mkdir()
    try:
        mine.clean_stale(digest)
        assert live.is_dir() and not dead.exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(dead, ignore_errors=True)
