"""The threat model (docs/threat-model.md) played with real accounts on the sandbox cluster.

Three job users (alice, bob, carol) share one squashfs cache that root set up with
`imgpipe node-config --make-cache`; bob is the hostile one.  A fourth account, the pusher,
can push to the registry and nothing else.  Each attack ends with the victim's job running
the genuine bytes (or converting them), one line naming what was refused, none of the
victim's files touched and nothing deleted from the registry that should stay.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests import services
from tests.tenants import (
    ALICE,
    BOB,
    CAROL,
    PUSHER,
    REPO,
    SERVICE,
    ensure_user,
)
from tests.tenants import as_user as _as
from tests.tenants import genuine as _genuine
from tests.tenants import get as _get
from tests.tenants import image as _image
from tests.tenants import own_config as _own_config
from tests.tenants import publish_as_pusher as _publish_as_pusher
from tests.tenants import sha256 as _sha256


def test_the_layout_belongs_to_root_and_a_job_user_cannot_make_or_own_it(site) -> None:
    cache: Path = site["cache"]
    for folder in (cache / ".imgpipe", cache / ".imgpipe" / "locks",
                   cache / ".imgpipe" / "blobs" / "sha256", cache / ".imgpipe" / "uses"):
        assert folder.stat().st_uid == 0, folder
    # bob makes a 1777 cache of his own and points a victim's config at it: refused
    fake = Path(f"/tmp/imgpipe-bobs-cache-{os.getpid()}")
    done = _as(site, BOB, f"mkdir -m 1777 {fake} && mkdir -m 1777 {fake}/.imgpipe")
    assert done.returncode == 0, done.stderr
    config = site["config"].parent / "bobs.yaml"
    config.write_text(json.dumps({"registry": {"host": "head", "port": 5000},
                                  "outputs": {"squashfs_dir": str(fake)}}))
    os.chmod(config, 0o644)
    done = _get(site, CAROL, f"docker://head:5000#{REPO}:none", config=config)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"belongs to uid {site['uid'][BOB]} ({BOB}), a job user" in line, line
    assert "node-config --make-cache" in line
    shutil.rmtree(fake)
    # doctor and cache ls say what is unsafe
    planted = cache / "x+sha256-" f"{'0' * 64}+zstd-f2.sqsh"
    assert _as(site, BOB, f"echo bad > {planted}").returncode == 0
    cli = site["bin"] / "imgpipe"
    done = site["cluster"].run([str(cli), "cache", "ls"], user=CAROL, timeout=120, cwd="/tmp",
                               env={"IMGPIPE_CONFIG": str(site["config"])},
                               host=site["cluster"].spec.nodes[0])
    assert f"unsafe: {planted}: a shared name written by uid {site['uid'][BOB]}" in done.stdout, (
        done.stdout + done.stderr)
    planted.unlink()


def test_a_planted_entry_is_never_what_a_pinned_job_runs(site, registry_server) -> None:
    """bob copies a squashfs of his under the victim's digest: at the shared name, under
    another repository's name and as a fetched file named by a pin."""
    digest, genuine = _genuine(site, registry_server, "planted")
    hexpart = digest.split(":")[1]
    cache: Path = site["cache"]
    evil = cache / f".bobs-{os.getpid()}.sqsh"
    shutil.copy(genuine, evil)
    with open(evil, "ab") as handle:
        handle.write(b"bob's bytes")
    os.chown(evil, site["uid"][BOB], -1)
    pin = "sha256:" + "e" * 64
    names = [f"tenants+img+sha256-{hexpart}+zstd-f2.sqsh", f"other+sha256-{hexpart}+zstd-f2.sqsh",
             f"tenants+img+squashfs-sha256-{pin[7:]}.sqsh"]
    for name in names:
        done = _as(site, BOB, f"cp {evil} {cache / name} && chmod 644 {cache / name}")
        assert done.returncode == 0, done.stderr
    for uri in (f"docker://head:5000#{REPO}@{digest}", f"docker://head:5000#{REPO}:planted"):
        done = _get(site, CAROL, uri, node=1, env={"IMGPIPE_SQUASHFS_PINS": f"{digest}={pin}"})
        assert done.returncode == 0, done.stderr
        got = Path(done.stdout.strip())
        assert got.name.endswith(f".u{site['uid'][CAROL]}.sqsh"), got
        assert _sha256(got) == _sha256(genuine)  # conversion is deterministic: the genuine bytes
        assert f"ignored {names[0]}: it belongs to uid {site['uid'][BOB]} ({BOB})" in done.stderr
        assert f"ignored {names[2]}" in done.stderr
    for name in names:
        (cache / name).unlink()
    evil.unlink()


