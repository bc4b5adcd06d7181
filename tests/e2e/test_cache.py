"""The shared squashfs cache against a hostile neighbour: planted links, and cached blobs
changed after they were fetched.  A real registry, real files, the CLI in-process.

What the cache promises: nothing outside it is ever written or followed, and a published
squashfs holds exactly the layers of the digest in its name (sha256-equal to a conversion
from untouched blobs), whatever was done to the cache in between.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests import services
from tests.conftest import CliRun


def _layer(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buffer.getvalue(), mtime=0)


LOWER = _layer({f"lib/file{i}": os.urandom(2000) for i in range(200)})
UPPER = _layer({"etc/hostname": b"upper\n", "bin/tool": b"#!/bin/sh\necho hi\n"})
OTHER = _layer({"etc/hostname": b"swapped in\n"})


@pytest.fixture(scope="module")
def image(registry_server) -> str:
    services.push_image(services.plain_session(), registry_server.url, "cache/victim", "1",
                        [LOWER, UPPER])
    return f"{registry_server.address}/cache/victim:1"


def _cli(tmp_path: Path, capsys, registry_server, name: str) -> CliRun:
    folder = tmp_path / name
    folder.mkdir()
    cli = CliRun(folder, capsys)
    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(folder / "sqsh")}})
    return cli


def _convert(cli: CliRun, ref: str) -> tuple[Path, str]:
    """Converted as a user runs it (progress on stderr); the published file and stderr."""
    code, out, err = cli("convert", ref)
    assert code == 0, err
    assert "Traceback" not in err
    [published] = (cli.folder / "sqsh").glob("*.sqsh")
    return published, out + err


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def untouched(image, tmp_path_factory, registry_server) -> str:
    """sha256 of the squashfs made from blobs nobody touched."""
    folder = tmp_path_factory.mktemp("untouched")

    class Quiet:
        def readouterr(self) -> tuple[str, str]:
            return "", ""

    cli = CliRun(folder, Quiet())  # type: ignore[arg-type]
    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(folder / "sqsh")}})
    from imgpipe.cli.main import main

    old = Path.cwd()
    os.chdir(folder)
    try:
        assert main(["convert", image]) == 0
    finally:
        os.chdir(old)
    [published] = (folder / "sqsh").glob("*.sqsh")
    return _sha(published)


def _spoil_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def _spoil_swap(path: Path) -> None:
    path.write_bytes(OTHER)  # a valid layer, just not this one


def _spoil_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.parametrize("spoil", [_spoil_flip, _spoil_swap, _spoil_truncate],
                         ids=["flipped", "swapped", "truncated"])
@pytest.mark.parametrize("which", [LOWER, UPPER], ids=["lower", "upper"])
def test_a_spoiled_cached_blob_is_evicted_fetched_again_and_never_published(
        image, untouched, tmp_path, capsys, registry_server, spoil, which) -> None:
    cli = _cli(tmp_path, capsys, registry_server, "spoiled")
    first, _ = _convert(cli, image)
    first.unlink()  # so the next convert works from the cached blobs
    blob = cli.folder / "sqsh/.imgpipe/blobs/sha256" / services.digest_of(which).split(":")[1]
    spoil(blob)
    again, err = _convert(cli, image)
    assert "did not match its digest: evicted and fetched again" in err
    assert _sha(again) == untouched
    assert blob.read_bytes() == which  # the cache holds the right bytes again


def test_planted_links_are_never_followed(image, untouched, tmp_path, capsys,
                                          registry_server) -> None:
    """Links at every name the old scheme made predictable (.tmp-<name>.<host>.<pid>) for a
    range of pids, and at the blob's own cache entry: the victim is never written, the cache
    entry ends a regular file."""
    cli = _cli(tmp_path, capsys, registry_server, "planted")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    blobs = cli.folder / "sqsh/.imgpipe/blobs/sha256"
    blobs.mkdir(parents=True)
    host = socket.gethostname()
    names = [services.digest_of(b).split(":")[1] for b in (LOWER, UPPER)]
    for name in names:
        for pid in range(max(2, os.getpid() - 200), os.getpid() + 200):
            (blobs / f".tmp-{name}.{host}.{pid}").symlink_to(victim)
    (blobs / names[0]).symlink_to(victim)  # the cache entry itself
    published, _ = _convert(cli, image)
    assert victim.read_text() == "precious\n"
    assert not (blobs / names[0]).is_symlink()
    assert _sha(published) == untouched


def test_a_cache_folder_others_can_swap_files_in_is_refused(image, tmp_path, capsys,
                                                            registry_server) -> None:
    cli = _cli(tmp_path, capsys, registry_server, "unsafe")
    (cli.folder / "sqsh").mkdir()
    os.chmod(cli.folder / "sqsh", 0o777)  # world-writable, no sticky bit
    code, _, err = cli("convert", image)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"error: cache folder {cli.folder / 'sqsh'} is writable by other users without the "
        f"sticky bit (mode 0777): they could swap its files (hint: chmod 1777 "
        f"{cli.folder / 'sqsh'})")
    assert not list((cli.folder / "sqsh").iterdir())


@pytest.mark.parametrize("other", ["127.0.0.1:5099/cache/victim:1",
                                   "nohost.invalid:443/cache/victim:1",
                                   "nvcr.io/imgpipe/bert:latest-cpu"])
def test_a_reference_to_another_registry_is_refused(image, tmp_path, capsys, registry_server,
                                                    other: str) -> None:
    cli = _cli(tmp_path, capsys, registry_server, "other")
    code, _, err = cli("convert", other)
    assert code == 1
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"but imgpipe is configured for {registry_server.address}" in line
    assert not list(cli.folder.rglob("*.sqsh"))


def _compression_of(path: Path) -> str:
    shown = subprocess.run(["unsquashfs", "-s", str(path)], capture_output=True, text=True,
                           check=True).stdout
    return next(line.split()[-1] for line in shown.splitlines()
                if line.startswith("Compression "))


def test_each_compression_is_its_own_cache_entry(image, tmp_path, capsys,
                                                 registry_server) -> None:
    cli = _cli(tmp_path, capsys, registry_server, "compressions")
    made = {}
    for asked, tool_name in (("lz4", "lz4"), ("zstd", "zstd"), ("lzo-enroot", "lzo")):
        code, out, err = cli("convert", image, "--compression", asked, "--json")
        assert code == 0, err
        data = json.loads(out)["data"]
        path = Path(data["squashfs"])
        assert data["compression"] == asked and f"+{asked}-f" in path.name
        assert _compression_of(path) == tool_name
        made[asked] = path
    assert len(set(made.values())) == 3
    code, out, _ = cli("convert", image, "--compression", "lz4", "--json")
    assert code == 0
    again = json.loads(out)["data"]
    assert again["converted"] is False and Path(again["squashfs"]) == made["lz4"]


def _server(handler_body) -> tuple[object, int]:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        do_GET = do_HEAD = handler_body  # noqa: N815 (http.server's naming)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_a_stalled_registry_is_given_up_on_within_the_read_timeout(tmp_path, capsys) -> None:
    import time

    def stall(self) -> None:
        time.sleep(30)

    server, port = _server(stall)
    try:
        cli = CliRun(tmp_path, capsys)
        cli.write_config({"registry": {"port": port, "read_timeout_s": 2},
                          "outputs": {"squashfs_dir": str(tmp_path / "sqsh")}})
        started = time.monotonic()
        code, _, err = cli("convert", f"127.0.0.1:{port}/some/image:1")
        took = time.monotonic() - started
    finally:
        server.shutdown()  # type: ignore[attr-defined]
    assert code == 1 and "did not answer in time" in err
    assert took < 10, took  # one read timeout, not one per retry


def test_a_server_that_is_not_a_registry_is_named_as_such(tmp_path, capsys) -> None:
    def not_found(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(b"<html>Not Found</html>")

    server, port = _server(not_found)
    try:
        cli = CliRun(tmp_path, capsys)
        cli.write_config({"registry": {"port": port},
                          "outputs": {"squashfs_dir": str(tmp_path / "sqsh")}})
        code, _, err = cli("convert", f"127.0.0.1:{port}/some/image:1")
    finally:
        server.shutdown()  # type: ignore[attr-defined]
    assert code == 1
    assert "from a server that is not a Docker registry (text/html" in err
    assert "is not in the registry" not in err


@pytest.fixture(scope="module")
def big_image(base_image, registry_server) -> str:
    """The debootstrap base (one 220 MB layer): long enough to stop at each stage."""
    target = f"{registry_server.address}/cache/base:1"
    for argv in (["tag", base_image, target], ["push", target]):
        subprocess.run([services.DOCKER, *argv], check=True, capture_output=True, timeout=600)
    return target


def _children_of(folder: Path) -> list[str]:
    """Squash tools still running on files under ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and Path(argv[0].decode(errors="replace")).name in (
                "tar2sqfs", "mksquashfs") and str(folder).encode() in b" ".join(argv):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def _leftovers(folder: Path) -> list[str]:
    sqsh = folder / "sqsh"
    found = [str(p) for p in [*sqsh.glob(".tmp-*"), *sqsh.glob(".imgpipe/blobs/sha256/.tmp-*"),
                              *sqsh.glob(".imgpipe/tmp/*")]]
    found += [str(p) for p in Path("/dev/shm").glob(f"imgpipe-*~{socket.gethostname()}~*")]
    return found


