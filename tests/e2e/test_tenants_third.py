"""The threat model's third round (docs/threat-model.md, "Who reads and writes what"),
played with real accounts: root's blob cache on a state folder a user prepared, a planted pid
file, another user's `down`, private logs and cached blobs, deep folders that would stop every
sweep, and private images kept out of the shared squashfs cache.

Each attack ends with one refusal line (no traceback) and nothing of root's, or of the
victim's, changed; or with the victim's job getting its bytes regardless.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import services, tenants
from tests.cluster import USERS, ensure_users, shared_folder, system_imgpipe

ALICE, BOB = USERS
ROOT_IMGPIPE = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "imgpipe"


@pytest.fixture(scope="module")
def accounts() -> dict[str, object]:
    """The job users and an imgpipe every one of them can run."""
    ensure_users()
    bin_dir = system_imgpipe(Path(__file__).resolve().parents[2])
    return {"bin": bin_dir, "uid": {name: pwd.getpwnam(name).pw_uid for name in USERS}}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.RegistryProcess]:
    server = services.start_registry(tmp_path_factory.mktemp("third-registry"))
    yield server
    server.stop()


def _config(folder: Path, registry: services.RegistryProcess, state: Path) -> Path:
    """A site config every user can read, naming the cache's state folder."""
    port = services.free_port()
    path = folder / f"imgpipe-{port}.yaml"
    path.write_text(yaml.safe_dump({"registry": {
        "port": registry.port, "blob_cache": f"http://127.0.0.1:{port}",
        "cache_server": {"port": port, "state_dir": str(state), "max_size": "1G"}}}))
    path.chmod(0o644)
    return path


def _as_root(config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT_IMGPIPE), *argv], capture_output=True, text=True,
                          timeout=120, cwd="/tmp",
                          env={**os.environ, "IMGPIPE_CONFIG": str(config)})


