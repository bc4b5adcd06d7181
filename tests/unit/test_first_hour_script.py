"""docs/first-hour.sh's own choices, read from the script as an admin runs it (the whole
script runs on the sandbox cluster in tests/e2e/test_first_hour.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from imgpipe.recipes.profiles import load_profile

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "first-hour.sh"


def _defaults(*names: str) -> list[str]:
    """The values the script's answers block gives ``names`` when nothing is set."""
    block = SCRIPT.read_text().split("say() {", 1)[0]
    shown = "; ".join(f'printf "%s\\n" "${name}"' for name in names)
    done = subprocess.run(["bash", "-c", f"{block}\n{shown}"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=30, check=True)
    return done.stdout.splitlines()


def test_the_default_node_shape_keeps_every_rail_of_the_shipped_profile() -> None:
    """The old default (--hcas mlx5_0..3) cut a DGX H100's eight rails to four: NCCL then
    left half the fabric idle in every job the recipes rendered."""
    profile_from, shape = _defaults("PROFILE_FROM", "NODE_SHAPE")
    rails = load_profile(profile_from).hcas
    words = shape.split()
    if "--hcas" in words:
        assert len(words[words.index("--hcas") + 1].split(",")) == len(rails), shape


def test_jobs_start_in_a_folder_the_compute_nodes_see(tmp_path: Path) -> None:
    """sbatch --chdir must exist on the nodes: the login node's /tmp does not (the sandbox
    shares /tmp between its hosts, so only the script's own choice can show it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("imgpipe", "sbatch"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\necho 1\n')
        (bin_dir / tool).chmod(0o755)
    # the user's part runs through runuser: here a stand-in that runs it as is
    (bin_dir / "runuser").write_text('#!/bin/sh\nwhile [ "$1" != -- ]; do shift; done\n'
                                     'shift\nexec "$@"\n')
    (bin_dir / "runuser").chmod(0o755)
    data = tmp_path / "lustre-bert"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "IMGPIPE": "imgpipe", "DATA": str(data),
           "IMAGES": "", "TMPDIR": str(tmp_path), "NODE_ROOT": str(tmp_path / "node"),
           "CHECKOUT": str(tmp_path), "AS_USER": "alice"}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr
    [sbatch] = [line for line in calls.read_text().splitlines() if line.startswith("sbatch")]
    chdir = sbatch.split("--chdir ", 1)[1].split()[0]
    assert chdir.startswith(f"{data}/"), sbatch


def test_the_first_jobs_are_never_roots(tmp_path: Path) -> None:
    """Enroot refuses a job run as root: step 4 as root with no AS_USER stops in one line
    instead of submitting one (and a single step can be run alone: STEPS)."""
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "STEPS": "4", "AS_USER": "",
                               "DATA": str(tmp_path), "CHECKOUT": str(tmp_path)})
    assert done.returncode == 2 and "set AS_USER" in done.stderr  # the suite runs as root
    assert "1. the site's config" not in done.stdout  # STEPS=4 ran step 4 alone
