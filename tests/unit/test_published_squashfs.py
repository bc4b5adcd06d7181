"""The rules a squashfs published beside its image is held to, without a registry: which
pins name it, what a fetched file may hold, and that recipes carry the pins to the nodes."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

from imgpipe.enroot.errors import ConvertError
from imgpipe.enroot.published.contents import check_contents
from imgpipe.enroot.published.pins import PINS_ENV, Pins
from imgpipe.enroot.published.policy import PublishedPolicy
from imgpipe.registry.referrers import is_referrers_tag, referrers_tag

IMAGE = "sha256:" + "a" * 64
SQUASHFS = "sha256:" + "b" * 64
OTHER = "sha256:" + "c" * 64


def test_pins_name_a_squashfs_per_image_digest_and_ignore_anything_else() -> None:
    text = Pins.of({IMAGE: SQUASHFS, OTHER: OTHER}).text()
    assert Pins.parse(text).for_image(IMAGE) == {SQUASHFS}
    assert Pins.parse(text).for_image("sha256:" + "d" * 64) == frozenset()
    # A value that is no digest pins nothing (never "any squashfs").
    assert Pins.parse(f"{IMAGE}= {IMAGE}=sha256:short {IMAGE}=md5:{'b' * 64}").for_image(
        IMAGE) == set()
    policy = PublishedPolicy().pinned_for(IMAGE, {PINS_ENV: text})
    assert policy.pins == {SQUASHFS} and policy.use and not policy.unpinned
    assert PublishedPolicy().pinned_for(IMAGE, {}).pins == frozenset()


def test_the_referrers_tag_schema_names() -> None:
    assert referrers_tag(IMAGE) == "sha256-" + "a" * 64
    assert is_referrers_tag(referrers_tag(IMAGE))
    assert is_referrers_tag(referrers_tag(IMAGE) + ".zstd.sqsh")
    assert not is_referrers_tag("1.0.0") and not is_referrers_tag("sha256-abc")


def _squashfs(tmp_path: Path, *members: tarfile.TarInfo) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info in members:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    out = tmp_path / "image.sqsh"
    subprocess.run(["tar2sqfs", "--quiet", "--no-skip", "--compressor", "zstd", str(out)],
                   input=buffer.getvalue(), check=True, capture_output=True, timeout=60)
    return out


def _member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, mode
    info.size = 3 if kind == tarfile.REGTYPE else 0
    return info


def test_a_fetched_squashfs_with_a_device_file_is_refused_even_when_pinned(tmp_path: Path
                                                                          ) -> None:
    device = _member("dev/evil", tarfile.CHRTYPE, 0o666)
    device.devmajor, device.devminor = 1, 3
    path = _squashfs(tmp_path, _member("usr/", tarfile.DIRTYPE, 0o755), device)
    with pytest.raises(ConvertError, match="holds chrdev /dev/evil"):
        check_contents(path, None)


def test_a_setuid_file_the_layers_lack_is_refused(tmp_path: Path) -> None:
    path = _squashfs(tmp_path, _member("usr/bin/su", mode=0o4755),
                     _member("usr/bin/with space", mode=0o2755), _member("etc/x"))
    with pytest.raises(ConvertError, match="set-id file /usr/bin/su .*4755"):
        check_contents(path, set())
    with pytest.raises(ConvertError, match="set-id file /usr/bin/with space"):
        check_contents(path, {"usr/bin/su"})
    assert check_contents(path, {"usr/bin/su", "usr/bin/with space"}) >= 3
    assert check_contents(path, None) >= 3  # pinned: the publisher's conversion made it


def test_recipes_carry_the_locks_squashfs_pin_to_the_nodes(cli, tmp_path: Path) -> None:
    """A lock whose bert digest has a published squashfs pinned: every script exports it for
    the importer Pyxis runs with the job's environment."""
    cli.write_config({"registry": {"host": "head", "port": 5000}, "default_flavor": "cpu"})
    entry = {"repository": "head:5000/imgpipe/bert", "tags": ["1"], "digest": IMAGE,
             "config_digest": OTHER, "input_hash": "x", "inputs": {}, "flavor": "cpu",
             "base": "debian", "pushed_at": "2026-11-24T00:00:00+00:00",
             "squashfs_digests": {"zstd": SQUASHFS, "lz4": OTHER}}
    (cli.folder / "imgpipe.lock").write_text(json.dumps(
        {"version": 1, "images": {"bert": {"cpu": entry}}}))
    code, out, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "2", "--flavor",
                         "cpu", "-o", str(tmp_path / "out"))
    assert code == 0, out + err
    for name in ("run.sub", "dataset.sub", "nccl.sub"):
        script = (tmp_path / "out" / name).read_text()
        assert f"export {PINS_ENV}={shlex.quote(f'{IMAGE}={SQUASHFS}')}\n" in script, name
