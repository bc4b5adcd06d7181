"""Registry -> squashfs against the real engine, registry and squashfs tools.

The fixture image is built by BuildKit from the debootstrap base with files
added, changed and deleted across layers, an opaque directory, symlinks, hard
links, a setuid file, an empty directory and a name with spaces; its squashfs
must list exactly what `docker export` of the same image holds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests import services
from tests.conftest import CliRun

MULTI_LAYER_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN set -e; mkdir -p /data/gone /data/opq /data/keep; \\
    echo v1 > /data/changed; echo x > /data/gone/file; echo old > /data/opq/old; \\
    echo del > /data/deleted; echo kept > /data/keep/file; \\
    echo first > /data/hard1; ln /data/hard1 /data/hard2; \\
    echo target > /data/linked-then-replaced; ln /data/linked-then-replaced /data/survivor
RUN set -e; echo v2 > /data/changed; rm /data/deleted; rm -rf /data/gone; \\
    rm -rf /data/opq; mkdir /data/opq; echo new > /data/opq/new; \\
    echo replaced > /data/linked-then-replaced; \\
    echo spaced > "/data/with space.txt"; cp /bin/true /data/setuid; chmod 4755 /data/setuid; \\
    mkdir /data/empty; ln -s /data/changed /data/abs-link; ln -s changed /data/rel-link; \\
    ln -s ../usr/bin /data/bin-link; mkfifo /data/fifo; \\
    echo secret > /data/noperm; chmod 0000 /data/noperm; mkdir -m 0555 /data/ro-dir
ENV FOO="bar baz" \\
    PATH=/usr/local/bin:/usr/bin:/bin
LABEL org.example.purpose="conversion test"
WORKDIR /srv/app
VOLUME /data/vol
ENTRYPOINT ["/bin/echo", "hello"]
CMD ["world"]
"""