def _as_user(accounts, user: str, config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    imgpipe = str(Path(str(accounts["bin"])) / "imgpipe")
    return subprocess.run(["runuser", "-u", user, "--", "env", f"IMGPIPE_CONFIG={config}",
                           imgpipe, *argv], capture_output=True, text=True, timeout=120,
                          cwd="/tmp")


def _shell_as(user: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", "/bin/sh", "-c", script],
                          capture_output=True, text=True, timeout=60, cwd="/tmp")


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    return line


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    found = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        info = path.lstat()
        found[str(path)] = (info.st_uid, info.st_mode,
                            path.read_bytes() if path.is_file() and not path.is_symlink() else b"")
    return found


@pytest.fixture
def victim() -> Iterator[tuple[Path, Path]]:
    """Root's own things a planted link would reach: a folder (what /var/lib is) and a file
    (what /etc/shadow is)."""
    folder = shared_folder("imgpipe-roots-")
    (folder / "keep").write_text("root's\n")
    shadow = folder / "shadow"
    shadow.write_text("root:!:1::::::\n")
    shadow.chmod(0o600)
    yield folder, shadow
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def bobs_process() -> Iterator[int]:
    """A process of bob's: what a planted pid file names."""
    proc = subprocess.Popen(["runuser", "-u", BOB, "--", "sleep", "300"])
    deadline = time.monotonic() + 10
    child = None
    while child is None and time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-u", BOB, "-P", str(proc.pid), "sleep"],
                             capture_output=True, text=True).stdout.split()
        child = int(out[0]) if out else None
        if child is None:
            out = subprocess.run(["pgrep", "-u", BOB, "-x", "sleep"], capture_output=True,
                                 text=True).stdout.split()
            child = int(out[-1]) if out else None
        time.sleep(0.05)
    assert child is not None
    yield child
    proc.kill()
    subprocess.run(["pkill", "-u", BOB, "-x", "sleep"], check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_root_never_starts_the_blob_cache_on_a_folder_a_user_prepared(
        accounts, upstream, victim, bobs_process) -> None:
    """threat-model: "root's `up`/`down` walk the state folder".
    In a scratch folder every user may write (1777, as /var/tmp is), bob prepares the state
    folder: his own, with `tmp` linked to root's folder, `access.log` linked to root's
    shadow and `nginx.pid` naming his process; or the state path itself a link to root's
    folder.  Root's `up` and `down` refuse each in one line; root's folder and file keep
    owner, mode and bytes, bob's process lives."""
    folder, shadow = victim
    scratch = shared_folder("imgpipe-scratch-")
    scratch.chmod(0o1777)
    before = _snapshot(folder)
    prepared = scratch / "state"
    done = _shell_as(BOB, f"mkdir -m 777 {prepared} && ln -s {folder} {prepared}/tmp && "
                     f"ln -s {shadow} {prepared}/access.log && "
                     f"echo {bobs_process} > {prepared}/nginx.pid && "
                     f"ln -s {folder} {scratch}/linked")
    assert done.returncode == 0, done.stderr
    bob = f"uid {accounts['uid'][BOB]} ({BOB})"
    for state, refusal in ((prepared, f"{prepared} was made by {bob}, a job user"),
                           (scratch / "linked", f"{scratch}/linked is a symbolic link"),
                           (scratch / "linked" / "state", f"{scratch}/linked is a symbolic link")):
        config = _config(scratch, upstream, state)
        for command in ("up", "down"):
            line = _one_line(_as_root(config, "registry", "cache", command))
            assert refusal in line, (command, line)
    assert _snapshot(folder) == before
    assert _alive(bobs_process)
    assert not (folder / "nginx.conf").exists()
    shutil.rmtree(scratch)


def test_root_signals_only_the_nginx_it_started(accounts, upstream, bobs_process) -> None:
    """threat-model: "`down` signals only the nginx it started".
    A pid file in root's own state folder that names another process (a reused pid, or
    one planted before the folder was root's): `down` refuses in one line, signals
    nothing; `up` does not take it for a running cache and starts one."""
    state = shared_folder("imgpipe-state-")
    config = _config(state.parent, upstream, state / "cache")
    (state / "cache").mkdir(mode=0o755)
    (state / "cache" / "nginx.pid").write_text(f"{bobs_process}\n")
    line = _one_line(_as_root(config, "registry", "cache", "down"))
    assert f"pid {bobs_process} is not the process imgpipe started" in line, line
    assert _alive(bobs_process)
    try:
        done = _as_root(config, "registry", "cache", "up")
        assert done.returncode == 0 and "blob cache started" in done.stdout, done.stderr
        assert _alive(bobs_process)
    finally:
        _as_root(config, "registry", "cache", "down")
        config.unlink()


def test_logs_and_cached_blobs_are_root_and_the_workers_alone(accounts, upstream) -> None:
    """threat-model: "logs and cached blobs: root and the workers' account alone".
    Another user's `down`
    is one line and stops nothing; the access log (repositories and digests) is 0600 root's,
    the cached blobs 0700 the workers'; bob reads neither."""
    state = shared_folder("imgpipe-state-")
    config = _config(state.parent, upstream, state / "cache")
    try:
        done = _as_root(config, "registry", "cache", "up")
        assert done.returncode == 0, done.stderr
        session = services.plain_session()
        digest = services.push_blob(session, upstream.url, "third/blob", os.urandom(1 << 20))
        port = yaml.safe_load(config.read_text())["registry"]["cache_server"]["port"]
        got = session.get(f"http://127.0.0.1:{port}/v2/third/blob/blobs/{digest}", timeout=10)
        assert got.status_code == 200
        line = _one_line(_as_user(accounts, BOB, config, "registry", "cache", "down"))
        assert "runs as root" in line and "only root can stop it" in line, line
        assert session.get(f"http://127.0.0.1:{port}/imgpipe-blob-cache", timeout=5).ok
        cache = state / "cache"
        for name in ("access.log", "error.log", "nginx.out"):
            info = (cache / name).stat()
            assert (info.st_uid, info.st_mode & 0o777) == (0, 0o600), name
        nobody = pwd.getpwnam("nobody").pw_uid
        for folder in (cache / "blobs", cache / "tmp"):
            info = folder.stat()
            assert (info.st_uid, info.st_mode & 0o777) == (nobody, 0o700), folder
        assert digest.split(":")[1][:12] in (cache / "access.log").read_text()
        peek = _shell_as(BOB, f"cat {cache}/access.log; ls {cache}/blobs")
        assert peek.returncode != 0 and digest.split(":")[1][:12] not in peek.stdout
    finally:
        assert _as_root(config, "registry", "cache", "down").returncode == 0
        config.unlink()


def _deep_folder_as(site, user: str, path: Path, depth: int = 3000) -> None:
    script = ("import os, sys\n"
              "os.mkdir(sys.argv[1]); os.chdir(sys.argv[1])\n"
              f"for _ in range({depth}):\n"
              "    os.mkdir('d'); os.chdir('d')\n"
              "open('f', 'w').close()\n")
    done = tenants.as_user(site, user, f"python3 -c {shlex.quote(script)} {path}")
    assert done.returncode == 0, done.stderr


def test_a_deep_folder_another_user_made_stops_nobodys_sweep(site, registry_server) -> None:
    """threat-model: "another user's files never fail a `get`".
    Bob makes folders 3,000 levels
    deep named like orphaned work areas (a dead process's `~host~pid~start`, and a digest's
    `<hex>.x`) in the shared cache's tmp: alice's cold `get` (which sweeps, and cleans the
    digest's leftovers) converts as ever, and bob's folders are his to keep."""
    digest = tenants.image(registry_server, "deep-folders")
    tmp = site["cache"] / ".imgpipe" / "tmp"
    node = site["cluster"].spec.nodes[0].name
    planted = [tmp / f"work~{node}~999999~1", tmp / f"{digest.split(':')[1]}.x"]
    for path in planted:
        _deep_folder_as(site, BOB, path)
    done = tenants.get(site, ALICE, f"docker://head:5000#{tenants.REPO}@{digest}")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert Path(done.stdout.strip()).is_file()
    for path in planted:
        assert path.is_dir() and path.stat().st_uid == site["uid"][BOB]
        subprocess.run(["rm", "-rf", str(path)], check=True)


LOGIN, PASSWORD = "puller", "Pr1vate-pa55"


@pytest.fixture(scope="module")
def private_site(accounts, tmp_path_factory) -> Iterator[dict[str, object]]:
    """A TLS registry that asks for a login, a shared cache root made, and a site config:
    alice has the login in her ~/.netrc, bob has none."""
    import trustme

    root = tmp_path_factory.mktemp("login-registry")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(root / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(root / "server.crt"))
    services.htpasswd_file(root / "htpasswd", LOGIN, PASSWORD)
    server = services.start_registry(root, extra={
        "http": {"tls": {"certificate": str(root / "server.crt"),
                         "key": str(root / "server.key")}},
        "auth": {"htpasswd": {"realm": "private", "path": str(root / "htpasswd")}},
    }, scheme="https")
    shared = shared_folder("imgpipe-private-")
    ca.cert_pem.write_to_path(str(shared / "ca.pem"))
    cache = shared / "squashfs"
    made = subprocess.run([str(ROOT_IMGPIPE), "node-config", "--make-cache", str(cache)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    config = shared / "imgpipe.yaml"
    config.write_text(yaml.safe_dump({
        "registry": {"host": "127.0.0.1", "port": server.port, "scheme": "https",
                     "ca_file": str(shared / "ca.pem"), "credentials": {"source": "netrc"}},
        "outputs": {"squashfs_dir": str(cache)}}))
    config.chmod(0o644)
    home = Path(pwd.getpwnam(ALICE).pw_dir)
    netrc = home / ".netrc"
    netrc.write_text(f"machine 127.0.0.1 login {LOGIN} password {PASSWORD}\n")
    os.chown(netrc, pwd.getpwnam(ALICE).pw_uid, pwd.getpwnam(ALICE).pw_gid)
    netrc.chmod(0o600)
    session = services.plain_session()
    session.auth = (LOGIN, PASSWORD)
    session.verify = str(shared / "ca.pem")
    yield {"server": server, "cache": cache, "config": config, "session": session}
    netrc.unlink()
    server.stop()


def _import_as(accounts, user: str, config: Path, *argv: str
               ) -> subprocess.CompletedProcess[str]:
    importer = str(Path(str(accounts["bin"])) / "imgpipe-pyxis-importer")
    home = pwd.getpwnam(user).pw_dir
    return subprocess.run(["runuser", "-u", user, "--", "env", f"IMGPIPE_CONFIG={config}",
                           f"HOME={home}", importer, *argv], capture_output=True, text=True,
                          timeout=300, cwd="/tmp")


def test_a_private_images_bytes_are_kept_for_the_user_who_pulled_it(accounts,
                                                                    private_site) -> None:
    """threat-model: "a private image's squashfs and blobs: its puller's alone".
    Alice pulls an image from a
    registry that asks for a login: its squashfs and blobs lie in her own 0700 folder, 0600,
    nothing at a shared name.  Bob, without the login, gets nothing from the cache for the
    same pinned digest (the registry's one line) and cannot read her files."""
    server = private_site["server"]
    cache: Path = private_site["cache"]  # type: ignore[assignment]
    secret = f"secret {time.monotonic_ns()}\n".encode()
    layer = services.tar_layer({"srv/secret": secret, "etc/os-release": b"ID=private\n"})
    digest = services.push_image(private_site["session"], server.url, "private/img", "v1",
                                 [layer])
    uri = f"docker://127.0.0.1:{server.port}#private/img@{digest}"
    got = _import_as(accounts, ALICE, private_site["config"], "get", uri)
    assert got.returncode == 0, got.stderr
    path = Path(got.stdout.strip())
    alice = accounts["uid"][ALICE]
    assert path.parent == cache / ".imgpipe" / "tmp" / f"u{alice}"
    assert (path.stat().st_uid, path.stat().st_mode & 0o777) == (alice, 0o600)
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    assert not list(cache.glob("*.sqsh")), "a private image's entry at a shared name"
    layer_hex = services.digest_of(layer).split(":")[1]
    assert not (cache / ".imgpipe" / "blobs" / "sha256" / layer_hex).exists()
    again = _import_as(accounts, ALICE, private_site["config"], "get", uri)
    assert again.returncode == 0 and again.stdout.strip() == str(path), again.stderr

    refused = _import_as(accounts, BOB, private_site["config"], "get", uri)
    line = _one_line(refused)
    assert "requires a login" in line, line
    peek = _shell_as(BOB, f"cat {path}; ls {path.parent}; grep -r secret {cache}")
    assert secret.decode().strip() not in peek.stdout


def _imgpipe_as(accounts, user: str, config: Path, *argv: str
                ) -> subprocess.CompletedProcess[str]:
    imgpipe = str(Path(str(accounts["bin"])) / "imgpipe")
    return subprocess.run(["runuser", "-u", user, "--", "env", f"IMGPIPE_CONFIG={config}",
                           f"HOME={pwd.getpwnam(user).pw_dir}", imgpipe, *argv],
                          capture_output=True, text=True, timeout=120, cwd="/tmp")


def test_private_entries_are_listed_and_pruned(accounts, private_site) -> None:
    """Under a registry that asks everyone for a login every entry is private: `cache ls`
    and `cache prune` see them (before, they looked only at the shared names, and a cache of
    private entries grew past any size).  Alice sees and prunes her own; bob is told whose
    he cannot read; root prunes them all."""
    server = private_site["server"]
    config: Path = private_site["config"]  # type: ignore[assignment]
    layer = services.tar_layer({"srv/data": os.urandom(4096), "etc/os-release": b"ID=p\n"})
    digest = services.push_image(private_site["session"], server.url, "private/pruned", "v1",
                                 [layer])
    got = _import_as(accounts, ALICE, config, "get",
                     f"docker://127.0.0.1:{server.port}#private/pruned@{digest}")
    assert got.returncode == 0, got.stderr
    entry = Path(got.stdout.strip())
    released = _import_as(accounts, ALICE, config, "release")  # the step ended
    assert released.returncode == 0, released.stderr
    listed = _imgpipe_as(accounts, ALICE, config, "cache", "ls")
    assert listed.returncode == 0, listed.stderr
    assert f"u{accounts['uid'][ALICE]}/{entry.name}" in listed.stdout
    theirs = _imgpipe_as(accounts, BOB, config, "cache", "ls")
    assert theirs.returncode == 0, theirs.stderr
    assert "private entries" in theirs.stdout and ALICE in theirs.stdout, theirs.stdout
    assert entry.name not in theirs.stdout
    pruned = subprocess.run([str(ROOT_IMGPIPE), "--config", str(config), "cache", "prune",
                             "--max-size", "0"], capture_output=True, text=True, timeout=120)
    assert pruned.returncode == 0, pruned.stderr
    assert f"removed squashfs {entry.name}" in pruned.stdout, pruned.stdout
    assert not entry.exists()
    assert not [p for p in entry.parent.iterdir() if len(p.name) == 64]  # her blobs too


def test_take_keeps_a_verified_copy_when_another_user_planted_its_entry_name(
        accounts, upstream) -> None:
    """threat-model: "a planted entry name: the copy is kept in the user's own folder".
    Bob plants a file at alice's own
    entry name in the shared cache (sticky: she cannot remove it): alice's `take` of her
    verified sbcast copy says so in one line and keeps the copy in her own folder, where
    the importer's `get` finds it; nothing is fetched again and the job starts."""
    shared = shared_folder("imgpipe-take-")
    cache = shared / "squashfs"
    made = subprocess.run([str(ROOT_IMGPIPE), "node-config", "--make-cache", str(cache)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    config = shared / "imgpipe.yaml"
    config.write_text(yaml.safe_dump({"registry": {"host": "127.0.0.1",
                                                   "port": upstream.port},
                                      "outputs": {"squashfs_dir": str(cache)}}))
    config.chmod(0o644)
    layer = services.tar_layer({"srv/stamp": f"{time.monotonic_ns()}\n".encode()})
    digest = services.push_image(services.plain_session(), upstream.url, "take/img", "v1",
                                 [layer])
    uri = f"docker://127.0.0.1:{upstream.port}#take/img@{digest}"
    staged = _import_as(accounts, ALICE, config, "stage", uri)
    assert staged.returncode == 0, staged.stderr
    source, sha256, dest, manifest = staged.stdout.split()
    # what sbcast does: alice's copy, under the unguessable name; then her batch host's
    # entry is gone (a node that never had it)
    assert _shell_as(ALICE, f"cp {source} {dest} && rm {source}").returncode == 0
    entry = Path(source)
    done = _shell_as(BOB, f"echo planted > {entry}")
    assert done.returncode == 0 and entry.stat().st_uid == accounts["uid"][BOB]
    taken = _import_as(accounts, ALICE, config, "take", uri, sha256, dest, manifest)
    assert taken.returncode == 0 and "Traceback" not in taken.stderr, taken.stderr
    assert "is kept in your own folder" in taken.stderr and "fetching" not in taken.stderr
    path = Path(taken.stdout.strip())
    assert path.parent == cache / ".imgpipe" / "tmp" / f"u{accounts['uid'][ALICE]}"
    got = _import_as(accounts, ALICE, config, "get", uri)
    assert got.returncode == 0 and got.stdout.strip() == str(path), got.stderr
    assert entry.read_text() == "planted\n"


def test_root_never_starts_the_registry_on_folders_a_user_prepared(accounts, victim,
                                                                   bobs_process) -> None:
    """threat-model: "root's `up`/`down` walk the state and data folders".
    Root's
    `registry up` (binary) with its state or data folder where bob prepared it (his own
    folder holding a pid file naming his process, or a link to root's folder) refuses in one
    line; root's folder keeps owner, mode and bytes; bob's process lives."""
    folder, _ = victim
    scratch = shared_folder("imgpipe-scratch-")
    scratch.chmod(0o1777)
    before = _snapshot(folder)
    done = _shell_as(BOB, f"mkdir -m 777 {scratch}/state && "
                     f"echo {bobs_process} > {scratch}/state/registry.pid && "
                     f"ln -s {folder} {scratch}/data")
    assert done.returncode == 0, done.stderr
    bob = f"uid {accounts['uid'][BOB]} ({BOB})"
    for state, data, refusal in (
            (scratch / "state", scratch / "mine", f"{scratch}/state was made by {bob}"),
            (scratch / "root-state", scratch / "data", f"{scratch}/data is a symbolic link")):
        config = scratch / f"{state.name}-{data.name}.yaml"
        config.write_text(yaml.safe_dump({"registry": {
            "port": services.free_port(),
            "server": {"mode": "binary", "state_dir": str(state), "data_dir": str(data)}}}))
        for command in ("up", "down"):
            done = _as_root(config, "registry", command)
            if command == "up":
                assert refusal in _one_line(done)
            else:
                assert "Traceback" not in done.stderr
    assert _snapshot(folder) == before and _alive(bobs_process)
    shutil.rmtree(scratch)


def test_root_site_init_and_node_config_never_write_through_a_users_folder(accounts,
                                                                           victim) -> None:
    """threat-model: "Every such path takes the same walk".
    Root's `site init --config` and `node-config --apply --root` on paths where bob made a
    folder or planted a link to root's folder: each refused in one line, root's folder and
    file keep owner, mode and bytes."""
    from tests.nodeimage import node_image

    folder, _ = victim
    scratch = shared_folder("imgpipe-scratch-")
    scratch.chmod(0o1777)
    node = scratch / "node"
    node_image(node, {"etc/slurm/plugstack.conf": "include /etc/slurm/plugstack.conf.d/*\n"},
               "usr/local/lib/slurm/spank_pyxis.so")
    (node / "etc").chmod(0o1777)  # a node image's folder every user may write in
    before = _snapshot(folder)
    done = _shell_as(BOB, f"mkdir -m 777 {scratch}/bobs && ln -s {folder} {scratch}/linked "
                     f"&& ln -s {folder} {node}/etc/imgpipe")
    assert done.returncode == 0, done.stderr
    bob = f"uid {accounts['uid'][BOB]} ({BOB})"
    site = ["site", "init", "--registry", "head:5000", "--plain-http", "--squashfs-dir", "/x",
            "--partition", "gpu", "--data-root", "/x", "--hcas", "mlx5_0",
            "--distribution", "shared"]
    for config, refusal in ((scratch / "bobs" / "imgpipe.yaml",
                             f"{scratch}/bobs was made by {bob}"),
                            (scratch / "linked" / "imgpipe.yaml",
                             f"{scratch}/linked is a symbolic link")):
        assert refusal in _one_line(_as_root(config, *site, "--config", str(config)))
    site_config = scratch / "site.yaml"
    site_config.write_text(yaml.safe_dump({"registry": {"host": "head"}}))
    line = _one_line(_as_root(site_config, "node-config", "--apply", "--root", str(node),
                              "--site-config", str(site_config)))
    assert f"{node}/etc/imgpipe is a symbolic link" in line, line
    assert _snapshot(folder) == before
    shutil.rmtree(scratch)
