"""`./setup.sh peers`: Enroot 4.1.2 and Pyxis 0.24.0 from their release sources, as a machine
without ../shared/peers/ gets them: from the tags' tarballs (here served by a local HTTP
server standing in for GitHub), each checked against its sha256 before it is built, into a
staging root (PEERS_DESTDIR) so the machine's own installs are untouched.  A tarball that
does not match is refused in one line and leaves nothing; no source at all is one line that
says what to put where."""

from __future__ import annotations

import functools
import hashlib
import http.server
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT.parent / "shared" / "peers"
ENROOT_PATH = "enroot/archive/refs/tags/v4.1.2.tar.gz"
PYXIS_PATH = "pyxis/archive/refs/tags/v0.24.0.tar.gz"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def github(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local stand-in for https://github.com/NVIDIA: (base URL, the folder it serves)."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(_Quiet, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()


def _checkout(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    if checkout.exists():
        return checkout
    checkout.mkdir()
    for name in ("setup.sh", "setup-peers.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    return checkout


def _peers(tmp_path: Path, base_url: str, peers_dir: Path) -> subprocess.CompletedProcess[str]:
    checkout = _checkout(tmp_path)
    return subprocess.run(
        ["bash", "setup.sh", "peers"], cwd=checkout, capture_output=True, text=True,
        timeout=300, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PEERS_DIR": str(peers_dir),
                          "PEERS_BASE_URL": base_url, "PEERS_DESTDIR": str(tmp_path / "root"),
                          "PEERS_SKIP_PACKAGES": "1", "HOME": str(tmp_path)})


def _serve(served: Path, relative: str, data: bytes) -> None:
    (served / relative).parent.mkdir(parents=True, exist_ok=True)
    (served / relative).write_bytes(data)


def test_a_download_that_does_not_match_its_checksum_is_refused_in_one_line(
        tmp_path: Path, github: tuple[str, Path]) -> None:
    url, served = github
    real = (PEERS / "enroot-4.1.2.tar.gz").read_bytes()
    _serve(served, ENROOT_PATH, real[:-1] + bytes([real[-1] ^ 1]))  # one bit flipped
    done = _peers(tmp_path, url, tmp_path / "no-peers")
    assert done.returncode == 1, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("setup:")]
    assert f"{url}/{ENROOT_PATH} does not match enroot-4.1.2.tar.gz's sha256" in line
    assert "refused" in line and "no-peers/" in line
    assert not (tmp_path / "root").exists()  # nothing built, nothing installed
    assert not list((tmp_path / "checkout" / "build" / "peers").glob("*.tar.gz*"))


def test_no_source_at_all_says_what_to_put_where(tmp_path: Path,
                                                 github: tuple[str, Path]) -> None:
    url, _ = github  # serves nothing: 404
    done = _peers(tmp_path, url, tmp_path / "no-peers")
    assert done.returncode == 1
    [line] = [x for x in done.stderr.splitlines() if x.startswith("setup:")]
    assert "cannot get enroot-4.1.2.tar.gz" in line
    assert f"put the tag's tarball (sha256 {_sha256(PEERS / 'enroot-4.1.2.tar.gz')}) in " \
           f"{tmp_path / 'no-peers'}/" in line


def test_the_tags_tarballs_from_github_build_the_same_versions(
        tmp_path: Path, github: tuple[str, Path]) -> None:
    url, served = github
    _serve(served, ENROOT_PATH, (PEERS / "enroot-4.1.2.tar.gz").read_bytes())
    _serve(served, PYXIS_PATH, (PEERS / "pyxis-0.24.0.tar.gz").read_bytes())
    done = _peers(tmp_path, url, tmp_path / "no-peers")
    assert done.returncode == 0, done.stderr
    assert f"downloading {url}/{ENROOT_PATH}" in done.stderr
    root = tmp_path / "root"
    enroot = root / "usr/local/bin/enroot"
    version = subprocess.run([str(enroot), "version"], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin", "ENROOT_RUNTIME_PATH": str(tmp_path),
                                  "ENROOT_CACHE_PATH": str(tmp_path),
                                  "ENROOT_DATA_PATH": str(tmp_path)})
    assert version.stdout.strip() == "4.1.2", version.stderr
    caps = subprocess.run(["/usr/sbin/getcap", str(enroot) + "-aufs2ovlfs"],
                          capture_output=True, text=True).stdout
    assert "cap_sys_admin,cap_mknod=ep" in caps  # users' `enroot import`, as Enroot's +caps
    plugin = (root / "usr/local/lib/slurm/spank_pyxis.so").read_bytes()
    assert plugin.startswith(b"\x7fELF") and b"0.24.0" in plugin
    again = _peers(tmp_path, url, tmp_path / "no-peers")  # idempotent: nothing built again
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
