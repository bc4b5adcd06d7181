"""With `importer=` in plugstack.conf Pyxis sends every image to imgpipe's importer: another
registry's image (nvcr.io, Docker Hub) is imported as Pyxis does without one, by `enroot
import` with the job's own Enroot settings, into the folder Pyxis itself imports into
($PYXIS_RUNTIME_PATH/UID), and release removes the file.  Enroot is not packaged here: a
stand-in records how it was called (the real one was checked by hand).  As a job user with an
unwritable home: tests/e2e/test_foreign_import.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENROOT = """#!/bin/sh
echo "$@" > "$RECORD"
echo "config=$ENROOT_CONFIG_PATH" >> "$RECORD"
[ "$1 $2" = "import --output" ] || exit 2
[ -e "$3" ] && { echo "enroot: $3 exists" >&2; exit 1; }
printf hsqs > "$3"
"""


def _importer(tmp_path: Path, *args: str, config_text: str | None = None
              ) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "imgpipe.yaml"
    if config_text is None:
        config.write_text("registry: {host: head, port: 5000}\n")
    elif config.exists():
        config.unlink()
    if config_text:
        config.write_text(config_text)
    (tmp_path / "bin").mkdir(exist_ok=True)
    enroot = tmp_path / "bin" / "enroot"
    if not enroot.exists():
        enroot.write_text(ENROOT)
        enroot.chmod(0o755)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    pyxis = tmp_path / "run-pyxis"
    (pyxis / str(os.getuid())).mkdir(mode=0o700, parents=True, exist_ok=True)
    env = {**os.environ, "IMGPIPE_CONFIG": str(config), "XDG_RUNTIME_DIR": str(runtime),
           "PYXIS_RUNTIME_PATH": str(pyxis),
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "RECORD": str(tmp_path / "rec"),
           "ENROOT_CONFIG_PATH": "/home/alice/.config/enroot", "SLURM_JOB_ID": "7",
           "SLURM_STEP_ID": "0"}
    script = Path(sys.executable).parent / "imgpipe-pyxis-importer"
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_another_registrys_image_is_imported_by_enroot_and_released(tmp_path: Path) -> None:
    for uri in ("docker://nvcr.io#nvidia/pytorch:25.01-py3", "docker://ubuntu:22.04"):
        done = _importer(tmp_path, "get", uri)
        assert done.returncode == 0, done.stderr
        path = Path(done.stdout.strip())
        assert path.parent == tmp_path / "run-pyxis" / str(os.getuid())  # where Pyxis would
        assert path.read_bytes() == b"hsqs"
        called = (tmp_path / "rec").read_text().splitlines()
        assert called == [f"import --output {path} {uri}",
                          "config=/home/alice/.config/enroot"]  # the job's own settings
        assert _importer(tmp_path, "release").returncode == 0
        assert not path.exists()


def test_a_failed_enroot_import_is_one_line(tmp_path: Path) -> None:
    done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch")
    assert Path(done.stdout.strip()).exists()  # not released: a retry of the step replaces it
    again = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch")
    assert again.returncode == 0, again.stderr
    (tmp_path / "bin" / "enroot").write_text("#!/bin/sh\necho 'enroot: [ERROR] URL "
                                            "https://nvcr.io returned error code: 401' >&2\n"
                                            "exit 1\n")
    failed = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/private")
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert failed.stderr.count("\n") == 1 and "returned error code: 401" in failed.stderr


def test_only_imgpipes_registry_is_imgpipes() -> None:
    from imgpipe.commands.node.importer import DOCKER_HUB
    from imgpipe.registry.reference import Reference

    assert Reference.parse("docker://ubuntu", default_registry=DOCKER_HUB).registry == \
        DOCKER_HUB


def test_local_engines_and_a_config_that_cannot_be_read_go_to_enroot(tmp_path: Path) -> None:
    """Before, dockerd:// and podman:// went down imgpipe's own path and failed, and a missing
    or broken /etc/imgpipe/imgpipe.yaml failed every user's nvcr.io jobs on the node."""
    done = _importer(tmp_path, "get", "dockerd://ubuntu:22.04")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rec").read_text().splitlines()[0].endswith(" dockerd://ubuntu:22.04")
    for text in ("", "registry: [not, a, mapping\n"):
        done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch:25.01-py3",
                         config_text=text)
        assert done.returncode == 0, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("imgpipe: cannot use ") and "imported by enroot" in line
        assert Path(done.stdout.strip()).read_bytes() == b"hsqs"


