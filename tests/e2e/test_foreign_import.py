"""Another registry's image (nvcr.io's) through imgpipe's importer, as a job user whose home
is not writable: the file lands where Pyxis itself imports ($PYXIS_RUNTIME_PATH/UID, which
Pyxis makes for the user), or outside Pyxis in the user's private folder of the node's squashfs
cache, never in the home; release removes it; with neither folder usable the importer fails in
one line naming both.  Enroot is not packaged here: a stand-in writes the file `enroot import
--output` would (tests/unit/test_importer_foreign.py checks how it is called)."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from tests.cluster import USERS, ensure_users, shared_folder, system_imgpipe

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
USER = USERS[0]
URI = "docker://nvcr.io#nvidia/pytorch:25.01-py3"
ENROOT = '#!/bin/sh\n[ "$1 $2" = "import --output" ] || exit 2\nprintf hsqs > "$3"\n'


def _as_user(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", USER, "--", "env", "-i",
                           *(f"{k}={v}" for k, v in env.items()), *argv],
                          capture_output=True, text=True, timeout=120)


def test_foreign_images_land_where_pyxis_puts_them_never_in_home() -> None:
    ensure_users()
    imgpipe = system_imgpipe(REPO)
    uid = pwd.getpwnam(USER).pw_uid
    work = shared_folder("imgpipe-foreign-")
    home = work / "home"  # root's, 0755: the user cannot write in it
    home.mkdir()
    tools = work / "bin"
    tools.mkdir()
    (tools / "enroot").write_text(ENROOT)
    (tools / "enroot").chmod(0o755)
    cache = work / "squashfs"
    config = work / "imgpipe.yaml"
    config.write_text(f"registry: {{host: head}}\noutputs: {{squashfs_dir: {cache}}}\n")
    config.chmod(0o644)
    subprocess.run([str(imgpipe / "imgpipe"), "--config", str(config), "node-config",
                    "--make-cache", str(cache)], check=True, capture_output=True)
    pyxis = work / "run-pyxis"  # /run/pyxis: root's; Pyxis makes the user's folder in it
    (pyxis / str(uid)).mkdir(parents=True)
    os.chown(pyxis / str(uid), uid, -1)
    (pyxis / str(uid)).chmod(0o700)
    base = {"HOME": str(home), "USER": USER, "PATH": f"{tools}:/usr/bin:/bin",
            "IMGPIPE_CONFIG": str(config), "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0"}
    importer = str(imgpipe / "imgpipe-pyxis-importer")

    for env, folder in (({**base, "PYXIS_RUNTIME_PATH": str(pyxis)}, pyxis / str(uid)),
                        (base, cache / ".imgpipe" / "tmp" / f"u{uid}")):
        got = _as_user([importer, "get", URI], env)
        assert got.returncode == 0, got.stderr
        path = Path(got.stdout.strip())
        assert path.parent == folder and path.read_bytes() == b"hsqs"
        assert path.stat().st_uid == uid and not (folder.stat().st_mode & 0o077)
        assert list(home.iterdir()) == []  # nothing in the home
        released = _as_user([importer, "release"], env)
        assert released.returncode == 0, released.stderr
        assert not path.exists()

    config.write_text("registry: {host: head}\n")  # no node cache, and outside Pyxis
    failed = _as_user([importer, "get", URI], base)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    [line] = failed.stderr.strip().splitlines()
    assert "$PYXIS_RUNTIME_PATH" in line and ".imgpipe/tmp/u" in line, line
    assert list(home.iterdir()) == []
