"""`pip wheel .` builds a wheel that holds every module of the tree under imgpipe/ and
nothing else: no top-level name beside imgpipe reaches site-packages."""

from __future__ import annotations

from tests.unit.test_exported_members import ROOT, source_modules


def test_the_wheel_installs_only_imgpipe(tmp_path) -> None:
    """`pip install .` must put nothing but imgpipe/ (and its dist-info) in site-packages."""
    import shutil
    import subprocess
    import sys
    import zipfile

    # From a copy of the tree without build/: setuptools would reuse a stale build/lib there,
    # which holds whatever an earlier build shipped.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "build", ".venv", ".git", "__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(source)], check=True,
                   capture_output=True, timeout=300)  # this venv's setuptools: no download
    [wheel] = tmp_path.glob("imgpipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"imgpipe"}
    # Every module of the tree ships, sub-packages included (pyproject.toml lists packages by
    # name: one left out there would be missing here), and nothing else does.
    shipped = {name for name in names if name.endswith(".py")}
    expected = {"imgpipe/" + str(path.relative_to(ROOT)) for path, _ in source_modules()}
    assert sorted(expected - shipped) == [], "pyproject.toml's packages: add these"
    assert sorted(shipped - expected) == []
    assert "imgpipe/__init__.py" not in names  # a namespace: no folder of its own
