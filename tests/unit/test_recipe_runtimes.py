"""One job description, three runtimes: the rendered scripts are run by bash with a
recording `srun`, and what each runtime hands the program is compared.

The fake `srun` stands in only for the launch (the real one runs these scripts in
tests/test_cluster_e2e.py); everything before it — defaults, path translation, mounts,
checks — is the rendered script's own bash, executed for real.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from imgpipe.base.configlayers import load_settings
from imgpipe.enroot.nodeconfig import detect_pyxis, parse_version, render
from imgpipe.recipes.ncclscript import check_program
from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, max_bytes, render_bundle
from imgpipe.recipes.scaling import shape_for

FAKE_SRUN = """#!/bin/bash
# Records its argv (NUL-separated, one file per call) and succeeds.
n=$(ls "$RECORD" | wc -l)
printf '%s\\0' "$@" > "$RECORD/$n"
"""


def _world(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / "site" / name for name in
             ("data", "ckpt", "results", "source", "bin", "record")}
    for path in paths.values():
        path.mkdir(parents=True)
    paths["vocab"] = tmp_path / "site" / "vocab.txt"
    paths["vocab"].write_text("[PAD]\n")
    paths["config"] = tmp_path / "site" / "bert.json"
    paths["config"].write_text("{}")
    for tool in ("srun", "scontrol"):
        script = paths["bin"] / tool
        script.write_text(FAKE_SRUN)
        script.chmod(0o755)
    return paths


def _calls(record: Path) -> list[list[str]]:
    return [(record / str(i)).read_bytes().decode().split("\0")[:-1]
            for i in range(len(list(record.iterdir())))]


def _run(tmp_path: Path, runtime: str, script: str, phase: int | None = None,
         extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str],
                                                           list[list[str]], dict[str, Path]]:
    paths = _world(tmp_path / runtime)
    bundle = render_bundle(RecipeInputs(
        load_profile("local"), 2, "/images/bert.sqsh", runtime=runtime,
        data_dir=str(paths["data"]), checkpoint_dir=str(paths["ckpt"]),
        results_dir=str(paths["results"]), dataset_source=str(paths["source"]),
        vocab=str(paths["vocab"]), bert_config=str(paths["config"])),
        tmp_path / runtime / "recipes")
    folder = tmp_path / runtime / "recipes"
    sourced = ""
    if phase is not None:
        sourced = f"source {folder / bundle.shapes[phase - 1].config_name} && "
    env = {"PATH": f"{paths['bin']}:/usr/bin:/bin", "RECORD": str(paths["record"]),
           "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "bert-pretrain", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS": "4", **(extra_env or {})}
    done = subprocess.run(["bash", "-c", f"{sourced}bash {folder / script}"],
                          capture_output=True, text=True, env=env, timeout=60)
    return done, _calls(paths["record"]), paths


def _program_and_mounts(runtime: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(what the program receives, {container path: host path}) from one srun argv."""
    mounts: dict[str, str] = {}
    if runtime == "pyxis":
        options = [a for a in argv if a.startswith("--container-mounts=")]
        for item in options[0].split("=", 1)[1].split(","):
            source, target = item.split(":")[:2]
            mounts[target] = source
        return argv[argv.index("--no-container-mount-home") + 1:], mounts
    if runtime == "charliecloud":
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag == "-b":
                source, target = value.split(":")
                mounts[target] = source
        return argv[argv.index("--") + 5:], mounts  # after: -- /bin/sh -c START sh
    return argv[argv.index("--kill-on-bad-exit=1") + 1:], mounts


@pytest.mark.parametrize(("script", "phase"), [("dataset.sub", None), ("run.sub", 1),
                                                ("run.sub", 2)])
def test_pyxis_and_charliecloud_hand_the_program_the_same_container_paths(
        tmp_path: Path, script: str, phase: int | None) -> None:
    seen = {}
    for runtime in ("pyxis", "charliecloud"):
        done, calls, paths = _run(tmp_path, runtime, script, phase)
        assert done.returncode == 0, done.stderr
        [call] = calls
        program, mounts = _program_and_mounts(runtime, call)
        site = str(paths["data"].parent)
        assert not [a for a in program if site in a], program  # no host path inside
        seen[runtime] = (program, {k: v.replace(f"/{runtime}/", "/") for k, v in
                                   mounts.items()})
    assert seen["pyxis"] == seen["charliecloud"]
    program, mounts = seen["pyxis"]
    assert program[:2] == ["python3", "-m"]
    if script == "run.sub":
        assert f"--config_file=/config/{paths['config'].name}" in program
        assert "--output_dir=/checkpoints" in program
    if phase == 2:  # phase 1's checkpoints, where the container sees them
        assert "--init_checkpoint=/checkpoints" in program
    if script == "dataset.sub":
        assert "--vocab=/vocab/vocab.txt" in program
        assert mounts["/vocab"].endswith("/site")


