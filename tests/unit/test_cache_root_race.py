"""Two root processes making the same new cache folder at once (two jobs' first conversions
on a fresh node): the one whose mkdir comes second finds the folder the other made and goes
on, as with a folder that was there before; it used to fail "File exists".  The race is made
certain here by making the folder between the check and the mkdir, as the other process
would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from imgpipe.enroot.cache.storage import Storage
from imgpipe.enroot.cache.trust import CacheTrust
from imgpipe.enroot.errors import ConvertError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the admin path is root's")


def test_the_second_of_two_processes_making_the_cache_goes_on(tmp_path: Path,
                                                              monkeypatch) -> None:
    shared = tmp_path / "shared"
    real_mkdir = os.mkdir

    def first_made_by_another(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        if os.fspath(path) == "shared":
            real_mkdir(path, 0o755, dir_fd=dir_fd)  # the other process, just before us
        real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", first_made_by_another)
    Storage(shared, CacheTrust.of()).prepare()
    monkeypatch.undo()
    assert (shared / ".imgpipe").is_dir()


def test_a_folder_a_job_user_made_in_that_moment_is_still_refused(tmp_path: Path,
                                                                  monkeypatch) -> None:
    shared = tmp_path / "shared"
    real_mkdir = os.mkdir

    def made_by_a_user(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        if os.fspath(path) == "shared":
            real_mkdir(path, 0o777, dir_fd=dir_fd)
            os.chown(path, 65534, 65534, dir_fd=dir_fd)
        real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", made_by_a_user)
    with pytest.raises(ConvertError, match="a job user"):
        Storage(shared, CacheTrust.of()).prepare()
