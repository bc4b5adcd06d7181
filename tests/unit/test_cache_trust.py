"""Whose cache entries a job takes (enroot.cache.trust, Storage.find_squashfs), case by case: the
files are made by root here and given to other uids, as on a cluster's shared folder.  The
same attacks with real accounts on the sandbox are tests/e2e/test_tenants.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imgpipe.base.terminal import shown
from imgpipe.enroot.cache.layout import audit, make_layout
from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.trust import CacheTrust
from imgpipe.enroot.errors import ConvertError

DIGEST = "sha256:" + "a" * 64
PIN = "sha256:" + "c" * 64
OTHER_PIN = "sha256:" + "d" * 64
JOB_USER, ATTACKER = 4242, 4343


def shared_cache(tmp_path: Path, me: int) -> Storage:
    root = tmp_path / "cache"
    make_layout(Storage(root))  # as root does
    return Storage(root, CacheTrust(me, frozenset({0})))


def plant(path: Path, uid: int, mode: int = 0o644) -> Path:
    path.write_bytes(b"hsqs" + str(uid).encode())
    os.chown(path, uid, -1)
    os.chmod(path, mode)
    return path


def test_a_job_user_takes_its_own_and_roots_entries_never_another_users(tmp_path: Path
                                                                         ) -> None:
    cache = shared_cache(tmp_path, JOB_USER)
    said: list[str] = []
    shared = cache.root / f"imgpipe+bert+sha256-{'a' * 64}+zstd-f2.sqsh"
    own = cache.squashfs("imgpipe/bert", DIGEST, "zstd")
    assert own.name == shared.name.replace(".sqsh", f".u{JOB_USER}.sqsh")
    plant(shared, ATTACKER)
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd", say=said.append) is None
    assert said == [f"ignored {shared.name}: it belongs to uid {ATTACKER}, not to you or root"]
    plant(own, ATTACKER)  # planted under the victim's own name
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd") is None
    own.unlink()
    plant(own, JOB_USER, 0o666)  # the victim's own, but anyone may change it
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd") is None
    os.chmod(own, 0o644)
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd") == own
    shared.unlink()
    plant(shared, 0)  # root's conversion comes first
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd") == shared
    # another repository's name for the same digest is never an answer
    shared.unlink()
    own.unlink()
    plant(cache.root / f"evil+sha256-{'a' * 64}+zstd-f2.sqsh", 0)
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd") is None


def test_a_pinned_lookup_takes_the_pins_file_and_no_other_fetched_one(tmp_path: Path) -> None:
    cache = shared_cache(tmp_path, JOB_USER)
    other = plant(cache.fetched("imgpipe/bert", OTHER_PIN), JOB_USER)
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd", frozenset({PIN})) is None
    pinned = plant(cache.fetched("imgpipe/bert", PIN), JOB_USER)
    assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd", frozenset({PIN})) == pinned
    assert other.name.endswith(f"+squashfs-sha256-{'d' * 64}.u{JOB_USER}.sqsh")


def test_links_fifos_and_folders_at_entry_names_are_ignored(tmp_path: Path) -> None:
    cache = shared_cache(tmp_path, JOB_USER)
    own = cache.squashfs("imgpipe/bert", DIGEST, "zstd")
    target = plant(tmp_path / "elsewhere.sqsh", JOB_USER)
    for make in (lambda: own.symlink_to(target), lambda: os.mkfifo(own), own.mkdir):
        make()
        os.lchown(own, JOB_USER, -1)
        assert cache.find_squashfs("imgpipe/bert", DIGEST, "zstd") is None
        own.rmdir() if own.is_dir() and not own.is_symlink() else own.unlink()


def test_a_job_user_cannot_make_or_adopt_the_shared_layout(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o1777)
    with pytest.raises(ConvertError, match="is not set up"):
        Storage(root, CacheTrust(JOB_USER, frozenset({0}))).prepare()
    with pytest.raises(ConvertError, match="only root may set up"):
        make_layout(Storage(root, CacheTrust(JOB_USER, frozenset({0}))))
    meta = root / ".imgpipe"
    meta.mkdir()
    os.chown(meta, ATTACKER, -1)  # the first job user made it
    with pytest.raises(ConvertError, match=f"made by uid {ATTACKER}, a job user"):
        make_layout(Storage(root))
    with pytest.raises(ConvertError, match=f"belongs to uid {ATTACKER}, a job user"):
        Storage(root, CacheTrust(JOB_USER, frozenset({0}))).prepare()
    meta.rmdir()
    done = make_layout(Storage(root))
    assert done and make_layout(Storage(root)) == []  # idempotent
    Storage(root, CacheTrust(JOB_USER, frozenset({0}))).prepare()
    assert audit(Storage(root)) == []


def test_text_other_users_wrote_reaches_a_terminal_escaped() -> None:
    assert shown("host:1 \x1b]0;pwned\x07\n") == "host:1 \\x1b]0;pwned\\x07\\n"
    assert shown("é") == "\\xe9" and shown("x" * 200).endswith("...")
    assert shown("a\\\\b") == "a\\\\\\\\b"  # a typed backslash cannot pass for an escape


def test_doctor_names_what_was_planted_in_the_cache(tmp_path: Path) -> None:
    from imgpipe.base.configlayers import load_settings
    from imgpipe.commands.site.doctor import check_cache

    cache = shared_cache(tmp_path, 0)
    config = tmp_path / "imgpipe.yaml"
    config.write_text(f"outputs: {{squashfs_dir: {cache.root}}}\n")
    assert check_cache(load_settings(str(config))).verdict == "ok"
    planted = plant(cache.root / f"imgpipe+bert+sha256-{'a' * 64}+zstd-f2.sqsh", ATTACKER)
    (cache.blobs / ("b" * 64)).symlink_to("/etc/shadow")
    found = check_cache(load_settings(str(config)))
    assert found.verdict == "warn"
    assert f"{planted}: a shared name written by uid {ATTACKER}, a job user" in found.detail
    assert f"{cache.blobs / ('b' * 64)}: not a regular file" in found.detail
    assert "node-config --make-cache" in (found.fix or "")


def test_a_file_system_without_locks_is_said_at_once(tmp_path: Path, monkeypatch) -> None:
    """A Lustre client mounted without -o flock answers lockf with ENOSYS: before, that read
    as "held by another process" and every first conversion waited an hour, then failed."""
    import errno
    import fcntl

    import pytest

    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.errors import ConvertError

    storage = Storage(tmp_path / "squashfs")
    storage.prepare()

    def no_locks(*_: object) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(ConvertError, match="gives no file locks") as caught:
        with storage.lock("sha256:" + "ab" * 32):
            pass
    assert "-o flock" in str(caught.value.hint)
