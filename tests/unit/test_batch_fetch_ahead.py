"""The batch host's fetch started with the job (issue #61): the broadcast step's first task
follows the words it writes, as they come, and never waits on one that ended without saying
so; a folder or words not this user's own, or another host's, are not followed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from imgpipe.base.errors import ImgpipeError
from imgpipe.cli.importer import main as importer_main
from imgpipe.commands.node import batchfetch
from imgpipe.commands.node.batchfetch import AHEAD_ENV, WORDS, BatchFetch

BLOB = "sha256:" + "c" * 64


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ahead"
    folder.mkdir(mode=0o700)
    return folder


def _line(word: dict) -> bytes:
    return json.dumps(word).encode() + b"\n"


def _first(pid: int, host: str | None = None) -> bytes:
    return _line({"host": host or socket.gethostname(), "pid": pid, "began": time.time() - 2})


def _chunk(upto: int, digests: bool = False) -> bytes:
    word = {"blob": BLOB, "partial": "/nowhere/partial", "size": 300, "chunk_size": 100,
            "upto": upto}
    if digests:
        word["digests"] = ["d0", "d1", "d2"]
    return _line(word)


def test_the_first_task_follows_the_words_as_they_come(tmp_path: Path, monkeypatch) -> None:
    folder = _folder(tmp_path)
    words = folder / WORDS
    words.write_bytes(_first(os.getpid()) + _chunk(100, digests=True))
    monkeypatch.setenv(AHEAD_ENV, str(folder))
    fetch = BatchFetch("head:5000#bench/bert@sha256:" + "a" * 64, None)
    assert time.time() - fetch.began >= 2  # the fetch's own start: the stage times say it
    fetch.follow()
    assert fetch.prefix.poll(BLOB, 100, 5) is True
    assert fetch.prefix.poll(BLOB, 200, 0.2) is None  # not checked yet: the sender waits

    def write_the_rest() -> None:
        with open(words, "ab", buffering=0) as out:
            for part in (_chunk(200)[:20], _chunk(200)[20:], _chunk(300),
                         _line({"entry": "/cache/entry.sqsh"}), _line({"exit": 0})):
                time.sleep(0.05)  # a line may be read half written
                out.write(part)

    threading.Thread(target=write_the_rest).start()
    assert fetch.prefix.wait(BLOB, 300)
    assert fetch.result() == Path("/cache/entry.sqsh")
    checked = fetch.prefix.started()
    assert checked is not None and checked.digests == ("d0", "d1", "d2")


@pytest.mark.parametrize("ending", [b"", _line({"exit": 1})])
def test_a_fetch_that_ended_without_its_entry_fails_the_sender_and_never_hangs(
        tmp_path: Path, monkeypatch, ending: bytes) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    folder = _folder(tmp_path)
    (folder / WORDS).write_bytes(_first(int(gone.stdout)) + _chunk(100, True) + ending)
    monkeypatch.setenv(AHEAD_ENV, str(folder))
    fetch = BatchFetch("head:5000#bench/bert@sha256:" + "a" * 64, None)
    fetch.follow()
    started = time.monotonic()
    with pytest.raises(ImgpipeError, match="fetch failed"):
        fetch.result()
    assert time.monotonic() - started < 5


def test_words_not_to_follow_are_not_followed(tmp_path: Path, monkeypatch) -> None:
    folder = _folder(tmp_path)
    monkeypatch.setenv(AHEAD_ENV, str(folder))
    monkeypatch.setattr(batchfetch, "AHEAD_WAIT_S", 0.2)
    assert batchfetch._ahead_words() is None  # no words came
    (folder / WORDS).write_bytes(_first(os.getpid(), host="another-host"))
    assert batchfetch._ahead_words() is None  # another host's fetch (a shared /tmp)
    (folder / WORDS).unlink()
    (folder / WORDS).symlink_to(tmp_path / "planted")
    (tmp_path / "planted").write_bytes(_first(os.getpid()))
    assert batchfetch._ahead_words() is None  # a link is never followed
    (folder / WORDS).unlink()
    (folder / WORDS).write_bytes(_first(os.getpid()))
    folder.chmod(0o777)
    assert batchfetch._ahead_words() is None  # a folder others may write to
    folder.chmod(0o700)
    found = batchfetch._ahead_words()
    assert found is not None and found[1]["pid"] == os.getpid()
    os.close(found[0])


def test_ahead_refuses_a_folder_others_may_write_to(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    assert importer_main(["ahead", "head:5000#bench/bert@sha256:" + "a" * 64,
                          str(folder)]) == 1
    assert "not a folder of this user's alone" in capsys.readouterr().err
    assert not (folder / WORDS).exists()
