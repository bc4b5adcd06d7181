"""A broadcast task's start (issue #61): every node of the job reads the site's settings
before the chain can start, so it reads them with the fast reader, importing neither
pydantic nor requests, and reads them as the full loader does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from imgpipe.base.configlayers import parse_settings
from imgpipe.base.errors import ImgpipeError
from imgpipe.commands.node import importer
from imgpipe.commands.node.nodesite import node_site
from imgpipe.commands.shared.wiring import storage

DIGEST = "sha256:" + "5d" * 32
HEAVY = ("pydantic", "requests", "imgpipe.base.config", "imgpipe.registry.client",
         "imgpipe.enroot.convert", "imgpipe.base.process",
         # what only the step needs once MPI has started (commands.node.chainstep)
         "imgpipe.enroot.published.relay", "imgpipe.commands.node.batchfetch")


def _config(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "imgpipe.yaml"
    config.write_text(text)
    return config


def test_a_broadcast_task_starts_without_heavy_modules(tmp_path: Path) -> None:
    config = _config(tmp_path, f"registry: {{host: head, port: 5000}}\n"
                               f"outputs: {{squashfs_dir: {tmp_path / 'sqsh'}}}\n")
    probe = ("import sys\n"
             "import imgpipe.cli.importer\n"  # the console script's module, as srun runs it
             "from imgpipe.commands.node.broadcast import broadcast\n"
             "from imgpipe.commands.node.nodesite import node_site\n"
             "site = node_site()\n"
             f"print(site.pinned('head:5000#bench/bert@{DIGEST}').repository, site.host)\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "IMGPIPE_CONFIG": str(config)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["bench/bert head", "[]"]


@pytest.mark.parametrize("login", ["", "  credentials: {source: netrc}\n"])
def test_the_fast_reader_sees_the_site_as_the_full_loader_does(tmp_path: Path,
                                                               monkeypatch, login: str) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    config = _config(tmp_path, f"registry:\n  host: head.cluster\n  port: 5443\n"
                               f"  scheme: https\n{login}"
                               f"outputs: {{squashfs_dir: link/sqsh}}\n")
    monkeypatch.setenv("IMGPIPE_CONFIG", str(config))
    monkeypatch.setattr(importer, "_QUICK", {})
    site = node_site()
    settings = parse_settings(config)
    full = storage(settings)
    assert (site.address, site.host) == (settings.registry.address, settings.registry.host)
    # root takes the path as written (a link on it refused, never followed); a user resolves
    assert site.cache.root == full.root
    assert site.cache.trust == full.trust
    assert site.cache.private is bool(login)
    with pytest.raises(ImgpipeError, match="not pinned to a digest"):
        site.pinned("head.cluster:5443#bench/bert:1")


def test_a_config_the_fast_reader_cannot_interpret_takes_the_full_loader(
        tmp_path: Path, monkeypatch) -> None:
    config = _config(tmp_path, "registry: {host: head, credentials: netrc}\n")
    monkeypatch.setenv("IMGPIPE_CONFIG", str(config))
    monkeypatch.setattr(importer, "_QUICK", {})
    assert importer.quick_settings(str(config)) is None
    with pytest.raises(ImgpipeError, match="credentials"):  # the full loader's one line
        node_site()


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_digest_is_looked_up_without_asking_the_registry(tmp_path: Path, monkeypatch,
                                                                  pinned: bool) -> None:
    """Every node of a broadcast looks for its entry at once: a digest the job pins a
    squashfs for is a manifest's, so no node asks the registry whether it is an index (a
    digest without a pin still does)."""
    import socket
    import threading

    from imgpipe.enroot.published.pins import PINS_ENV

    registry = socket.create_server(("127.0.0.1", 0))
    asked: list[bytes] = []

    def serve() -> None:
        registry.settimeout(1.5)
        try:
            peer, _ = registry.accept()
            asked.append(peer.recv(4096))
            peer.close()
        except OSError:
            pass

    listener = threading.Thread(target=serve)
    listener.start()
    port = registry.getsockname()[1]
    config = _config(tmp_path, f"registry: {{host: 127.0.0.1, port: {port}}}\n"
                               f"outputs: {{squashfs_dir: {tmp_path / 'sqsh'}}}\n")
    monkeypatch.setenv("IMGPIPE_CONFIG", str(config))
    monkeypatch.setenv(PINS_ENV, f"{DIGEST}=sha256:{'e' * 64}" if pinned else "")
    monkeypatch.setattr(importer, "_QUICK", {})
    node_site().cache.prepare()
    assert importer.fast_get(f"127.0.0.1:{port}#bench/bert@{DIGEST}") is None
    if pinned:
        registry.close()  # the listener's accept ends
    listener.join()
    registry.close()
    assert bool(asked) is not pinned, asked


def test_what_the_threat_model_trusts_is_never_read_from_a_file_others_may_write(
        tmp_path: Path, monkeypatch) -> None:
    """enroot.cache_owner (whose entries a cache trusts by owner) from a file a job user
    could have written: the fast reader leaves it to the full loader, which refuses it."""
    config = _config(tmp_path, f"outputs: {{squashfs_dir: {tmp_path / 'sqsh'}}}\n"
                               "enroot: {cache_owner: nobody}\n")
    monkeypatch.setenv("IMGPIPE_CONFIG", str(config))
    monkeypatch.setattr(importer, "_QUICK", {})
    config.chmod(0o666)
    assert importer.quick_settings(str(config)) is None
    with pytest.raises(ImgpipeError, match="enroot.cache_owner: only a file root owns"):
        node_site()
    config.chmod(0o644)  # root's own, nobody else may write: taken
    quick = importer.quick_settings(str(config))
    assert quick is not None and quick["cache_owner"] == "nobody"


def test_the_fast_readers_defaults_are_the_full_loaders() -> None:
    from imgpipe.base.config import TRUSTED_KEYS, Settings

    settings = Settings(root=Path("/"))
    assert importer.TRUSTED_KEYS == TRUSTED_KEYS
    assert (importer.DEFAULT_HOST, importer.DEFAULT_PORT, importer.DEFAULT_SCHEME) == (
        settings.registry.host, settings.registry.port, settings.registry.scheme)
    assert Path(importer.DEFAULT_SQUASHFS_DIR) == settings.outputs.squashfs_dir


def test_a_linked_config_file_roots_relative_paths_where_the_full_loader_does(
        tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "srv").mkdir()
    real = _config(tmp_path / "srv", "outputs: {squashfs_dir: sqsh}\n")
    linked = tmp_path / "etc" / "imgpipe.yaml"
    linked.symlink_to(real)
    monkeypatch.setenv("IMGPIPE_CONFIG", str(linked))
    monkeypatch.setattr(importer, "_QUICK", {})
    assert node_site().cache.root == storage(parse_settings(linked)).root
