"""Which torch a cpu build takes, chosen by pip on the build host for each platform
(imgpipe.pipeline.hostpip, hostresolve and hostsite): the +cpu wheel where one is offered,
else the index's build of the same version with its CUDA wheels; every wheel pinned by file
and sha256; wheels the target's markers do not want left out, and one they want that pip
left out refused.

pip really runs here, against wheels made by the test (a folder, or a folder served over
HTTP by a server the test starts), with its configuration given as the build's pip_config
secret: nothing reaches an outside index.  What needs no pip run (the platform tags, the
requirements, the pins, the kept context) is tested in tests/unit/test_host_pip.py.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import shutil
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.platforms import Platform, host_platform
from imgpipe.pipeline.catalog import PythonPackages
from imgpipe.pipeline.context import context_files
from imgpipe.pipeline.hostpip import HostPip, local_wheels
from imgpipe.pipeline.hostsite import Site, choice_line, stage_site
from tests.wheels import make_wheel

AMD64, ARM64 = Platform.parse("linux/amd64"), Platform.parse("linux/arm64")
SPEC = PythonPackages(version="3.11", glibc="2.36", requirements=["torch==2.13.0"])


@pytest.fixture
def offered(tmp_path: Path) -> Path:
    """torch 2.13.0 as a +cpu wheel for x86_64 only and as the index's CUDA build for both,
    with what each needs; a helper that only an x86_64 host's markers ask for."""
    folder = tmp_path / "offered"
    folder.mkdir()
    make_wheel(folder, "torch", "2.13.0+cpu", "cp311-cp311-manylinux_2_28_x86_64",
               ("filelock",), {"torch/version.py": "cuda: Optional[str] = None\n"},
               {"torchrun": "torch:main"})
    for machine in ("x86_64", "aarch64"):
        make_wheel(folder, "torch", "2.13.0", f"cp311-cp311-manylinux_2_28_{machine}",
                   ("filelock", 'nvidia-cublas==13.1.1.3; platform_system == "Linux"',
                    'x86-helper; platform_machine == "x86_64"'),
                   {"torch/version.py": "cuda: Optional[str] = '13.0'\n",
                    "torch/lib.txt": "x" * 100_000}, {"torchrun": "torch:main"})
        # nccl's only aarch64 wheel is manylinux_2_18 (FACTS.md): every tag must be given
        make_wheel(folder, "nvidia-cublas", "13.1.1.3", f"py3-none-manylinux_2_18_{machine}",
                   files={"nvidia/cublas/lib.txt": "y" * 300_000})
    make_wheel(folder, "filelock", "3.0", "py3-none-any")
    make_wheel(folder, "x86-helper", "1.0", "py3-none-any")
    return folder