def docker(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([services.DOCKER, *args], capture_output=True, text=True,
                          check=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def multi_layer_image(tmp_path_factory, base_image, registry_server) -> str:
    context = tmp_path_factory.mktemp("multi-layer")
    (context / "Dockerfile").write_text(MULTI_LAYER_DOCKERFILE)
    tag = f"{registry_server.address}/test/multi:1"
    docker("build", "--network=host", "--build-arg", f"BASE_IMAGE={base_image}", "-t", tag,
           str(context),
           env={**os.environ, "DOCKER_BUILDKIT": "1"})
    docker("push", tag)
    return tag


@pytest.fixture(scope="module")
def base_in_registry(base_image, registry_server) -> str:
    tag = f"{registry_server.address}/test/base:1"
    docker("tag", base_image, tag)
    docker("push", tag)
    return tag


@pytest.fixture
def convert_cli(cli: CliRun, registry_server) -> CliRun:
    cli.write_config({"registry": {"port": registry_server.port}})
    return cli


def squashfs_listing(path: Path) -> dict[str, tuple[str, int | None, str | None]]:
    """path -> (mode string, size for files, link target) from `unsquashfs -lls`."""
    out = subprocess.run(["unsquashfs", "-lls", "-d", "ROOT", str(path)], capture_output=True,
                         text=True, check=True).stdout
    listing = {}
    for line in out.splitlines():
        if not line.startswith(("d", "-", "l", "p", "c", "b", "s")) or " ROOT" not in line:
            continue
        fields = line.split(None, 5)
        mode, size, rest = fields[0], fields[2], fields[5]
        name = rest.split("ROOT", 1)[1]
        target = None
        if mode.startswith("l"):
            name, target = name.split(" -> ", 1)
        name = name.lstrip("/")
        if name:
            listing[name] = (mode, int(size) if mode.startswith("-") else None, target)
    return listing


def export_listing(image: str) -> dict[str, tuple[str, int | None, str | None]]:
    """The same, from `docker export`, with Enroot's permission fix applied."""
    container = docker("create", image).stdout.strip()
    try:
        exported = subprocess.run([services.DOCKER, "export", container], capture_output=True,
                                  check=True, timeout=600).stdout
    finally:
        docker("rm", container)
    listing: dict[str, tuple[str, int | None, str | None]] = {}
    sizes: dict[str, int] = {}
    import io

    with tarfile.open(fileobj=io.BytesIO(exported)) as tar:
        for member in tar:
            name = member.name.removeprefix("./").rstrip("/")
            if not name:
                continue
            if member.isdir():
                mode = stat.S_IFDIR | member.mode | 0o700
            elif member.issym():
                mode = stat.S_IFLNK | 0o777
            elif member.isfifo():
                mode = stat.S_IFIFO | member.mode | 0o400
            elif member.ischr():
                mode = stat.S_IFCHR | member.mode
            else:
                mode = stat.S_IFREG | member.mode | 0o400
            size = None
            if member.isfile():
                size = sizes[name] = member.size
            elif member.islnk():
                size = sizes[member.linkname.removeprefix("./")]
            listing[name] = (stat.filemode(mode), size,
                             member.linkname if member.issym() else None)
    return listing


# What docker export adds (the engine's init layer: mount points and the mtab link) or
# Enroot replaces (its rc files).
EXPORT_ONLY = {".dockerenv", "etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/mtab"}
ENROOT_FILES = {"etc/environment", "etc/rc", "etc/rc.local", "etc/fstab"}


def test_squashfs_equals_docker_export_entry_by_entry(convert_cli, multi_layer_image) -> None:
    code, out, err = convert_cli("convert", multi_layer_image, "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["converted"] is True
    layers = data["layers"]
    assert sum(layer["whiteouts"] for layer in layers) >= 2  # data/deleted, data/gone
    assert sum(layer["opaque"] for layer in layers) >= 1

    squashed = squashfs_listing(Path(data["squashfs"]))
    exported = export_listing(multi_layer_image)
    for name in EXPORT_ONLY | ENROOT_FILES:
        squashed.pop(name, None)
        exported.pop(name, None)
    exported = {k: v for k, v in exported.items() if not k.startswith("dev/")}
    assert not [k for k in squashed if k.startswith("dev/")]
    missing = sorted(set(exported) - set(squashed))
    extra = sorted(set(squashed) - set(exported))
    assert missing == [] and extra == []
    different = {k: (exported[k], squashed[k]) for k in exported if exported[k] != squashed[k]}
    assert different == {}
    # The cases this image was made for are really there.
    assert squashed["data/changed"][1] == 3  # "v2\n"
    assert "data/deleted" not in squashed and "data/gone" not in squashed
    assert "data/opq/old" not in squashed and "data/opq/new" in squashed
    assert squashed["data/setuid"][0] == "-rwsr-xr-x"
    assert squashed["data/empty"][0].startswith("d")
    assert "data/with space.txt" in squashed
    assert squashed["data/abs-link"][2] == "/data/changed"
    assert squashed["data/noperm"][0] == "-r--------"  # Enroot's fix: the owner may read
    assert squashed["data/ro-dir"][0] == "drwxr-xr-x"
    assert squashed["data/fifo"][0].startswith("p")
    assert squashed["data/survivor"][1] == len("target\n")  # hard link kept the old bytes


def test_enroot_rc_files(convert_cli, multi_layer_image) -> None:
    code, out, err = convert_cli("convert", multi_layer_image, "--json")
    assert code == 0, err
    path = json.loads(out)["data"]["squashfs"]

    def cat(name: str) -> str:
        return subprocess.run(["unsquashfs", "-cat", path, name], capture_output=True,
                              text=True, check=True).stdout

    environment = cat("etc/environment").splitlines()
    assert "FOO=bar baz" in environment
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in environment
    rc = cat("etc/rc")
    assert "cd /srv/app && unset OLDPWD || exit 1" in rc
    assert 'exec /bin/echo hello "$@"' in rc and "exec /bin/echo hello world" in rc
    assert "# org.example.purpose=conversion test" in rc
    assert "/data/vol none x-create=dir,bind" in cat("etc/fstab")
    # The rc script really runs the entrypoint as Enroot would.
    result = subprocess.run(["sh", "-c", rc.replace("cd /srv/app", "cd /tmp"), "rc"],
                            capture_output=True, text=True)
    assert result.stdout == "hello world\n"


def test_already_converted_returns_at_once(convert_cli, multi_layer_image) -> None:
    assert convert_cli("convert", multi_layer_image)[0] == 0
    code, out, _ = convert_cli("convert", multi_layer_image, "--json")
    data = json.loads(out)["data"]
    assert code == 0 and data["converted"] is False and data["fetched_bytes"] == 0
    pinned = f"{multi_layer_image.rsplit(':', 1)[0]}@{data['digest']}"
    code, out, _ = convert_cli("convert", pinned, "--json")
    assert json.loads(out)["data"]["squashfs"] == data["squashfs"]


@pytest.mark.parametrize("compression", ["lz4", "lzo-enroot", "none"])
def test_other_compressions_give_the_same_tree(tmp_path, registry_server, multi_layer_image,
                                               compression, capsys) -> None:
    cli = CliRun(tmp_path, capsys)
    cli.write_config({"registry": {"port": registry_server.port},
                      "enroot": {"compression": compression}})
    code, out, err = cli("convert", multi_layer_image, "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["compression"] == compression
    reference = CliRun(tmp_path / "zstd", capsys)
    (tmp_path / "zstd").mkdir()
    reference.write_config({"registry": {"port": registry_server.port}})
    zstd = json.loads(reference("convert", multi_layer_image, "--json")[1])["data"]["squashfs"]
    assert squashfs_listing(Path(data["squashfs"])) == squashfs_listing(Path(zstd))
    superblock = subprocess.run(["unsquashfs", "-s", data["squashfs"]], capture_output=True,
                                text=True, check=True).stdout
    expected = {"lz4": "lz4", "lzo-enroot": "lzo", "none": "gzip"}[compression]
    assert f"Compression {expected}" in superblock
    if compression == "lzo-enroot":
        assert "Data is uncompressed" in superblock  # Enroot's -noD


def _convert_proc(folder: Path, ref: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from imgpipe.cli.main import run; run()", "convert", ref,
         "--json"], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_convert_one_digest_once(tmp_path, registry_server,
                                               base_in_registry) -> None:
    shared = tmp_path / "shared"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "imgpipe.yaml").write_text(json.dumps({
            "registry": {"port": registry_server.port},
            "outputs": {"squashfs_dir": str(shared)}}))
    procs = [_convert_proc(tmp_path / name, base_in_registry) for name in ("a", "b")]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out)["data"])
    assert sorted(r["converted"] for r in results) == [False, True]
    assert results[0]["squashfs"] == results[1]["squashfs"]
    published = sorted(p.name for p in shared.glob("*.sqsh"))
    assert len(published) == 1
    subprocess.run(["unsquashfs", "-s", results[0]["squashfs"]], check=True,
                   capture_output=True)
    assert not list(shared.glob(".tmp-*"))


def test_killed_conversion_leaves_nothing_visible_and_the_next_succeeds(
        tmp_path, registry_server, base_in_registry) -> None:
    shared = tmp_path / "shared"
    (tmp_path / "imgpipe.yaml").write_text(json.dumps({
        "registry": {"port": registry_server.port},
        "outputs": {"squashfs_dir": str(shared)}, "enroot": {"compression": "lzo-enroot"}}))
    proc = _convert_proc(tmp_path, base_in_registry)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(shared.glob(".tmp-*")):
        time.sleep(0.05)
    assert list(shared.glob(".tmp-*")), "the conversion never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(shared.glob("*.sqsh")) == []  # nothing half-written is visible
    again = _convert_proc(tmp_path, base_in_registry)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    data = json.loads(out)["data"]
    assert data["converted"] is True
    assert not list(shared.glob(".tmp-*")) and len(list(shared.glob("*.sqsh"))) == 1
    assert not list((shared / ".imgpipe/tmp").iterdir())


def test_pyxis_importer_contract(tmp_path, registry_server, multi_layer_image) -> None:
    config = tmp_path / "imgpipe.yaml"
    config.write_text(json.dumps({"registry": {"port": registry_server.port},
                                  "outputs": {"squashfs_dir": str(tmp_path / "sqsh")}}))
    importer = Path(sys.executable).parent / "imgpipe-pyxis-importer"
    env = {**os.environ, "IMGPIPE_CONFIG": str(config), "SLURM_JOB_ID": "42",
           "SLURM_STEP_ID": "0", "XDG_RUNTIME_DIR": str(tmp_path)}
    uri = "docker://" + multi_layer_image.replace("/", "#", 1)  # 127.0.0.1:PORT#test/multi:1

    first = subprocess.run([str(importer), "get", uri], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    assert path.is_file() and path.suffix == ".sqsh"
    assert "fetch" in first.stderr  # it converted
    mtime = path.stat().st_mtime_ns
    second = subprocess.run([str(importer), "get", uri], capture_output=True, text=True, env=env)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "fetch" not in second.stderr and path.stat().st_mtime_ns == mtime
    for _ in range(2):
        released = subprocess.run([str(importer), "release"], capture_output=True, env=env)
        assert released.returncode == 0
    assert path.is_file()  # release never deletes the shared entry
    missing = subprocess.run([str(importer), "get", uri.replace("multi:1", "multi:nope")],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and missing.stdout == ""
    assert "is not in the registry" in missing.stderr
    usage = subprocess.run([str(importer), "fetch"], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_push_convert_records_squashfs_in_the_lock(tmp_path, registry_server, base_image,
                                                   capsys) -> None:
    images = tmp_path / "images" / "tiny"
    images.mkdir(parents=True)
    (images / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nCOPY a /a\n")
    (images / "a").write_text("a\n")
    (images / "image.yaml").write_text(json.dumps({
        "name": "tiny", "repository": "test/tiny", "version": "1",
        "flavors": {"cpu": {"base": base_image}}, "squashfs_compression": "lz4"}))
    cli = CliRun(tmp_path, capsys)
    cli.write_config({"registry": {"port": registry_server.port}})
    assert cli("build", "tiny")[0] == 0
    code, out, err = cli("push", "--convert", "--json")
    assert code == 0, err
    entry = json.loads((tmp_path / "imgpipe.lock").read_text())["images"]["tiny"]["cpu"]
    squashfs = Path(entry["squashfs"])
    assert squashfs.is_file() and entry["digest"].split(":")[1] in squashfs.name
    import hashlib

    assert entry["squashfs_sha256"] == "sha256:" + hashlib.sha256(
        squashfs.read_bytes()).hexdigest()
    superblock = subprocess.run(["unsquashfs", "-s", str(squashfs)], capture_output=True,
                                text=True, check=True).stdout
    assert "Compression lz4" in superblock  # the image's own choice


def test_with_enroot_when_enroot_is_missing(convert_cli, multi_layer_image, monkeypatch,
                                           tmp_path) -> None:
    # A PATH without enroot, whatever this machine has (a hand-built one may be here).
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("tar2sqfs", "mksquashfs", "unsquashfs"):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    monkeypatch.setenv("PATH", f"{tools}:/nonexistent")
    code, _, err = convert_cli("convert", multi_layer_image.replace(":1", ":1"),
                               "--with-enroot", "--compression", "lz4")
    assert code != 0
    assert err.strip().splitlines()[-1] == (
        "error: enroot is not installed (hint: install enroot "
        "(https://github.com/NVIDIA/enroot/releases))")


def test_node_config(convert_cli, tmp_path) -> None:
    code, out, _ = convert_cli("node-config", "--json")
    data = json.loads(out)["data"]
    assert code == 0
    assert "#ENROOT_ALLOW_HTTP yes" in data["enroot_conf"]  # an option, marked
    assert "importer=" in data["plugstack_conf"] and "spank_pyxis.so" in data["plugstack_conf"]
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    convert_cli.write_config({"registry": {"scheme": "https", "ca_file": str(ca),
                                           "credentials": {"source": "netrc"}}})
    data = json.loads(convert_cli("node-config", "--json")[1])["data"]
    assert f"#SSL_CERT_FILE {ca}" in data["enroot_conf"]
    assert "update-ca-certificates" in data["enroot_conf"]
    assert "ENROOT_ALLOW_HTTP" not in data["enroot_conf"]
    assert "registry.credentials (netrc)" in data["credentials"]


def test_a_broken_catalog_does_not_block_converting_a_reference(convert_cli,
                                                                 multi_layer_image) -> None:
    broken = convert_cli.folder / "images" / "oops"
    broken.mkdir(parents=True)
    (broken / "image.yaml").write_text("name: [\n")
    code, _, err = convert_cli("convert", multi_layer_image)
    assert code == 0, err
    code, _, err = convert_cli("convert", "oops")  # a catalog name still reads the catalog
    assert code == 2 and "image.yaml: not valid YAML" in err