def test_a_users_pythonpath_cannot_break_the_importer(tmp_path: Path) -> None:
    """Pyxis runs the importer with the job's environment: before, a yaml.py on the user's
    PYTHONPATH made every container job of that user die with a traceback, nvcr.io's too."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    for name in ("yaml", "requests", "pydantic"):
        (shadow / f"{name}.py").write_text("raise RuntimeError('the user shadowed me')\n")
    os.environ["PYTHONPATH"] = str(shadow)
    try:
        done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch:25.01-py3")
    finally:
        del os.environ["PYTHONPATH"]
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert Path(done.stdout.strip()).read_bytes() == b"hsqs"


def test_under_pyxis_the_squashfs_cache_is_not_touched(tmp_path: Path) -> None:
    """Another registry's image imported into Pyxis's folder asks nothing of the node's
    squashfs cache (on Lustre, a stalled mount must not hold nvcr.io jobs up): before, a
    private folder of the user's was made there on every step."""
    tmp = tmp_path / "build" / "squashfs" / ".imgpipe" / "tmp"
    tmp.mkdir(parents=True)
    tmp.chmod(0o1777)
    done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch:25.01-py3")
    assert done.returncode == 0, done.stderr
    assert list(tmp.iterdir()) == []
    assert _importer(tmp_path, "release").returncode == 0


def test_a_mirrored_registrys_image_comes_from_the_site_registry(tmp_path: Path) -> None:
    """registry.mirrors maps nvcr.io onto the site registry: the job's nvcr.io reference is
    the site's image (Enroot is not asked), by the same tag or digest."""
    for config_text, site in (  # the same names: tests/e2e/test_pyxis.py, on a sandbox
            ("registry: {host: head, port: 5000, mirrors: {nvcr.io: ngc}}\n",
             "head:5000/ngc/nvidia/pytorch:25.01-py3"),):
        (tmp_path / "rec").unlink(missing_ok=True)
        done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch:25.01-py3",
                         config_text=config_text)
        assert not (tmp_path / "rec").exists()  # enroot was not run
        assert f"the site registry's mirror, {site}" in done.stderr, done.stderr
        # nothing listens on head:5000 here: the site registry's own one-line error
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("imgpipe: error:")


def test_an_unmirrored_image_that_enroot_cannot_fetch_names_the_mirror_command(
        tmp_path: Path) -> None:
    _importer(tmp_path, "get", "docker://ubuntu:22.04")  # the stand-in, in place
    (tmp_path / "bin" / "enroot").write_text(
        '#!/bin/sh\necho "[ERROR] URL https://nvcr.io/v2/ returned error code: 6 '
        'Could not resolve host: nvcr.io" >&2\nexit 1\n')
    done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch:25.01-py3")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "Could not resolve host: nvcr.io" in line, line
    assert "imgpipe mirror nvcr.io/nvidia/pytorch:25.01-py3" in line, line
    assert 'registry.mirrors: {nvcr.io: ""}' in line, line


def test_a_mapped_image_the_mirror_lacks_names_the_mirror_command(tmp_path: Path) -> None:
    done = _importer(tmp_path, "get", "docker://nvcr.io#nvidia/pytorch:99.99-py3",
                     config_text="registry: {host: 127.0.0.1, port: 9, mirrors: {nvcr.io: ''}}\n")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "is taken from the site registry's mirror" in line, line
    assert "imgpipe mirror nvcr.io/nvidia/pytorch:99.99-py3" in line, line
