"""The batch host's fetch started with the job (issue #61): the broadcast step's first task
follows the words it writes, as they come, while the fetch holds its lock on them, and never
waits on one that ended without saying so; a folder or words not this user's own, another
host's or another image's, or a fetch that failed (a second try of the step) are not
followed."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from imgpipe.base.errors import ImgpipeError
from imgpipe.cli.importer import main as importer_main
from imgpipe.commands.node import batchfetch
from imgpipe.commands.node.batchfetch import AHEAD_ENV, WORDS, BatchFetch

BLOB = "sha256:" + "c" * 64
URI = "head:5000#bench/bert@sha256:" + "a" * 64


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ahead"
    folder.mkdir(mode=0o700)
    return folder


def _line(word: dict) -> bytes:
    return json.dumps(word).encode() + b"\n"


def _first(host: str | None = None, uri: str = URI) -> bytes:
    return _line({"host": host or socket.gethostname(), "uri": uri, "pid": os.getpid(),
                  "began": time.time() - 2})


def _writer(words: Path) -> int:
    """The words file open as the ahead fetch holds it: created, locked while it writes."""
    fd = os.open(words, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _chunk(upto: int, digests: bool = False) -> bytes:
    word = {"blob": BLOB, "partial": "/nowhere/partial", "size": 300, "chunk_size": 100,
            "upto": upto}
    if digests:
        word["digests"] = ["d0", "d1", "d2"]
    return _line(word)


def test_the_first_task_follows_the_words_as_they_come(tmp_path: Path, monkeypatch) -> None:
    folder = _folder(tmp_path)
    words = _writer(folder / WORDS)
    os.write(words, _first() + _chunk(100, digests=True))
    monkeypatch.setenv(AHEAD_ENV, str(folder))
    fetch = BatchFetch(URI, None)
    assert fetch.ahead and time.time() - fetch.began >= 2  # the fetch's own start
    fetch.follow()
    assert fetch.prefix.poll(BLOB, 100, 5) is True
    assert fetch.prefix.poll(BLOB, 200, 0.2) is None  # not checked yet: the sender waits

    def write_the_rest() -> None:
        for part in (_chunk(200)[:20], _chunk(200)[20:], _chunk(300),
                     _line({"entry": "/cache/entry.sqsh"})):
            time.sleep(0.05)  # a line may be read half written
            os.write(words, part)
        time.sleep(0.2)  # nothing new for a while: the lock says more may come
        os.write(words, _line({"exit": 0}))
        os.close(words)

    threading.Thread(target=write_the_rest).start()
    assert fetch.prefix.wait(BLOB, 300)
    assert fetch.result() == Path("/cache/entry.sqsh")
    checked = fetch.prefix.started()
    assert checked is not None and checked.digests == ("d0", "d1", "d2")


@pytest.mark.parametrize("ending", [b"", b'{"entry": "/cache/e', b"[1]\n"])
def test_a_fetch_gone_without_its_exit_fails_the_sender_and_never_hangs(
        tmp_path: Path, monkeypatch, ending: bytes) -> None:
    """Killed (its lock let go of with it), or words that do not parse: the sender hears
    that the fetch failed, at once."""
    folder = _folder(tmp_path)
    words = _writer(folder / WORDS)
    os.write(words, _first() + _chunk(100, True))
    monkeypatch.setenv(AHEAD_ENV, str(folder))
    fetch = BatchFetch(URI, None)
    fetch.follow()
    assert fetch.prefix.poll(BLOB, 100, 5) is True
    os.write(words, ending)
    os.close(words)  # as a kill does: the lock goes with the process
    started = time.monotonic()
    with pytest.raises(ImgpipeError, match="fetch failed"):
        fetch.result()
    assert time.monotonic() - started < 5


def test_words_not_to_follow_are_not_followed(tmp_path: Path, monkeypatch) -> None:
    folder = _folder(tmp_path)
    monkeypatch.setenv(AHEAD_ENV, str(folder))
    monkeypatch.setattr(batchfetch, "AHEAD_WAIT_S", 0.2)
    words = folder / WORDS
    assert batchfetch._ahead_words(URI) is None  # no words came
    for first in (_first(host="another-host"), _first(uri=URI.replace("bert", "other"))):
        words.write_bytes(first)  # another host's fetch (a shared /tmp), another image's
        assert batchfetch._ahead_words(URI) is None
    words.write_bytes(_first() + _chunk(100, True) + _line({"exit": 1}))
    assert batchfetch._ahead_words(URI) is None  # it failed: a second try fetches anew
    words.unlink()
    words.symlink_to(tmp_path / "planted")
    (tmp_path / "planted").write_bytes(_first())
    assert batchfetch._ahead_words(URI) is None  # a link is never followed
    words.unlink()
    words.write_bytes(_first())
    folder.chmod(0o777)
    assert batchfetch._ahead_words(URI) is None  # a folder others may write to
    folder.chmod(0o700)
    found = batchfetch._ahead_words(URI)
    assert found is not None and found[1]["uri"] == URI
    os.close(found[0])


def test_ahead_refuses_a_folder_others_may_write_to(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "open"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    assert importer_main(["ahead", URI, str(folder)]) == 1
    assert "not a folder of this user's alone" in capsys.readouterr().err
    assert not (folder / WORDS).exists()
