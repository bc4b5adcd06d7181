"""Recipe bundles published to the registry as OCI artifacts and pulled back."""

from __future__ import annotations

import json
import os

PINNED = "head:5000/imgpipe/bert@sha256:" + "ab" * 32


def test_publish_then_pull_round_trips_byte_for_byte(cli, registry_server, tmp_path) -> None:
    cli.write_config({"registry": {"port": registry_server.port}})
    rendered = tmp_path / "rendered"
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "4", "--image",
                       PINNED, "-o", str(rendered))
    assert code == 0, err
    name = "imgpipe/bert-recipes:0.1.0"
    code, out, err = cli("recipes", "publish", str(rendered), "--name", name, "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["digest"].startswith("sha256:")
    pulled = tmp_path / "pulled"
    code, out, err = cli("recipes", "pull", name, "-o", str(pulled), "--json")
    assert code == 0, err
    originals = sorted(p.name for p in rendered.iterdir())
    assert sorted(p.name for p in pulled.iterdir()) == originals
    for file in originals:
        assert (pulled / file).read_bytes() == (rendered / file).read_bytes(), file
    assert os.access(pulled / "run.sub", os.X_OK)


def test_pulling_a_missing_tag_fails_clearly(cli, registry_server, tmp_path) -> None:
    cli.write_config({"registry": {"port": registry_server.port}})
    code, _, err = cli("recipes", "pull", "imgpipe/bert-recipes:nope", "-o", str(tmp_path / "x"))
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"error: no recipe bundle {registry_server.address}/imgpipe/bert-recipes:nope in the "
        "registry (hint: list tags: imgpipe registry tags imgpipe/bert-recipes)")
    assert not (tmp_path / "x").exists()


def test_pulling_a_container_image_is_refused_before_any_download(cli, registry_server,
                                                                  tmp_path) -> None:
    """`recipes pull` of a plain image reference once downloaded its layers and exited 0."""
    import gzip

    from tests import services

    layer = gzip.compress(b"\0" * 4096)
    services.push_image(services.plain_session(), registry_server.url, "someone/app", "1",
                        [layer])
    cli.write_config({"registry": {"port": registry_server.port}})
    code, out, err = cli("recipes", "pull", "someone/app:1", "-o", str(tmp_path / "x"))
    assert code == 1, (out, err)
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: {registry_server.address}/someone/app:1 is a container "
                           "image (1 layers,") and "not an imgpipe recipe bundle" in line
    assert not (tmp_path / "x").exists()
