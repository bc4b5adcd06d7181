"""Shared pieces: atomic publication and the subprocess chokepoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imgpipe.base.errors import CommandError, ToolMissingError
from imgpipe.base.files import atomic_path, atomic_write
from imgpipe.base.process import run


def test_atomic_write_replaces_whole(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file"
    atomic_write(target, "one")
    atomic_write(target, b"two", mode=0o600)
    assert target.read_text() == "two"
    assert target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["file"]


def test_failure_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "imgpipe.lock"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash midway")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["imgpipe.lock"]


def test_run_captures_and_reports_failure() -> None:
    assert run(["sh", "-c", "echo out; echo err >&2"]).stdout == "out\n"
    with pytest.raises(CommandError) as caught:
        run(["sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 3"], what="the step")
    assert caught.value.message == "the step failed (exit 3): the reason"
    assert caught.value.returncode == 3 and "first" in caught.value.stderr


def test_run_passes_input_by_stdin_only() -> None:
    assert run(["cat"], input_text="secret-by-stdin").stdout == "secret-by-stdin"
    assert run(["cat"]).stdout == ""  # stdin closed, never inherited


def test_missing_program_names_the_package() -> None:
    with pytest.raises(ToolMissingError) as caught:
        run(["mksquashfs-not-here"])
    assert caught.value.message == "mksquashfs-not-here is not installed"


def test_timeout_is_an_error() -> None:
    with pytest.raises(CommandError, match="did not finish within 1 s"):
        run(["sleep", "5"], timeout=1)


def test_atomic_files_get_the_mode_open_would_give(tmp_path: Path) -> None:
    """Exclusive temporaries start private (0600); what is published without a mode must
    still be readable as open() would have made it (others read shared cache files)."""
    old = os.umask(0o022)
    try:
        plain = atomic_write(tmp_path / "plain", "x")
        private = atomic_write(tmp_path / "private", "x", mode=0o600)
    finally:
        os.umask(old)
    assert plain.stat().st_mode & 0o777 == 0o644
    assert private.stat().st_mode & 0o777 == 0o600


def test_remove_tree_goes_deeper_than_python_recursion_and_follows_no_link(tmp_path) -> None:
    """A folder 3,000 levels deep (rmtree's RecursionError in Python 3.11) is removed; a link
    inside it is removed, never what it names."""
    from imgpipe.base.removal import remove_tree

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "file").write_text("stays\n")
    top = tmp_path / "deep"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            below = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = below
        os.symlink(kept, "link", dir_fd=fd)
    finally:
        os.close(fd)
    remove_tree(top)
    assert not top.exists() and (kept / "file").read_text() == "stays\n"
    (tmp_path / "alink").symlink_to(kept)
    remove_tree(tmp_path / "alink")
    assert not (tmp_path / "alink").is_symlink() and (kept / "file").exists()