def test_the_host_runtime_hands_host_paths(tmp_path: Path) -> None:
    done, [call], paths = _run(tmp_path, "host", "run.sub", 2,
                               {"PYTHON": "/opt/venv/bin/python"})
    assert done.returncode == 0, done.stderr
    program, mounts = _program_and_mounts("host", call)
    assert mounts == {} and program[0] == "/opt/venv/bin/python"
    assert f"--init_checkpoint={paths['ckpt']}" in program
    assert f"--config_file={paths['config']}" in program


def test_an_init_checkpoint_elsewhere_is_mounted_not_passed_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "old-run" / "phase1"
    elsewhere.mkdir(parents=True)
    done, [call], _ = _run(tmp_path, "charliecloud", "run.sub", 2,
                           {"INIT_CHECKPOINT": str(elsewhere)})
    assert done.returncode == 0, done.stderr
    program, mounts = _program_and_mounts("charliecloud", call)
    assert "--init_checkpoint=/init" in program and mounts["/init"] == str(elsewhere)


def test_phase1_starts_from_init_checkpoint_when_one_is_set(tmp_path: Path) -> None:
    """Continued pre-training: INIT_CHECKPOINT (public weights) mounted in phase 1 too, with
    TRUST_CHECKPOINT passed on; unset, phase 1 starts from fresh weights."""
    public = tmp_path / "bert-base-uncased"
    public.mkdir()
    done, [call], _ = _run(tmp_path, "pyxis", "run.sub", 1,
                           {"INIT_CHECKPOINT": str(public), "TRUST_CHECKPOINT": "1"})
    assert done.returncode == 0, done.stderr
    program, mounts = _program_and_mounts("pyxis", call)
    assert "--init_checkpoint=/init" in program and mounts["/init"] == str(public)
    assert "--trust_checkpoint" in program and "--phase2" not in program
    done, [call], _ = _run(tmp_path / "plain", "pyxis", "run.sub", 1)
    program, _ = _program_and_mounts("pyxis", call)
    assert not [a for a in program if a.startswith(("--init_checkpoint", "--trust"))]


def test_nccl_sub_records_the_nccl_tests_image_it_runs_in(tmp_path: Path) -> None:
    """With an nccl-tests image of its own, nccl.sub records that image and its digest
    (tests/unit/test_report_page.py: the bert image, for every job of the demo)."""
    nccl = "head:5000/nccl-tests@sha256:" + "e" * 64
    render_bundle(RecipeInputs(load_profile("local"), 2, "/images/bert.sqsh", nccl_image=nccl,
                               results_dir=str(tmp_path / "results"),
                               image_digest="sha256:" + "b" * 64), tmp_path / "recipes")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/bash\nexit 0\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "recipes" / "nccl.sub")], capture_output=True,
                          text=True, timeout=60, env={
                              "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_JOB_ID": "9",
                              "SLURM_JOB_NAME": "nccl-check"})
    assert done.returncode == 0, done.stderr
    assert f"nccl.sub: image head:5000#nccl-tests@sha256:{'e' * 64}" in done.stderr
    record = json.loads((tmp_path / "results" / "nccl-check-9" / "ran_in.json").read_text())
    assert record == {"job": "nccl-check", "id": "9", "image": nccl.replace("/", "#", 1),
                      "image_digest": "sha256:" + "e" * 64,
                      "profile": {"name": "local", "busbw_gbs": 0.05, "gpus_per_node": 2}}


