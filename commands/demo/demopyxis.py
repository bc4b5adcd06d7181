"""What the demo's Pyxis jobs need on this machine, as a site's admin sets it up: a regular
user to submit them, imgpipe's importer in a venv of the system Python that every user can
run (Pyxis runs it as the job's user; the checkout's .venv may come from a Python no other
user can execute), the squashfs folder shared as ``node-config --make-cache`` makes it, and
the importer's config naming the head's registry and that folder.

The sandbox's compute hosts then load Pyxis with that importer, and the head host serves the
local registry's images as head:5000, so every job is ``srun
--container-image=head:5000#imgpipe/bert@sha256:…``: the pushed digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
from pathlib import Path

from imgpipe.base import process

DEMO_USER = "imgpipe-demo"
SYSTEM_PYTHON = "/usr/bin/python3"


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def ensure_user(name: str = DEMO_USER) -> pwd.struct_passwd:
    """The sandbox's job user (every host shares /etc/passwd, as with LDAP)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        say(f"$ useradd --create-home {name}   # the user who submits the jobs")
        process.run(["useradd", "--create-home", "--shell", "/bin/bash", name], timeout=60,
                    what="useradd")
        return pwd.getpwnam(name)


def node_venv(source: Path, venv: Path) -> Path:
    """imgpipe installed from ``source`` into ``venv``, a venv of the system Python, as the
    admin guide installs it on nodes; its dependencies once per pyproject.toml, imgpipe
    itself on every run (a checkout's changes reach the importer).  Its ``bin`` folder."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        raise SystemExit(f"error: {SYSTEM_PYTHON} is missing: apt-get install python3-venv")
    digest = hashlib.sha256((source / "pyproject.toml").read_bytes()).hexdigest()[:16]
    stamp = venv / f".deps-{digest}"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    if not stamp.exists():
        say(f"$ {SYSTEM_PYTHON} -m venv {venv} && pip install imgpipe   # the importer "
            "every job user runs")
        shutil.rmtree(venv, ignore_errors=True)
        process.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], timeout=300, what="venv")
        process.run([*pip, str(source)], timeout=1800, what="pip install imgpipe")
        stamp.touch()
    else:
        process.run([*pip, "--no-deps", "--force-reinstall", str(source)], timeout=600,
                    what="pip install imgpipe")
    process.run(["chmod", "-R", "a+rX", str(venv)], timeout=120, what="chmod")
    return venv / "bin"


def node_config(work: Path, imgpipe: Path, squashfs: Path) -> Path:
    """The squashfs folder shared for every job user, and the importer's config: the head's
    registry (head:5000, plain http inside the sandbox) and that folder."""
    process.run([str(imgpipe), "node-config", "--make-cache", str(squashfs)], timeout=120,
                what="node-config --make-cache")
    config = work / "node-imgpipe.yaml"
    config.write_text(json.dumps({"registry": {"host": "head", "port": 5000},
                                  "outputs": {"squashfs_dir": str(squashfs)}}, indent=1) + "\n")
    os.chmod(config, 0o644)
    return config


def hand_over(user: pwd.struct_passwd, *folders: Path) -> None:
    """``folders`` (made if missing) belong to ``user``, as a user's own folders on a
    cluster file system; each parent up to the checkout stays traversable."""
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        process.run(["chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(folder)],
                    timeout=120, what="chown")


def readable(*paths: Path) -> None:
    """What jobs read (corpus, vocabulary, config, recipes) readable by every user."""
    for path in paths:
        if path.exists():
            process.run(["chmod", "-R", "a+rX", str(path)], timeout=120, what="chmod")