@pytest.fixture
def pip_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The pip configuration a build would be given (its pip_config secret): no index."""
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX",
                 "PIP_CONFIG_FILE", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nno-index = true\n")
    yield config


def host(config: Path, tmp_path: Path, wheels: Path | None, lines: list[str] | None = None
         ) -> HostPip:
    return HostPip({"pip_config": config}, wheels, tmp_path / "cache", 600,
                   (lines if lines is not None else []).append)


def stage(pip: HostPip, platform: Platform, tmp_path: Path, spec: PythonPackages = SPEC,
          wanted: list[str] | None = None):
    context = tmp_path / f"context-{platform.tag_suffix}"
    (context / ".python").mkdir(parents=True)
    work = tmp_path / f"work-{platform.tag_suffix}"
    work.mkdir()
    return stage_site(pip, spec, platform, wanted or list(spec.requirements), context, work)


def test_the_offered_cpu_wheel_is_taken_and_otherwise_the_index_build_of_that_version(
        offered: Path, pip_here: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    pip = host(pip_here, tmp_path, offered, lines)
    cpu = stage(pip, AMD64, tmp_path)
    torch = cpu.wheel("torch")
    assert torch is not None and torch.version == "2.13.0+cpu"
    assert torch.file == "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert torch.sha256 == hashlib.sha256((offered / torch.file).read_bytes()).hexdigest()
    assert {w.name for w in cpu.wheels} == {"torch", "filelock"}  # no CUDA wheel
    line = choice_line("bert/cpu", cpu, SPEC)
    assert line is not None and line.startswith("bert/cpu linux/amd64: torch 2.13.0+cpu: the "
                                                "offered cpu build, torch-2.13.0+cpu-")
    assert "CUDA" not in line

    cuda = stage(pip, ARM64, tmp_path)
    torch = cuda.wheel("torch")
    assert torch is not None and torch.version == "2.13.0"
    assert torch.file == "torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl"
    assert {w.name for w in cuda.wheels} == {"torch", "filelock", "nvidia-cublas"}
    assert cuda.wheel("nvidia-cublas").file.endswith("manylinux_2_18_aarch64.whl")
    # pip judged x86-helper's marker for this host; aarch64 does not want it
    if host_platform() != ARM64:
        assert cuda.left_out == ("x86-helper",)
    line = choice_line("bert/cpu", cuda, SPEC)
    assert line is not None and "torch 2.13.0: the index's CUDA 13.0 build (no +cpu wheel " \
        "offered for aarch64), torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl" in line
    assert "GB of it in 1 CUDA wheels (nvidia-*, cuda-*, triton)" in line
    cublas = cuda.wheel("nvidia-cublas")
    assert cublas is not None and cublas.installed > 300_000  # what it adds to the image

    # Unpacked as the prefix lays it out: scripts name its python3, modules are compiled
    # (checked by hash: times do not survive the way into an image)
    packages = cuda.packages
    assert packages == cuda.root / "packages" / "lib" / "python3.11" / "site-packages"
    assert (packages / "torch" / "version.py").is_file()
    assert (cuda.root / "packages" / "bin" / "torchrun").read_text().startswith(
        "#!/opt/venv/bin/python3\n")
    pyc = packages / "torch" / "__pycache__" / "__init__.cpython-311.pyc"
    assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01  # unchecked hash
    assert b"/opt/venv/lib/python3.11/site-packages/torch/__init__.py" in pyc.read_bytes()
    assert not list(packages.glob("*.dist-info/direct_url.json"))  # no host path inside


def test_a_wheel_the_target_needs_that_pip_left_out_is_refused(
        offered: Path, pip_here: Path, tmp_path: Path) -> None:
    other = ARM64 if host_platform() != ARM64 else AMD64
    make_wheel(offered, "needs-grace", "1.0", "py3-none-any",
               (f'grace-only; platform_machine == "{other.machine}"',))
    make_wheel(offered, "grace-only", "1.0", "py3-none-any")
    pip = host(pip_here, tmp_path, offered)
    with pytest.raises(ConfigError, match=rf"pip's resolution for {other} lacks grace-only, "
                       rf"which {other.machine} needs"):
        stage(pip, other, tmp_path, SPEC, ["needs-grace"])


def test_a_missing_wheel_is_one_line_naming_the_platform(offered: Path, pip_here: Path,
                                                          tmp_path: Path) -> None:
    pip = host(pip_here, tmp_path, offered)
    with pytest.raises(ImgpipeError) as failed:
        stage(pip, ARM64, tmp_path, SPEC, ["torch==9.9.9"])
    assert "pip's resolution for linux/arm64 failed: " in failed.value.message
    assert "torch==9.9.9" in failed.value.message
    assert "\n" not in failed.value.message
    assert "aarch64" in (failed.value.hint or "")


class _Counting(http.server.SimpleHTTPRequestHandler):
    fetched: list[str] = []

    def do_GET(self) -> None:
        if self.path.endswith(".whl"):
            type(self).fetched.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


def simple_index(wheels: Path, root: Path) -> Path:
    """A PEP 503 index of ``wheels`` that names each file's sha256 and serves its metadata
    beside it (PEP 658), as PyPI does: pip resolves from the metadata alone."""
    files = root / "files"
    files.mkdir(parents=True)
    projects: dict[str, list[str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        (files / wheel.name).write_bytes(wheel.read_bytes())
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            body = archive.read(meta)
        (files / f"{wheel.name}.metadata").write_bytes(body)
        meta_digest = hashlib.sha256(body).hexdigest()
        name = wheel.name.split("-")[0].replace("_", "-").lower()
        projects.setdefault(name, []).append(
            f'<a href="../../files/{wheel.name}#sha256={digest}" '
            f'data-dist-info-metadata="sha256={meta_digest}">{wheel.name}</a>')
    for name, links in projects.items():
        page = root / "simple" / name
        page.mkdir(parents=True)
        (page / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    return root


def test_wheels_from_an_index_are_fetched_once_into_the_cache(
        offered: Path, pip_here: Path, tmp_path: Path) -> None:
    """An index over HTTP (a server this test starts, serving metadata as PyPI does): the
    first build resolves from metadata and fetches each wheel once, into the cache under
    its sha256; the next resolves again and takes every wheel from the cache."""
    root = simple_index(offered, tmp_path / "index")
    handler = functools.partial(_Counting, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pip_here.write_text(f"[global]\nindex-url = http://127.0.0.1:{server.server_port}"
                            "/simple/\n")
        pip = host(pip_here, tmp_path, None)
        first = stage(pip, ARM64, tmp_path)
        assert sorted(_Counting.fetched) == sorted(f"/files/{w.file}" for w in first.wheels)
        assert len(first.wheels) == 3
        for wheel in first.wheels:
            assert (tmp_path / "cache" / wheel.sha256 / wheel.file).is_file()
        _Counting.fetched.clear()
        (tmp_path / "context-arm64").rename(tmp_path / "first")
        (tmp_path / "work-arm64").rename(tmp_path / "first-work")
        again = stage(pip, ARM64, tmp_path)
        assert _Counting.fetched == []
        assert again.pins == first.pins
    finally:
        server.shutdown()


def test_a_project_of_the_image_becomes_one_pure_wheel_built_once_per_content(
        pip_here: Path, tmp_path: Path) -> None:
    context = tmp_path / "context"
    project = context / "app"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("X = 1\n")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = '
        '"setuptools.build_meta"\n[project]\nname = "app"\nversion = "1.0"\n')
    pip = host(pip_here, tmp_path, None)
    [built] = local_wheels(pip, ["./app"], context, context_files(context))
    assert built.endswith("app-1.0-py3-none-any.whl")
    again = local_wheels(pip, ["./app", "numpy"], context, context_files(context))
    assert again == [built, "numpy"]  # the same content: the same wheel, not rebuilt
    (project / "app" / "__init__.py").write_text("X = 2\n")
    [changed] = local_wheels(pip, ["./app"], context, context_files(context))
    assert changed != built
    with pytest.raises(ConfigError, match=r"\.\./elsewhere is not a folder of the image"):
        local_wheels(pip, ["./../elsewhere"], context, context_files(context))


def test_a_second_build_from_the_same_wheels_keeps_packages_and_redoes_projects(
        offered: Path, pip_here: Path, tmp_path: Path) -> None:
    """The context of a flavor with python: is kept between builds: packages/ (torch and the
    rest) stays as the last build left it while the same wheels would make it; the image's
    own projects are unpacked again (their wheels change with their code)."""
    project = tmp_path / "image" / "app"
    (project / "app").mkdir(parents=True)
    (project / "app" / "__init__.py").write_text("X = 1\n")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = '
        '"setuptools.build_meta"\n[project]\nname = "app"\nversion = "1.0"\n'
        'dependencies = ["torch==2.13.0"]\n')
    pip = host(pip_here, tmp_path, offered)
    context = tmp_path / "kept"
    (context / ".python").mkdir(parents=True)
    shutil.copytree(project, context / "app")
    work = tmp_path / "work"
    work.mkdir()

    def build() -> Site:
        wanted = local_wheels(pip, ["./app"], context, context_files(context))
        return stage_site(pip, SPEC, AMD64, wanted, context, work)

    first = build()
    torch_file = first.packages / "torch" / "__init__.py"
    assert not first.reused and torch_file.is_file()
    assert (context / ".python" / "projects" / "lib" / "python3.11" / "site-packages" / "app"
            / "__init__.py").read_text() == "X = 1\n"
    made = torch_file.stat().st_mtime_ns
    (context / "app" / "app" / "__init__.py").write_text("X = 2\n")
    again = build()
    assert again.reused and torch_file.stat().st_mtime_ns == made
    assert (context / ".python" / "projects" / "lib" / "python3.11" / "site-packages" / "app"
            / "__init__.py").read_text() == "X = 2\n"
    assert again.wheel("app").sha256 != first.wheel("app").sha256
    offered_cpu = next(offered.glob("torch-2.13.0+cpu-*.whl"))
    offered_cpu.rename(tmp_path / offered_cpu.name)  # no +cpu wheel now: another torch
    other = build()
    assert not other.reused and other.wheel("torch").version == "2.13.0"
