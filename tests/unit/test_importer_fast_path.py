"""The Pyxis importer answers `get` for a converted digest on its fast path: the path Pyxis
mounts, from the standard library, yaml and imgpipe's light modules alone (a job's start
waits on it), with no program-starting, HTTP-client or config-model module loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from imgpipe.enroot.cache.storage import Storage

DIGEST = "sha256:" + "5d" * 32
HEAVY = ("imgpipe.base.process", "pydantic", "requests", "imgpipe.enroot.convert",
         "imgpipe.registry.client", "subprocess")


def test_a_converted_digest_is_answered_without_heavy_modules(tmp_path: Path) -> None:
    cache = Storage(tmp_path / "sqsh")
    cache.prepare()
    converted = cache.squashfs("imgpipe/bert", DIGEST, "zstd")
    converted.write_bytes(b"hsqs")  # found by name and owner; never opened here
    config = tmp_path / "imgpipe.yaml"
    config.write_text(f"registry: {{host: '127.0.0.1', port: 9}}\n"
                      f"outputs: {{squashfs_dir: {tmp_path / 'sqsh'}}}\n")
    probe = ("import sys\n"
             "from imgpipe.cli.importer import run\n"  # the console script's entry point
             f"sys.argv = ['imgpipe-pyxis-importer', 'get', "
             f"'docker://127.0.0.1:9#imgpipe/bert@{DIGEST}']\n"
             "try:\n    run()\nexcept SystemExit as exit:\n    code = exit.code\n"
             f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    env = {**os.environ, "IMGPIPE_CONFIG": str(config), "XDG_RUNTIME_DIR": str(tmp_path),
           "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}
    os.chmod(tmp_path, 0o700)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    path, verdict = done.stdout.strip().splitlines()
    assert path == str(converted)
    assert verdict == "0 []", verdict