def test_run_sub_refuses_an_allocation_other_than_its_config(tmp_path: Path) -> None:
    done, calls, _ = _run(tmp_path, "pyxis", "run.sub", 1,
                          {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"})
    assert done.returncode == 2 and calls == []
    assert "the config is for 2 node(s) x 2 task(s)" in done.stderr
    assert "sbatch -N2 --ntasks-per-node=2 run.sub" in done.stderr


def test_run_sub_requeues_when_the_trainer_leaves_a_stop_record(tmp_path: Path) -> None:
    done, calls, paths = _run(tmp_path, "pyxis", "run.sub", 1)
    assert done.returncode == 0 and len(calls) == 1  # no record: no requeue
    results = paths["results"] / "bert-pretrain-77"
    # This time the "trainer" stops on a signal: it leaves the record and exits 0.
    (paths["bin"] / "srun").write_text(FAKE_SRUN + f'touch {results / "stopped"}\n')
    folder = tmp_path / "pyxis" / "recipes"
    config = next(folder.glob("config_2x2x4x*.sh"))
    env = {"PATH": f"{paths['bin']}:/usr/bin:/bin", "RECORD": str(paths["record"]),
           "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "bert-pretrain", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS": "4"}
    again = subprocess.run(["bash", "-c", f"source {config} && bash {folder / 'run.sub'}"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "requeueing job 77" in again.stderr
    assert ["requeue", "77"] in _calls(paths["record"])


def test_nccl_check_runs_with_a_bare_python(tmp_path: Path) -> None:
    """The check embedded in nccl.sub needs no imgpipe: Debian's python3, nothing else."""
    log = tmp_path / "nccl.log"
    log.write_text("\n".join([
        "# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1048576 step: 2(factor) warmup iters: 5"
        " iters: 20 agg iters: 1 validation: 1 graph: 0",
        "#  Rank  0 Group  0 Pid  10 on      node1 device  0 [0x00] cpu",
        "#  Rank  1 Group  0 Pid  11 on      node2 device  0 [0x00] cpu",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        "     time   algbw   busbw #wrong",
        "     1048576        262144     float     sum      -1   1000.0    1.05    1.05      0"
        "   1000.0    1.05    1.05      0",
        "# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 1.05", ""]))
    program = check_program("local", 0.05)
    done = subprocess.run(["/usr/bin/python3", "-I", "-", str(log), "2"], input=program,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("PASS: all_reduce on 2 rank(s) / 2 node(s)")
    failing = subprocess.run(["/usr/bin/python3", "-I", "-", str(log), "2"],
                             input=check_program("dgx1", 42.0), capture_output=True, text=True)
    assert failing.returncode == 1 and failing.stdout.startswith("FAIL:")


def test_nccl_sub_sets_what_the_transport_report_and_mpi_need(tmp_path: Path) -> None:
    render_bundle(RecipeInputs(load_profile("dgx1"), 2, "/images/nccl.sqsh"), tmp_path)
    script = (tmp_path / "nccl.sub").read_text()
    assert 'export NCCL_DEBUG="${NCCL_DEBUG:-INFO}"' in script
    assert 'step=(--mpi="${SRUN_MPI:-pmix}")' in script
    assert 'MAX_BYTES="${MAX_BYTES:-4G}"' in script  # 2 x 4G fits a 16 GB V100
    assert "export MELLANOX_VISIBLE_DEVICES=all" in script
    assert "imgpipe nccl check" not in script


@pytest.mark.parametrize(("profile", "expected"), [("dgx1", "4G"), ("dgx2", "8G"),
                                                   ("dgx-h100", "8G"), ("local", "64M")])
def test_largest_message_fits_the_gpu(profile: str, expected: str) -> None:
    assert max_bytes(load_profile(profile)) == expected


def test_gpu_counts_that_do_not_divide_the_batch_can_be_adjusted() -> None:
    shape = shape_for(load_profile("dgx1"), 3, 1, adjust_global_batch=True)
    assert shape.gpus == 24 and shape.global_batch == 65520
    assert shape.per_gpu_batch * shape.gpus == shape.global_batch
    assert shape.micro_batch * shape.accumulation == shape.per_gpu_batch


PINNED = "head:5000/imgpipe/bert@sha256:" + "ab" * 32


def test_render_refuses_a_gpu_profile_on_the_cpu_default(cli) -> None:
    code, _, err = cli("recipes", "render", "--profile", "dgx-h100", "--nodes", "1")
    assert code == 2
    assert "dgx-h100 is a GPU profile but the default flavor is cpu" in err


def test_render_refuses_a_registry_compute_nodes_cannot_reach(cli, tmp_path: Path) -> None:
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "1", "--image",
                       "127.0.0.1:5000/imgpipe/bert@sha256:" + "ab" * 32, "-o",
                       str(tmp_path / "out"))
    assert code == 2 and "which compute nodes cannot reach" in err
    assert not (tmp_path / "out").exists()


def test_render_adjusts_the_batch_only_when_asked(cli, tmp_path: Path) -> None:
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "3", "--image",
                       PINNED, "-o", str(tmp_path / "a"))
    assert code == 2 and "--adjust-global-batch" in err
    code, out, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "3", "--image",
                         PINNED, "--adjust-global-batch", "-o", str(tmp_path / "b"), "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["shapes"][0]["global_batch"] == 65520


def _settings(tmp_path: Path):
    (tmp_path / "imgpipe.yaml").write_text("registry: {host: head}\n")
    return load_settings(str(tmp_path / "imgpipe.yaml"))


def test_node_config_follows_the_pyxis_version(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    old = render(settings, "/usr/local/bin/imgpipe-pyxis-importer", parse_version("0.20"),
                 enroot_path="/usr/bin/enroot")
    [line] = [x for x in old.plugstack_conf.splitlines() if x.startswith("required")]
    assert "importer=" not in old.plugstack_conf.split("# note")[0]
    assert "container_scope=job" not in line and "#   container_scope=job" in old.plugstack_conf
    new = render(settings, "/usr/local/bin/imgpipe-pyxis-importer", parse_version("v0.24.0"),
                 enroot_path="/usr/bin/enroot")
    assert "importer=/usr/local/bin/imgpipe-pyxis-importer" in new.plugstack_conf
    unknown = render(settings, "/x", None, enroot_path="/usr/bin/enroot")
    assert "importer=" not in unknown.plugstack_conf.split("# note")[0]
    # nothing of the site's Enroot is needed; what would change every user's jobs is an
    # option, commented out, with the reason
    assert [x for x in new.enroot_conf.splitlines() if not x.startswith("#")] == []
    assert "#ENROOT_ALLOW_HTTP yes" in new.enroot_conf and "nvcr.io too" in new.enroot_conf
    assert "ENROOT_CONFIG_PATH" not in new.enroot_conf + new.install
    assert "python3 -m venv /opt/imgpipe" in new.install
    assert "./setup.sh node-wheels" in new.install  # both architectures, as the guide says
    assert "--find-links dist/nodes/$(uname -m) imgpipe" in new.install
    assert "imgpipe node-config --make-cache " in new.install


def test_node_config_keeps_job_scope_only_where_the_cleanup_finds_enroot(tmp_path: Path
                                                                         ) -> None:
    settings = _settings(tmp_path)
    elsewhere = render(settings, "/x", (0, 24, 0), enroot_path="/opt/enroot/bin/enroot")
    assert "container_scope=job" not in elsewhere.plugstack_conf.split("# note")[0]
    assert any("drain the node" in note for note in elsewhere.notes)


def test_node_config_reads_the_pyxis_version_from_the_plugin(tmp_path: Path, cli) -> None:
    plugin = tmp_path / "spank_pyxis.so"
    plugin.write_bytes(b"\x7fELF...\0pyxis: version v0.23.1\0...")
    assert detect_pyxis((str(plugin),)) == (str(plugin), (0, 23, 1))
    code, out, err = cli("node-config", "--pyxis-plugin", str(plugin), "--enroot",
                         "/usr/bin/enroot", "--json")
    assert code == 0, err
    data = json.loads(out)["data"]
    assert data["pyxis_version"] == "0.23.1" and "importer=" in data["plugstack_conf"]
    code, _, err = cli("node-config", "--pyxis-version", "new")
    assert code == 2 and "is not a version" in err


def test_a_lock_planted_as_a_link_is_refused_in_one_line(tmp_path: Path) -> None:
    from imgpipe.enroot.cache.storage import Storage
    from imgpipe.enroot.errors import ConvertError

    storage = Storage(tmp_path / "squashfs")
    storage.prepare()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    digest = "sha256:" + "cd" * 32
    os.symlink(victim, storage.locks / f"{'cd' * 32}.lock")
    with pytest.raises((ConvertError, OSError)):
        with storage.lock(digest):
            pass
    assert victim.read_text() == "precious\n"


def test_cache_folders_take_the_shared_mode_and_locks_are_usable_by_all(tmp_path: Path
                                                                        ) -> None:
    from imgpipe.enroot.cache.storage import Storage

    root = tmp_path / "squashfs"
    root.mkdir()
    os.chmod(root, 0o1777)
    storage = Storage(root)
    old = os.umask(0o077)  # a user's strict umask: folders still made shared, at once
    try:
        storage.prepare()
    finally:
        os.umask(old)
    for folder in (storage.blobs, storage.locks, storage.tmp, storage.uses):
        assert folder.stat().st_mode & 0o7777 == 0o1777, folder
    for folder in (storage.meta, storage.blobs.parent):  # nobody but root writes in these
        assert folder.stat().st_mode & 0o7777 == 0o755, folder
    with storage.lock("sha256:" + "ef" * 32):
        pass
    assert (storage.locks / f"{'ef' * 32}.lock").stat().st_mode & 0o777 == 0o666


@pytest.mark.parametrize(("version", "squashfuse", "note"), [
    ("0.21", False, "has no use_squashfuse (0.22+)"),
    ("0.22", True, "applies to squashfs paths only"),
    ("0.24", True, "use_squashfuse needs squashfuse and mountpoint on slurmd's PATH")])
def test_node_config_turns_on_squashfuse_mode_where_pyxis_has_it(tmp_path: Path, version: str,
                                                                 squashfuse: bool,
                                                                 note: str) -> None:
    config = render(_settings(tmp_path), "/x", parse_version(version),
                    enroot_path="/usr/bin/enroot")
    assert ("#   use_squashfuse=1" in config.plugstack_conf) is squashfuse
    taken = render(_settings(tmp_path), "/x", parse_version(version),
                   enroot_path="/usr/bin/enroot", accept=frozenset({"squashfuse"}))
    [line] = [x for x in taken.plugstack_conf.splitlines() if x.startswith("required")]
    assert ("use_squashfuse=1" in line) is squashfuse
    assert any(note in n for n in config.notes), config.notes
    off = render(_settings(tmp_path), "/x", parse_version(version),
                 enroot_path="/usr/bin/enroot", squashfuse=False)
    assert "use_squashfuse" not in off.plugstack_conf


def test_doctor_names_what_squashfuse_mode_lacks(tmp_path: Path) -> None:
    from imgpipe.commands.site.doctor import check_squashfuse_mode

    fuse = tmp_path / "fuse"
    fuse.touch()
    os.chmod(fuse, 0o600)
    without = {c.name: c for c in check_squashfuse_mode((0, 20, 0), "nodev\tproc\n", fuse)}
    assert without["/dev/fuse"].verdict == "warn" and "chmod 0666" in without["/dev/fuse"].fix
    assert without["overlayfs"].verdict == "warn"
    assert without["pyxis squashfuse"].verdict == "warn"
    os.chmod(fuse, 0o666)
    ready = {c.name: c for c in check_squashfuse_mode((0, 24, 0), "nodev\toverlay\n", fuse)}
    assert all(ready[n].verdict == "ok" for n in ("/dev/fuse", "overlayfs", "pyxis squashfuse"))
    assert "importer images" in ready["pyxis squashfuse"].detail


def test_the_importer_fast_path_reads_the_settings_the_full_loader_reads(tmp_path: Path
                                                                         ) -> None:
    from imgpipe.commands.node.importer import quick_settings

    for text in ("{}\n", "registry: {host: head, port: 5001}\noutputs: {squashfs_dir: sq}\n"
                 "enroot: {compression: lz4}\n", "outputs: {squashfs_dir: /abs/sq}\n",
                 "enroot: {squashfuse: true}\n",
                 "enroot: {squashfuse: true, compression: none}\n"):
        config = tmp_path / "imgpipe.yaml"
        config.write_text(text)
        full = load_settings(str(config))
        quick = quick_settings(str(config))
        assert quick is not None
        assert quick["address"] == full.registry.address
        assert quick["squashfs_dir"] == full.path(full.outputs.squashfs_dir).resolve()
        assert quick["compression"] == full.enroot.default_compression


def test_the_importer_answers_a_converted_digest_without_the_heavy_machinery(tmp_path: Path
                                                                             ) -> None:
    import sys

    digest = "ab" * 32
    squashfs = tmp_path / "sq"
    squashfs.mkdir()
    published = squashfs / f"imgpipe+bert+sha256-{digest}+zstd-f2.sqsh"
    published.write_bytes(b"hsqs")
    config = tmp_path / "imgpipe.yaml"
    config.write_text("registry: {host: head, port: 5000}\n"
                      f"outputs: {{squashfs_dir: {squashfs}}}\n")
    probe = ("import sys\nfrom imgpipe.cli.importer import main\n"
             f"code = main(['get', 'docker://head:5000#imgpipe/bert@sha256:{digest}'])\n"
             "print(code, 'pydantic' in sys.modules, 'requests' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**os.environ, "IMGPIPE_CONFIG": str(config),
                               "XDG_RUNTIME_DIR": str(tmp_path)}, timeout=60)
    assert done.stdout.splitlines() == [str(published), "0 False False"], done.stderr
    assert list((squashfs / ".imgpipe" / "uses").glob(f"{published.name}~*"))  # use recorded
