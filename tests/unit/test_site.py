"""A site in one command: `imgpipe site init` writes a config and a profile every command
reads back; `recipes profile new` copies one to edit; `recipes profile check` names each way
a profile differs from the node."""

from __future__ import annotations

from pathlib import Path

import yaml

from imgpipe.base.configlayers import load_settings
from imgpipe.recipes.profilecheck import NodeFacts, check
from imgpipe.recipes.profiles import load_profile


def test_site_init_writes_a_config_and_profile_that_load(cli, tmp_path: Path) -> None:
    ca = tmp_path / "site-ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = tmp_path / "etc" / "imgpipe.yaml"
    code, out, err = cli("site", "init", "--registry", "head:5443", "--registry-ca", str(ca),
                         "--squashfs-dir", "/lustre/imgpipe/sq", "--partition", "gpu",
                         "--data-root", "/lustre/bert", "--from", "dgx-a100", "--hcas",
                         "mlx5_0,mlx5_1", "--gpus-per-node", "4", "--cores-per-node", "64",
                         "--distribution", "shared", "--config", str(config))
    assert code == 0, out + err
    settings = load_settings(cwd=tmp_path, site=config)
    assert settings.registry.url == "https://head:5443" and settings.registry.ca_file == ca
    assert settings.default_flavor == "ngc" and settings.recipes.partition == "gpu"
    assert settings.recipes.results_dir == "/lustre/bert/results"
    profile = load_profile("site", settings.recipes.profiles_dir)
    assert (profile.gpus_per_node, profile.hcas, profile.cores_per_node, profile.partition) == (
        4, ["mlx5_0", "mlx5_1"], 64, "gpu")
    assert profile.gpu.model == "A100-SXM4-80GB"
    code, out, err = cli("site", "init", "--registry", "head:5443", "--registry-ca", str(ca),
                         "--squashfs-dir", "/lustre/imgpipe/sq", "--partition", "gpu",
                         "--data-root", "/lustre/bert", "--from", "dgx-a100", "--hcas",
                         "mlx5_0,mlx5_1", "--gpus-per-node", "4", "--cores-per-node", "64",
                         "--distribution", "shared", "--config", str(config))
    assert code == 0 and "as answered already" in out, err  # the same answers: idempotent
    code, out, err = cli("site", "init", "--registry", "head", "--plain-http", "--squashfs-dir",
                         "/x", "--partition", "p", "--data-root", "/d", "--config", str(config),
                         "--distribution", "shared")
    assert code == 2 and f"{config} exists already, with other values" in err
    assert "--force" in err


def test_site_init_asks_for_tls_or_says_what_plain_http_costs(cli, tmp_path: Path) -> None:
    code, _, err = cli("site", "init", "--registry", "head", "--squashfs-dir", "/x",
                       "--partition", "p", "--data-root", "/d", "--config",
                       str(tmp_path / "c.yaml"), "--distribution", "shared")
    assert code == 2 and "--registry-ca FILE" in err
    # Before, this said every node then needs ENROOT_ALLOW_HTTP: the importer does not.
    assert "importer fetches over http by itself" in err and "on every node" not in err
    assert not (tmp_path / "c.yaml").exists()
    code, out, _ = cli("site", "init", "--help")
    assert "every node then needs" not in out and "importer" in out


def _site(cli, tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    return cli("site", "init", "--registry", "head", "--plain-http", "--squashfs-dir",
               str(tmp_path / "var-tmp" / "imgpipe"), "--partition", "p", "--data-root", "/d",
               "--config", str(tmp_path / "etc" / "imgpipe.yaml"), *extra)


def test_a_node_local_squashfs_folder_must_say_how_images_reach_the_nodes(cli, tmp_path: Path
                                                                          ) -> None:
    """Before, site init never wrote enroot.distribution: a node-local folder stayed
    `shared`, and every node but the first converted for itself."""
    code, _, err = _site(cli, tmp_path)
    assert code == 2 and "a disk of this host alone" in err and "--distribution sbcast" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "etc").exists()
    code, _, err = _site(cli, tmp_path, "--distribution", "sbcast", "--pyxis-importer")
    assert code == 0, err
    settings = load_settings(cwd=tmp_path, site=tmp_path / "etc" / "imgpipe.yaml")
    assert settings.enroot.distribution == "sbcast" and settings.enroot.pyxis_importer is True


def test_answers_that_cannot_work_together_are_refused(cli, tmp_path: Path) -> None:
    code, _, err = _site(cli, tmp_path, "--distribution", "fetch", "--no-pyxis-importer")
    assert code == 2 and "cannot work together" in err and "node-config --accept importer" in err
    assert not (tmp_path / "etc" / "imgpipe.yaml").exists()


def test_a_cluster_file_system_is_shared(tmp_path: Path) -> None:
    from imgpipe.base.mounts import filesystem_type, is_shared_type

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"
        "40 22 0:51 / /lustre rw,relatime shared:20 - lustre 10.0.0.1@o2ib:/fs rw\n"
        "41 22 0:52 / /var/tmp rw shared:21 - tmpfs tmpfs rw\n"
        "42 22 0:53 / /home/with\\040space rw - nfs4 srv:/home rw\n")
    assert filesystem_type(Path("/lustre/imgpipe/squashfs"), mountinfo) == "lustre"
    assert filesystem_type(Path("/var/tmp/imgpipe"), mountinfo) == "tmpfs"
    assert filesystem_type(Path("/home/with space/x"), mountinfo) == "nfs4"
    assert filesystem_type(Path("/opt"), mountinfo) == "ext4"
    assert is_shared_type("lustre") and is_shared_type("fuse.sshfs")
    assert not is_shared_type("tmpfs") and not is_shared_type(None)