def test_links_and_fifos_at_cache_paths_are_never_followed(site, registry_server) -> None:
    """bob plants a link at the victim's lock, a FIFO at a layer blob and a link at the
    config blob of an image nobody converted yet."""
    digest = _image(registry_server, "links")
    manifest = requests.get(f"{registry_server.url}/v2/{REPO}/manifests/{digest}", timeout=30,
                            headers={"Accept": "application/vnd.docker.distribution.manifest"
                                     ".v2+json"}).json()
    cache: Path = site["cache"]
    blobs = cache / ".imgpipe" / "blobs" / "sha256"
    layer = manifest["layers"][0]["digest"].split(":")[1]
    config = manifest["config"]["digest"].split(":")[1]
    secret = Path(f"/home/{CAROL}/secret")
    secret.write_text("carol's\n")
    os.chown(secret, site["uid"][CAROL], -1)
    lock = cache / ".imgpipe" / "locks" / f"{digest.split(':')[1]}.u{site['uid'][CAROL]}.lock"
    done = _as(site, BOB, f"mkfifo {blobs / layer} && ln -s {secret} {blobs / config} && "
               f"ln -s {secret} {lock}")
    assert done.returncode == 0, done.stderr
    done = _get(site, CAROL, f"docker://head:5000#{REPO}@{digest}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"lock file {lock}" in line and "remove" in line, line
    assert secret.read_text() == "carol's\n"
    lock.unlink()
    done = _get(site, CAROL, f"docker://head:5000#{REPO}@{digest}")  # FIFO and link: bypassed
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert secret.read_text() == "carol's\n"
    got = Path(done.stdout.strip())
    private = cache / ".imgpipe" / "tmp" / f"u{site['uid'][CAROL]}"
    assert private.stat().st_mode & 0o777 == 0o700 and private.stat().st_uid == site["uid"][CAROL]
    assert (private / layer).is_file()  # carol's own copy of the layer, not bob's FIFO
    assert got.stat().st_uid == site["uid"][CAROL]
    for path in (blobs / layer, blobs / config):
        path.unlink()


def test_planted_blob_and_config_bytes_are_never_used(site, registry_server) -> None:
    """bob writes his own bytes at a fresh image's layer and config blob names (regular files
    of his, which carol cannot remove): carol's conversion hashes what it reads, fetches her
    own copies and ends with the genuine bytes; bob's files stay his, unused."""
    digest = _image(registry_server, "blobs")
    manifest = requests.get(f"{registry_server.url}/v2/{REPO}/manifests/{digest}", timeout=30,
                            headers={"Accept": "application/vnd.docker.distribution.manifest"
                                     ".v2+json"}).json()
    blobs = site["cache"] / ".imgpipe" / "blobs" / "sha256"
    layer = blobs / manifest["layers"][0]["digest"].split(":")[1]
    config = blobs / manifest["config"]["digest"].split(":")[1]
    evil_config = json.dumps({"architecture": "amd64", "os": "linux",
                              "config": {"Env": ["LD_PRELOAD=/tmp/evil.so"]},
                              "rootfs": {"type": "layers", "diff_ids": []}})
    evil_layer = services.tar_layer({"usr/bin/tool": b"#!/bin/sh\necho pwned\n"})
    for path, data in ((config, evil_config.encode()), (layer, evil_layer)):
        staged = Path(f"/tmp/imgpipe-evil-{os.getpid()}-{path.name[:8]}")
        staged.write_bytes(data)
        os.chmod(staged, 0o644)
        done = _as(site, BOB, f"cp {staged} {path} && chmod 644 {path}")
        assert done.returncode == 0, done.stderr
        staged.unlink()
    done = _get(site, CAROL, f"docker://head:5000#{REPO}@{digest}")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    got = Path(done.stdout.strip())
    assert "does not match its digest and cannot be removed by this user" in done.stderr, (
        done.stderr)
    listing = subprocess.run(["rdsquashfs", "--cat", "usr/bin/tool", str(got)],
                             capture_output=True, text=True, check=True).stdout
    assert listing == "#!/bin/sh\necho genuine\n"
    environment = subprocess.run(["rdsquashfs", "--cat", "etc/environment", str(got)],
                                 capture_output=True, text=True).stdout
    assert "LD_PRELOAD" not in environment
    assert layer.stat().st_uid == site["uid"][BOB] and config.stat().st_uid == site["uid"][BOB]
    layer.unlink()
    config.unlink()


def test_a_planted_private_folder_is_refused_in_one_line(site, registry_server) -> None:
    """bob makes carol's private folder before her first fetch needs it."""
    cache: Path = site["cache"]
    victim = ensure_user("imgpipe-dave")
    folder = cache / ".imgpipe" / "tmp" / f"u{victim}"
    assert _as(site, BOB, f"mkdir -m 700 {folder}").returncode == 0
    digest = _image(registry_server, "private")
    blobs = cache / ".imgpipe" / "blobs" / "sha256"
    manifest = requests.get(f"{registry_server.url}/v2/{REPO}/manifests/{digest}", timeout=30,
                            headers={"Accept": "application/vnd.docker.distribution.manifest"
                                     ".v2+json"}).json()
    layer = manifest["layers"][0]["digest"].split(":")[1]
    assert _as(site, BOB, f"mkfifo {blobs / layer}").returncode == 0
    done = _get(site, "imgpipe-dave", f"docker://head:5000#{REPO}@{digest}")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    [line] = [x for x in done.stderr.strip().splitlines() if "error" in x]
    assert f"{folder} is not your private folder (uid {site['uid'][BOB]}" in line, line
    (blobs / layer).unlink()
    folder.rmdir()


def test_the_step_record_is_private_and_release_removes_only_its_own(site, registry_server
                                                                    ) -> None:
    digest, genuine = _genuine(site, registry_server, "record")
    uses = site["cache"] / ".imgpipe" / "uses"
    mine = [p for p in uses.glob(f"{genuine.name}~*") if p.stat().st_uid == site["uid"][ALICE]]
    assert mine
    home_record = Path(f"/home/{ALICE}/.cache/imgpipe")
    assert home_record.stat().st_mode & 0o777 == 0o700
    records = list(home_record.glob("importer.*"))
    assert records and all(r.stat().st_mode & 0o777 == 0o600 for r in records)
    # bob's own use of the same entry stays when alice releases hers
    done = _get(site, BOB, f"docker://head:5000#{REPO}@{digest}")
    assert done.returncode == 0, done.stderr
    cluster = site["cluster"]
    for user in (ALICE, ALICE):
        released = cluster.run([str(site["bin"] / "imgpipe-pyxis-importer"), "release"],
                               user=user, host=cluster.spec.nodes[0], cwd="/tmp",
                               env={"IMGPIPE_CONFIG": str(site["config"])})
        assert released.returncode == 0, released.stderr
    left = list(uses.glob("*~*"))
    assert not [p for p in left if p.stat().st_uid == site["uid"][ALICE]
                and p.name.startswith(genuine.name)]
    assert [p for p in left if p.stat().st_uid == site["uid"][BOB]]


def test_a_lock_held_too_long_names_its_holder_escaped(site, registry_server, tmp_path) -> None:
    """bob holds the shared lock of a digest root wants to convert, its text a terminal
    escape: root's conversion gives up after enroot.lock_timeout_s, naming him escaped."""
    digest = _image(registry_server, "held")
    lock = site["cache"] / ".imgpipe" / "locks" / f"{digest.split(':')[1]}.lock"
    holder = subprocess.Popen(
        ["runuser", "-u", BOB, "--", "/usr/bin/python3", "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)\n"
         "os.write(fd, b'bob \\x1b]0;pwned\\x07 here')\n"
         "fcntl.lockf(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        config = tmp_path / "imgpipe.yaml"
        config.write_text(json.dumps({
            "registry": {"port": registry_server.port},
            "outputs": {"squashfs_dir": str(site["cache"])},
            "enroot": {"lock_timeout_s": 2}}))
        started = time.monotonic()
        done = subprocess.run([str(site["bin"] / "imgpipe"), "--config", str(config),
                               "convert", f"127.0.0.1:{registry_server.port}/{REPO}@{digest}"],
                              capture_output=True, text=True, timeout=120)
        assert time.monotonic() - started < 60
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert "held by bob \\x1b]0;pwned\\x07 here" in done.stderr, done.stderr
    assert "gave up after 2 s waiting for the lock" in done.stderr
    lock.unlink()


def test_a_forged_referrers_index_makes_gc_delete_nothing_that_stays(site, registry_server
                                                                    ) -> None:
    """The pusher tags an index ``sha256-<hex of nothing>`` that lists a production image
    as its artifact, and another that lists an index: gc deletes neither image, says what it
    skipped, and conversions and listings of the image still work."""
    from imgpipe.registry.client import RegistryClient
    from imgpipe.registry.inventory import remove_orphaned_artifacts

    production = _image(registry_server, "production")
    size = len(requests.get(f"{registry_server.url}/v2/{REPO}/manifests/{production}",
                            timeout=30, headers={"Accept": "application/vnd.docker."
                                                 "distribution.manifest.v2+json"}).content)
    forged = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
              "manifests": [{"mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                             "digest": production, "size": size,
                             "artifactType": "application/vnd.imgpipe.squashfs.v1"}]}
    nothing = "f" * 64
    script = (
        "import json, sys, urllib.request\n"
        f"forged = {forged!r}\n"
        "for number, tag in enumerate(sys.argv[1:]):\n"
        "    forged['annotations'] = {'n': str(number)}\n"
        "    body = json.dumps(forged).encode()\n"
        f"    request = urllib.request.Request('{registry_server.url}/v2/{REPO}/manifests/' + tag,"
        " data=body, method='PUT', headers={'Content-Type': "
        "'application/vnd.oci.image.index.v1+json'})\n"
        "    print(urllib.request.urlopen(request).status)\n")
    done = subprocess.run(["runuser", "-u", PUSHER, "--", "/usr/bin/python3", "-c", script,
                           f"sha256-{nothing}", f"sha256-{production.split(':')[1]}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["201", "201"], done.stderr
    client = RegistryClient(registry_server.url)
    removals = remove_orphaned_artifacts(client)
    assert client.manifest_digest(REPO, "production") == production  # still there
    mine = [r for r in removals if r.digest == f"sha256:{nothing}"]
    assert mine and production in mine[0].skipped and not mine[0].artifacts
    assert client.manifest_digest(REPO, f"sha256-{production.split(':')[1]}")  # not gc's
    # the forged entry under the image's own subject is skipped by a conversion, not fatal
    done = _get(site, CAROL, f"docker://head:5000#{REPO}@{production}")
    assert done.returncode == 0, done.stderr
    assert f"skipped referrer {production[:19]} of {REPO}: not a squashfs artifact" in done.stderr


@pytest.mark.parametrize(("what", "tree", "xattr", "refusal"), [
    ("a set-id file", {"usr/bin/evil": (0o4755, 0)}, False,
     "has a set-id file /usr/bin/evil (mode 4755) that the image's layers do not have"),
    ("a file of another owner", {"usr/bin/evil": (0o755, 4321)}, False,
     "owns files by uid/gid 4321, which no conversion makes"),
    ("extended attributes", {"usr/bin/evil": (0o755, 0)}, True,
     "has extended attributes (file capabilities live there), which no conversion makes"),
])
def test_a_pushers_artifact_is_checked_for_the_user_who_opted_in(site, registry_server,
                                                                 tmp_path, what, tree, xattr,
                                                                 refusal) -> None:
    digest = _image(registry_server, f"artifact-{len(what)}")
    blob = _publish_as_pusher(site, registry_server, digest, tree, tmp_path, xattr)
    config = _own_config(site, BOB, published_unpinned=True)
    done = _get(site, BOB, f"docker://head:5000#{REPO}@{digest}", config=config)
    assert done.returncode == 0, done.stderr
    assert f"refused published squashfs {blob[:19]}: the published squashfs {refusal}" in (
        done.stderr), done.stderr
    assert "squash with" in done.stderr  # converted instead


def test_what_a_user_opts_into_is_never_what_another_user_receives(site, registry_server,
                                                                    tmp_path) -> None:
    """bob opts in to unpinned artifacts in his own config, and pins the pusher's file in
    his own environment: he gets it, under his own name; carol gets the genuine bytes."""
    digest, genuine = _genuine(site, registry_server, "optin")
    genuine_bytes = _sha256(genuine)
    blob = _publish_as_pusher(site, registry_server, digest, {"usr/bin/tool": (0o755, 0)},
                              tmp_path)
    config = _own_config(site, BOB, published_unpinned=True)
    for env in ({}, {"IMGPIPE_SQUASHFS_PINS": f"{digest}={blob}"}):
        done = _get(site, BOB, f"docker://head:5000#{REPO}@{digest}", config=config, env=env)
        assert done.returncode == 0, done.stderr
        got = Path(done.stdout.strip())
        assert got.name.endswith(f"+squashfs-sha256-{blob[7:]}.u{site['uid'][BOB]}.sqsh"), got
        assert _sha256(got) == blob
    for env in ({}, {"IMGPIPE_SQUASHFS_PINS": f"{digest}={blob}"}):
        done = _get(site, CAROL, f"docker://head:5000#{REPO}@{digest}", env=env)
        assert done.returncode == 0, done.stderr
        got = Path(done.stdout.strip())
        assert got.stat().st_uid != site["uid"][BOB]
        if env:  # carol pinned the pusher's file herself: she fetches it, into her own name
            assert got.name.endswith(f".u{site['uid'][CAROL]}.sqsh") and _sha256(got) == blob
        else:
            assert "is not pinned: converting" in done.stderr, done.stderr
            assert _sha256(got) == genuine_bytes
    private = site["cache"] / ".imgpipe" / "tmp" / f"u{site['uid'][CAROL]}"
    done = _as(site, BOB, f"ln /home/{BOB}/imgpipe.yaml {private}/sqsh-{blob[7:]}.part")
    assert done.returncode != 0  # no hard link (or anything) planted at her partial download


def test_a_record_folder_another_user_made_is_not_used(site, registry_server) -> None:
    digest = _image(registry_server, "xdg")
    planted = Path(f"/tmp/imgpipe-xdg-{os.getpid()}")
    assert _as(site, BOB, f"mkdir -m 777 {planted}").returncode == 0
    done = _get(site, CAROL, f"docker://head:5000#{REPO}@{digest}",
                env={"XDG_RUNTIME_DIR": str(planted), "SLURM_JOB_ID": "77"})
    assert done.returncode == 0, done.stderr
    assert not list(planted.iterdir())  # nothing of carol's in bob's folder
    assert list(Path(f"/home/{CAROL}/.cache/imgpipe").glob("importer.*.77.*"))
    shutil.rmtree(planted)


def test_registry_ls_lists_past_a_forged_index(site, registry_server, tmp_path) -> None:
    """An index the pusher tags under an image's subject that names another index: listed
    images are listed, the forgery skipped."""
    production = _image(registry_server, "listed")
    size = len(requests.get(f"{registry_server.url}/v2/{REPO}/manifests/{production}",
                            timeout=30, headers={"Accept": "application/vnd.docker."
                                                 "distribution.manifest.v2+json"}).content)
    inner = json.dumps({"schemaVersion": 2,
                        "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": [{"mediaType": "application/vnd.docker.distribution."
                                       "manifest.v2+json", "digest": production, "size": size}]})
    outer = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": "application/vnd.oci.image.index.v1+json",
                            "digest": services.digest_of(inner.encode()),
                            "size": len(inner), "artifactType":
                            "application/vnd.imgpipe.squashfs.v1"}]}
    for tag, body in (("inner-index", inner), (f"sha256-{production[7:]}", json.dumps(outer))):
        requests.put(f"{registry_server.url}/v2/{REPO}/manifests/{tag}", data=body, timeout=30,
                     headers={"Content-Type": "application/vnd.oci.image.index.v1+json"}
                     ).raise_for_status()
    config = tmp_path / "imgpipe.yaml"
    config.write_text(json.dumps({"registry": {"port": registry_server.port}}))
    done = subprocess.run([str(site["bin"] / "imgpipe"), "--config", str(config), "registry",
                           "ls"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith(f"{REPO}  ")]
    assert "listed" in line.split("  ")[1].split(", "), done.stdout


def test_the_service_account_converts_once_for_every_user(site, shared_writer,
                                                          registry_server) -> None:
    digest = _image(registry_server, "writer")
    uri = f"docker://head:5000#{REPO}@{digest}"
    first = _get(site, ALICE, uri, config=shared_writer["config"])
    assert first.returncode == 0, first.stderr
    assert f"asking {SERVICE} to convert" in first.stderr
    path = Path(first.stdout.strip())
    assert path.name == f"tenants+img+sha256-{digest[7:]}+zstd-f2.sqsh"  # the shared name
    assert path.stat().st_uid == shared_writer["uid"] and path.stat().st_mode & 0o777 == 0o644
    second = _get(site, BOB, uri, node=1, config=shared_writer["config"])
    assert second.returncode == 0 and second.stdout.strip() == str(path), second.stderr
    assert "squash with" not in second.stderr and "asking" not in second.stderr


def test_the_writer_is_a_narrow_path(site, shared_writer, tmp_path) -> None:
    """bob may run the writer as the service account, but only with the site's config and
    one REPOSITORY@sha256:HEX argument: his own config, another program or an argument of
    another form is refused."""
    writer, config = shared_writer["writer"], shared_writer["config"]
    evil = Path(f"/home/{BOB}/writer.yaml")
    evil.write_text(json.dumps({"outputs": {"squashfs_dir": f"/home/{BOB}"}}))
    os.chown(evil, site["uid"][BOB], -1)
    for argv, refusal in (
            ([str(writer), "--config", str(evil), f"{REPO}@sha256:{'0' * 64}"], "password"),
            (["/bin/sh", "-c", "id"], "password"),
            ([str(writer), "--config", str(config), "../../etc/passwd@sha256:00"],
             "the cache writer takes REPOSITORY@sha256:HEX"),
            ([str(writer), "--config", str(config), f"{REPO}:latest"],
             "the cache writer takes REPOSITORY@sha256:HEX")):
        done = _as(site, BOB, f"sudo -n -u {SERVICE} " + " ".join(map(shlex.quote, argv)))
        assert done.returncode != 0, argv
        assert refusal in done.stderr, (argv, done.stderr)
    assert "Traceback" not in done.stderr
