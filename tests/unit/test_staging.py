"""The recipes' stage_image (recipes.staging): rendered only where caches are node-local,
clean for shellcheck in every runtime, and the nodes' config keys that feed it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from imgpipe.base.config import EnrootConfig
from imgpipe.cli.importer import main as importer_main
from imgpipe.recipes.errors import RecipeError
from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle
from imgpipe.recipes.staging import stage_function

PINNED = "head:5000/imgpipe/bert@sha256:" + "a" * 64
SCRIPTS = ("run.sub", "dataset.sub", "nccl.sub")


def _bundle(tmp_path: Path, runtime: str, distribution: str) -> dict[str, str]:
    render_bundle(RecipeInputs(load_profile("dgx-h100"), 2, PINNED, runtime=runtime,  # type: ignore[arg-type]
                               distribution=distribution,  # type: ignore[arg-type]
                               importer_path="/opt/imgpipe/bin/imgpipe-pyxis-importer",
                               sbcast_fanout=4, sbcast_block="64M"), tmp_path)
    return {name: (tmp_path / name).read_text() for name in SCRIPTS}


@pytest.mark.parametrize("runtime", ["pyxis", "charliecloud"])
@pytest.mark.parametrize("distribution", ["fetch", "sbcast"])
def test_node_local_scripts_stage_the_image_before_any_step(tmp_path: Path, runtime: str,
                                                            distribution: str) -> None:
    scripts = _bundle(tmp_path, runtime, distribution)
    for name, text in scripts.items():
        lines = text.splitlines()
        assert lines.count("stage_image") == 1, name
        first_launch = next(i for i, line in enumerate(lines) if line.startswith("launch "))
        assert lines.index("stage_image") < first_launch, name
        assert "default_importer=/opt/imgpipe/bin/imgpipe-pyxis-importer" in text
        assert f"IMGPIPE_DISTRIBUTION:-{distribution}" in text
        assert '--fanout="${IMGPIPE_SBCAST_FANOUT:-4}"' in text
        assert "--size=\"${IMGPIPE_SBCAST_BLOCK:-64M}\"" in text
        assert ("CONT=$got" in text) == (runtime == "charliecloud"), name
    done = subprocess.run(["shellcheck", "--severity=style",
                           *(str(tmp_path / name) for name in SCRIPTS)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("runtime, distribution", [("pyxis", "shared"),
                                                   ("charliecloud", "shared"),
                                                   ("host", "sbcast")])
def test_a_shared_cache_or_the_host_runtime_stages_nothing(tmp_path: Path, runtime: str,
                                                          distribution: str) -> None:
    for text in _bundle(tmp_path, runtime, distribution).values():
        assert "stage_image" not in text and "sbcast" not in text


def test_an_unknown_distribution_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="distribution 'rsync' is not one of"):
        _bundle(tmp_path, "pyxis", "rsync")


@pytest.mark.parametrize("key, value", [("sbcast_block", "8 MB"), ("sbcast_block", "0"),
                                        ("importer_path", "imgpipe-pyxis-importer"),
                                        ("sbcast_fanout", 0), ("distribution", "nfs")])
def test_bad_fanout_settings_are_refused(key: str, value: object) -> None:
    with pytest.raises(ValidationError):
        EnrootConfig(**{key: value})


def test_the_importer_names_its_staging_forms_in_its_usage(capsys) -> None:
    assert importer_main(["take"]) == 2
    assert "stage URI | take URI [SHA256 STAGED MANIFEST]" in capsys.readouterr().err
    assert importer_main(["stage", "a", "b"]) == 2


def test_sbcast_copies_no_node_took_are_swept_after_a_day(tmp_path: Path) -> None:
    import os
    import time

    from imgpipe.enroot.cache.storage import Storage

    cache = Storage(tmp_path / "cache")
    cache.prepare()
    old = cache.tmp / f"sbcast.u{os.getuid()}.7.0123456789abcdef.sqsh"
    fresh = cache.tmp / f"sbcast.u{os.getuid()}.8.fedcba9876543210.sqsh"
    other = cache.tmp / "sbcast.u99999.7.0123456789abcdef.sqsh"  # not this user's name
    for path in (old, fresh, other):
        path.write_bytes(b"copy")
    day_ago = time.time() - 2 * 86400
    os.utime(old, (day_ago, day_ago))
    os.utime(other, (day_ago, day_ago))
    assert cache.sweep() == 1
    assert not old.exists() and fresh.exists() and other.exists()


@pytest.mark.parametrize("runtime", ["pyxis", "charliecloud"])
def test_broadcast_runs_one_mpi_step_and_falls_back_to_sbcast(tmp_path: Path,
                                                              runtime: str) -> None:
    """broadcast: one `srun --mpi=pmix` step of the importer's `broadcast` (no spinning
    waits, no memory patcher), sbcast's staging where there is no pin, no pmix or the step
    fails, and the nodes' `take` only when the broadcast did not run."""
    scripts = _bundle(tmp_path, runtime, "broadcast")
    for text in scripts.values():
        assert "--mpi=pmix" in text and '"$IMGPIPE_IMPORTER" broadcast "$uri"' in text
        assert "OMPI_MCA_mpi_yield_when_idle=1 \\\n                OMPI_MCA_memory='^patcher'" \
            in text
        assert '"$IMGPIPE_IMPORTER" ahead "$uri" "$ahead" &' in text
        for fallback in ("has no squashfs pin", "has no pmix plugin", "failed: staging with"):
            assert fallback in text
        assert 'if [ "$mode" != broadcast ]; then' in text
    done = subprocess.run(["shellcheck", "--severity=style",
                           *(str(tmp_path / name) for name in SCRIPTS)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_the_batch_hosts_fetch_starts_before_the_broadcast_step(tmp_path: Path) -> None:
    """The importer's ``ahead`` runs in the background from before the step: the step's
    tasks are told its folder (a fresh one of the user's alone), the function waits for it
    and removes the folder, whatever the step did."""
    calls = tmp_path / "calls"
    importer, srun = tmp_path / "importer", tmp_path / "srun"
    importer.write_text(f'#!/bin/sh\necho "importer $* $(stat -c %a "$3")" >>{calls}\n'
                        'sleep 1\necho "importer done" >>' f'{calls}\n')
    srun.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--mpi=list*) echo "MPI plugin types are... pmix"; exit 0 ;; esac\n'
        f'echo "srun $IMGPIPE_BROADCAST_AHEAD $(ls "$IMGPIPE_BROADCAST_AHEAD" | wc -l)"'
        f' >>{calls}\n'
        'echo "/var/tmp/entry.sqsh"\n')
    for program in (importer, srun):
        program.chmod(0o755)
    script = "\n".join([
        "set -euo pipefail", f"CONT={PINNED}",
        stage_function("charliecloud", "broadcast", str(importer), 2, "4M"),
        f'echo "after $CONT" >>{calls}'])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_NUM_NODES": "2",
                               "TMPDIR": str(tmp_path),
                               "IMGPIPE_SQUASHFS_PINS": f"{PINNED.rsplit('@', 1)[1]}=x"})
    assert done.returncode == 0, done.stderr
    said = calls.read_text().splitlines()
    folder = next(line.split()[1] for line in said if line.startswith("srun "))
    assert folder.startswith(f"{tmp_path}/imgpipe-ahead."), said
    assert f"importer ahead {PINNED} {folder} 700" in said
    assert said[-2:] == ["importer done", "after /var/tmp/entry.sqsh"], said
    assert not Path(folder).exists()