def test_config_show_says_what_cannot_work_together(cli) -> None:
    """squashfuse makes nodes ask for lz4; publishing zstd alone meant every node converted,
    silently (docs/configuration.md's own example did it)."""
    cli.write_config({"enroot": {"squashfuse": True, "publish_compressions": ["zstd"]}})
    code, out, err = cli("config", "show")
    assert code == 0, err
    [warning] = [line for line in out.splitlines() if line.startswith("warning:")]
    assert "lacks lz4, the compression nodes ask for (enroot.squashfuse: true)" in warning
    cli.write_config({"enroot": {"squashfuse": True, "publish_compressions": ["zstd", "lz4"]}})
    code, out, _ = cli("config", "show")
    assert "warning:" not in out


def test_profile_new_copies_one_to_edit(cli, tmp_path: Path) -> None:
    code, out, err = cli("recipes", "profile", "new", "ours", "--from", "dgx1", "-o",
                         str(tmp_path / "profiles"))
    assert code == 0, out + err
    written = yaml.safe_load((tmp_path / "profiles" / "ours.yaml").read_text())
    assert written["name"] == "ours" and written["hcas"] == load_profile("dgx1").hcas
    assert load_profile("ours", tmp_path / "profiles").gpus_per_node == 8
    code, _, err = cli("recipes", "profile", "new", "ours", "-o", str(tmp_path / "profiles"))
    assert code == 2 and "exists already" in err


def test_profile_check_names_each_mismatch() -> None:
    h100 = load_profile("dgx-h100")
    node = NodeFacts(partitions=["debug", "gpu"], hcas=["mlx5_0", "mlx5_1", "mlx5_2"],
                     gpus=[("NVIDIA H100 80GB HBM3", 81559)] * 4, cores=112)
    found = check(h100, node)
    assert not found.ok
    assert "partition: the profile says batch, sinfo lists debug, gpu" in found.mismatches
    assert any(line.startswith("hcas: the profile names mlx5_3, mlx5_4") for line in
               found.mismatches)
    assert "gpus_per_node: the profile says 8, nvidia-smi lists 4" in found.mismatches
    assert "cores_per_node: 112 logical CPUs" in found.matched
    same = NodeFacts(partitions=["batch"], hcas=sorted(h100.hcas),
                     gpus=[("NVIDIA H100 80GB HBM3", 81559)] * 8, cores=112)
    assert check(h100, same).ok
    unknown = check(h100, NodeFacts(None, None, None, 112))
    assert unknown.ok and len(unknown.unchecked) == 3


def test_the_shipped_dgx_h100_profile_passes_on_a_hyper_threaded_node_with_storage_hcas(
        tmp_path: Path) -> None:
    """A DGX H100 as it boots: 2 x 56 cores with two threads each (224 logical CPUs), and
    two storage HCAs beside the eight compute rails.  Neither is a mismatch: the profile
    counts cores, and NCCL is meant to leave storage HCAs alone."""
    from imgpipe.recipes.profilecheck import physical_cores

    cpus = tmp_path / "cpu"
    for cpu in range(224):  # Linux numbers the second thread of each core after the first
        topology = cpus / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{(cpu % 112) // 56}\n")
        (topology / "core_id").write_text(f"{cpu % 56}\n")
    assert physical_cores(cpus) == 112
    h100 = load_profile("dgx-h100")
    node = NodeFacts(partitions=["batch"], hcas=sorted([*h100.hcas, "mlx5_1", "mlx5_2"]),
                     gpus=[("NVIDIA H100 80GB HBM3", 81559)] * 8, cores=224,
                     physical_cores=physical_cores(cpus))
    found = check(h100, node)
    assert found.ok, found.mismatches
    assert "cores_per_node: 112 cores (224 hardware threads)" in found.matched
    [extra] = [line for line in found.unchecked if line.startswith("hcas:")]
    assert "mlx5_1, mlx5_2" in extra and "NCCL will not use them" in extra
    wrong = check(h100, NodeFacts(["batch"], sorted(h100.hcas), None, 96, 48))
    assert "cores_per_node: the profile says 112, this node has 48 cores, 96 logical CPUs" \
        in wrong.mismatches


def test_site_init_names_the_caches_service_account(cli, tmp_path: Path) -> None:
    """Lustre or NFS with root squash: the service account, not root, makes the layout, and
    the site config says so (docs/first-hour.sh's CACHE_OWNER)."""
    code, _, err = _site(cli, tmp_path, "--distribution", "shared", "--cache-owner",
                         "imgpipe-cache")
    assert code == 0, err
    config = yaml.safe_load((tmp_path / "etc" / "imgpipe.yaml").read_text())
    assert config["enroot"]["cache_owner"] == "imgpipe-cache"
