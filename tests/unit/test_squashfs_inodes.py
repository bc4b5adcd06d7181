"""What a squashfs file holds, read from its binary tables (enroot.published.inodes): the same
paths, kinds and modes as the tree it was made from, in every compression mksquashfs and
tar2sqfs write, whatever the names; and a damaged file is one refusal, never a traceback."""

from __future__ import annotations

import os
import random
import stat
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.published.contents import check_contents
from imgpipe.enroot.published.inodes import (
    SquashfsFormatError,
    entries,
    kinds,
    owners_and_xattrs,
)

# Names crafted against text listings: rdsquashfs --describe escapes `"` but not `\`, and
# keeps a newline as it is, so these read as other entries or other modes there.
HOSTILE = ['k \\" 0644 x', 'k \\\\" 0644 "y', "line\nfile usr-bin-ok 0644 0 0 x",
           "tab\there", "ünï cødé", "back\\slash", " lead", "trail "]


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    """A tree with thousands of entries (several metadata blocks), hostile names, every kind a
    conversion makes and set-id bits: what it holds, as (kind, mode) by path."""
    expected: dict[str, tuple[str, int]] = {}
    root.mkdir()
    os.chmod(root, 0o755)
    for index in range(40):
        folder = root / f"pkg{index:02d}-{'d' * 40}"
        folder.mkdir()
        os.chmod(folder, 0o750 if index % 2 else 0o755)
        expected[folder.name] = ("dir", stat.S_IMODE(folder.stat().st_mode))
        for number in range(60):
            path = folder / f"module_{number:03d}_{'x' * (number % 50)}.py"
            path.write_bytes(b"x" * number)
            os.chmod(path, 0o644 if number % 3 else 0o600)
            expected[f"{folder.name}/{path.name}"] = ("file", stat.S_IMODE(path.stat().st_mode))
    special = root / "special"
    special.mkdir()
    expected["special"] = ("dir", 0o755)
    for name in HOSTILE:
        (special / name).write_bytes(b"#!/bin/sh\n")
        os.chmod(special / name, 0o4755)
        expected[f"special/{name}"] = ("file", 0o4755)
    os.symlink("../pkg00", special / "link")
    expected["special/link"] = ("slink", 0o777)
    os.mkfifo(special / "fifo", 0o640)
    expected["special/fifo"] = ("pipe", 0o640)
    (special / "empty").mkdir(0o700)
    expected["special/empty"] = ("dir", 0o700)
    os.link(special / HOSTILE[0], special / "hardlink")
    expected["special/hardlink"] = ("file", 0o4755)
    return expected


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict[str, tuple[str, int]]]:
    root = tmp_path_factory.mktemp("inodes") / "root"
    return root, _tree(root)


@pytest.mark.parametrize("compressor", ["zstd", "gzip", "xz", "lzo", "lz4"])
def test_entries_are_the_trees_in_every_compression(tree, tmp_path: Path,
                                                    compressor: str) -> None:
    root, expected = tree
    out = tmp_path / "image.sqsh"
    subprocess.run(["mksquashfs", str(root), str(out), "-all-root", "-noappend", "-no-progress",
                    "-quiet", "-comp", compressor, "-processors", "2"], check=True,
                   capture_output=True, timeout=120)
    found = {entry.path: (entry.kind, entry.mode) for entry in entries(out)}
    assert found == expected
    assert owners_and_xattrs(out) == ({0}, False)
    # a receiver's check walks the same tables without making names: the same count
    assert kinds(out) == dict(Counter(kind for kind, _ in expected.values()))


def test_a_forged_name_cannot_hide_a_set_id_file(tree, tmp_path: Path) -> None:
    """The attack on the text listing: a set-uid root file whose name reads as mode 0644
    there.  Read from the inodes, every one of them is a set-id file the layers lack."""
    root, _ = tree
    out = tmp_path / "image.sqsh"
    subprocess.run(["mksquashfs", str(root), str(out), "-all-root", "-noappend", "-no-progress",
                    "-quiet", "-comp", "zstd"], check=True, capture_output=True, timeout=120)
    allowed = {f"special/{name}" for name in HOSTILE} | {"special/hardlink"}
    assert check_contents(out, allowed) == len(entries(out))
    for name in [*HOSTILE, "hardlink"]:
        with pytest.raises(ConvertError, match="set-id file /special/"):
            check_contents(out, allowed - {f"special/{name}"})


def test_a_damaged_squashfs_is_one_refusal_never_a_traceback(tree, tmp_path: Path) -> None:
    """Bytes flipped in the tables, the file cut short, pointers aimed anywhere: each read
    ends in the entries of some tree or in ConvertError, never another exception."""
    root, _ = tree
    out = tmp_path / "image.sqsh"
    subprocess.run(["mksquashfs", str(root), str(out), "-all-root", "-noappend", "-no-progress",
                    "-quiet", "-comp", "gzip"], check=True, capture_output=True, timeout=120)
    genuine = out.read_bytes()
    tables = int.from_bytes(genuine[64:72], "little")  # the inode table's start
    chance = random.Random(43)
    damaged = tmp_path / "damaged.sqsh"
    refused = 0
    for trial in range(300):
        data = bytearray(genuine)
        if trial % 10 == 0:
            data = data[:chance.randrange(96, len(data))]
        else:
            for _ in range(chance.randrange(1, 8)):
                where = chance.choice([chance.randrange(0, 96),
                                       chance.randrange(tables, len(data))])
                data[where] = chance.randrange(256)
        damaged.write_bytes(bytes(data))
        for allowed in (set(), None):  # a fetch's check, and a receiver's (no names made)
            try:
                check_contents(damaged, allowed)
            except ConvertError:
                refused += 1
    assert refused > 500
    damaged.write_bytes(b"hsqs" + b"\0" * 92)
    with pytest.raises(SquashfsFormatError, match="squashfs 0.0, not 4.0"):
        entries(damaged)