@pytest.mark.parametrize("fails", [1, 2])
def test_a_broadcast_step_that_fails_is_tried_once_more_then_sbcast(tmp_path: Path,
                                                                     fails: int) -> None:
    """The batch host's MPI start crashed now and then (inside MPI_Init): stage_image, run by
    bash with a Slurm whose broadcast step fails ``fails`` times, tries the step a second
    time, and stages with sbcast only when that fails too."""
    calls = tmp_path / "calls"
    srun = tmp_path / "srun"
    srun.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--mpi=list*) echo "MPI plugin types are... pmix"; exit 0 ;; esac\n'
        f'echo "$*" >>{calls}\n'
        f'[ "$(wc -l <{calls})" -gt {fails} ] || exit 1\n'
        'echo "/var/tmp/entry.sqsh"\n')
    srun.chmod(0o755)
    pin = "sha256:" + "b" * 64
    script = "\n".join([
        "set -euo pipefail", f"CONT={PINNED}",
        stage_function("charliecloud", "broadcast", "/bin/false", 2, "4M")])
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_NUM_NODES": "2",
                               "IMGPIPE_SQUASHFS_PINS": f"{PINNED.rsplit('@', 1)[1]}={pin}"})
    tries = [line for line in calls.read_text().splitlines() if " broadcast " in line]
    assert len(tries) == 2, calls.read_text()
    assert "failed: trying it once more" in done.stderr, done.stderr
    assert ("staging with sbcast" in done.stderr) == (fails == 2), done.stderr