def _stop_at(folder: Path, ref: str, stage: str, sig: int) -> tuple[int, str]:
    """`imgpipe convert` as a process, stopped by ``sig`` when it reports ``stage``."""
    import signal
    import sys
    import time

    imgpipe = Path(sys.executable).parent / "imgpipe"
    proc = subprocess.Popen([str(imgpipe), "convert", ref, "--compression", "lz4"], cwd=folder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if f" {stage} " in line:
            if stage == "squash":
                time.sleep(0.5)  # mksquashfs is running by now
            proc.send_signal(sig)
            break
    rest = proc.stdout.read()
    code = proc.wait(30)
    assert signal.Signals(sig).name in ("SIGKILL", "SIGTERM")
    return code, "".join(seen) + rest


@pytest.mark.parametrize("stage", ["fetch", "merge", "squash"])
def test_kill_9_leaves_nothing_the_next_run_keeps_and_no_child(big_image, tmp_path, capsys,
                                                               registry_server,
                                                               stage: str) -> None:
    import signal
    import time

    cli = _cli(tmp_path, capsys, registry_server, f"killed-{stage}")
    code, output = _stop_at(cli.folder, big_image, stage, signal.SIGKILL)
    assert code == -signal.SIGKILL, output
    time.sleep(1)
    assert _children_of(cli.folder) == []  # they died with imgpipe
    code, out, err = cli("convert", big_image, "--compression", "lz4")
    assert code == 0, err
    assert _leftovers(cli.folder) == []
    assert len(list((cli.folder / "sqsh").glob("*.sqsh"))) == 1


def test_sigterm_cleans_up_and_says_so(big_image, tmp_path, capsys, registry_server) -> None:
    import signal

    cli = _cli(tmp_path, capsys, registry_server, "terminated")
    code, output = _stop_at(cli.folder, big_image, "squash", signal.SIGTERM)
    assert code == 143, output
    assert output.strip().splitlines()[-1] == (
        "imgpipe: stopped by SIGTERM; temporary files removed")
    assert "Traceback" not in output
    assert _leftovers(cli.folder) == [] and _children_of(cli.folder) == []
    assert not list((cli.folder / "sqsh").glob("*.sqsh"))


@pytest.fixture
def small_disk(tmp_path):
    """A file system of its own for the squashfs folder, sized by the test."""
    mounted: list[Path] = []

    def make(megabytes: int) -> Path:
        folder = tmp_path / f"disk{megabytes}"
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}M", "tmpfs",
                        str(folder)], check=True)
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.parametrize("megabytes", [8, 200], ids=["before-fetch", "while-squashing"])
def test_a_full_disk_is_one_line_with_nothing_left(big_image, tmp_path, capsys,
                                                   registry_server, small_disk,
                                                   megabytes: int) -> None:
    disk = small_disk(megabytes)
    cli = CliRun(tmp_path, capsys)
    cli.write_config({"registry": {"port": registry_server.port},
                      "outputs": {"squashfs_dir": str(disk / "sqsh")}})
    code, _, err = cli("convert", big_image, "--compression", "none")
    assert code == 1, err
    assert err.count("error:") == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: not enough space in {disk / 'sqsh'}: the conversion needs "
                           "about "), line
    assert " MiB free" in line and "Traceback" not in err
    assert not list((disk / "sqsh").glob("*.sqsh")) and not list((disk / "sqsh").glob(".tmp-*"))
    assert not list((disk / "sqsh").glob(".imgpipe/blobs/sha256/.tmp-*"))


def test_prune_keeps_what_a_job_uses_and_what_is_locked(image, tmp_path, capsys,
                                                        registry_server, monkeypatch) -> None:
    import sys

    from imgpipe.cli import importer

    services.push_image(services.plain_session(), registry_server.url, "cache/other", "1",
                        [OTHER])
    cli = _cli(tmp_path, capsys, registry_server, "prune")
    monkeypatch.setenv("IMGPIPE_CONFIG", str(cli.folder / "imgpipe.yaml"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert importer.main(["get", f"docker://{image.replace('/', '#', 1)}"]) == 0
    held = Path(capsys.readouterr().out.strip())
    code, _, err = cli("convert", f"{registry_server.address}/cache/other:1")
    assert code == 0, err
    code, out, _ = cli("cache", "ls", "--json")
    listed = {Path(e["path"]).name: e for e in json.loads(out)["data"]["entries"]}
    assert listed[held.name]["users"] == [f"{socket.gethostname()}~{os.getuid()}~7~0"]
    assert len([e for e in listed.values() if e["kind"] == "squashfs"]) == 2

    code, out, err = cli("cache", "prune", "--max-size", "0", "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["kept_in_use"] == [str(held)]
    assert held.exists() and len(list((cli.folder / "sqsh").glob("*.sqsh"))) == 1
    assert not list((cli.folder / "sqsh/.imgpipe/blobs/sha256").iterdir())

    for _ in range(2):  # Pyxis calls release twice
        assert importer.main(["release"]) == 0
    digest = "sha256:" + held.name.split("+sha256-")[1].split("+")[0]
    holder = subprocess.Popen(  # a conversion of it running in another process
        [sys.executable, "-c", "import sys, time\n"
         "from pathlib import Path\n"
         "from imgpipe.enroot.cache.storage import Storage\n"
         "with Storage(Path(sys.argv[1])).lock(sys.argv[2]):\n"
         "    print('held', flush=True); time.sleep(60)\n",
         str(cli.folder / "sqsh"), digest], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, out, _ = cli("cache", "prune", "--max-size", "0", "--json")
        assert json.loads(out)["data"]["kept_in_use"] == [str(held)] and held.exists()
    finally:
        holder.kill()
        holder.wait()
    code, out, _ = cli("cache", "prune", "--max-size", "0", "--json")
    assert json.loads(out)["data"]["removed"] == [str(held)] and not held.exists()


def test_prune_by_age_and_bad_input(image, tmp_path, capsys, registry_server) -> None:
    cli = _cli(tmp_path, capsys, registry_server, "age")
    published, _ = _convert(cli, image)
    code, out, _ = cli("cache", "prune", "--unused-for", "1", "--json")
    assert code == 0 and json.loads(out)["data"]["removed"] == []  # used just now
    old = 1_000_000_000
    for path in [published, *(cli.folder / "sqsh").rglob("*")]:
        os.utime(path, (old, old), follow_symlinks=False)
    code, out, _ = cli("cache", "prune", "--unused-for", "1", "--dry-run", "--json")
    assert str(published) in json.loads(out)["data"]["removed"] and published.exists()
    code, _, err = cli("cache", "prune", "--max-size", "lots")
    assert code == 2 and "is not a size such as 500G" in err
    code, _, err = cli("cache", "prune")
    assert code == 2 and "--max-size SIZE or --unused-for DAYS" in err


def test_any_command_on_a_full_disk_is_one_line(tmp_path, capsys, small_disk) -> None:
    """Not only convert: a full disk under any command's output is one line, no traceback,
    nothing half-written (here: rendering recipes where 8 KiB are left)."""
    disk = small_disk(1)
    with open(disk / "filler", "wb") as handle:  # fill it up to its last 8 KiB
        handle.write(b"\0" * (shutil.disk_usage(disk).free - 8192))
    cli = CliRun(tmp_path, capsys)
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "1", "--image",
                       "head:5000/imgpipe/bert@sha256:" + "ab" * 32, "-o", str(disk / "out"))
    assert code == 1, err
    assert err.strip().splitlines()[-1].startswith(f"error: no space left in {disk / 'out'} (")
    assert "Traceback" not in err
    assert not [p for p in (disk / "out").iterdir() if p.name.startswith(".tmp-")]
