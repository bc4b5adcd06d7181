"""The recipes on a real multi-host Slurm: a head host and two compute hosts in network
namespaces, jobs in Charliecloud containers (the bert squashfs, as a non-root user) and on
the host runtime, the way cluster users submit them.

What each test shows is what broke when imgpipe's recipes first met a cluster: host paths
handed to containers, a PATH lost to the login shell, a check that needed imgpipe on the
compute nodes, a requeue lost on a busy machine, an importer that only root could use.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle
from tests.cluster import (
    USERS,
    Submitter,
    journal,
    node_cache,
    owned_by,
    shared_folder,
    wait_until,
)

pytestmark = pytest.mark.slow  # every test here takes over 20 s

ALICE, BOB = USERS


def _dataset_inputs(folder: Path) -> tuple[Path, Path, Path]:
    """A small corpus, a vocabulary trained on it, and a tiny BERT config, readable by all."""
    from bert_trainer.config import TINY

    from tests.unit.test_dataset import PY as DATASET
    from tests.unit.test_dataset import make_corpus

    source = make_corpus(folder / "corpus", files=2, documents=30)
    vocab = folder / "vocab.txt"
    subprocess.run([*DATASET, "train-vocab", "--source", str(source), "--output", str(vocab),
                    "--vocab-size", "300"], check=True, capture_output=True, timeout=120)
    values = json.loads(TINY.to_json())
    values.update(vocab_size=len(vocab.read_text().splitlines()), max_position_embeddings=512)
    config = folder / "bert_config.json"
    config.write_text(json.dumps(values))
    for path in folder.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return source, vocab, config


def _pipeline(cluster, runtime: str, image: str, user: str | None, env: dict[str, str]
              ) -> None:
    """dataset.sub on 2 nodes -> run.sub phase 1 (2 nodes x 2 tasks) -> phase 2 from phase
    1's checkpoint with the rendered defaults -> nccl.sub and its check, all as rendered."""
    work = shared_folder(f"imgpipe-{runtime}-")
    source, vocab, config = _dataset_inputs(work / "inputs")
    data, checkpoints, results = work / "data", work / "ckpt", work / "results"
    owned_by(user or "root", data, checkpoints, results, work / "jobs")
    bundle = render_bundle(RecipeInputs(
        load_profile("local"), 2, image, runtime=runtime, data_dir=str(data),
        checkpoint_dir=str(checkpoints), results_dir=str(results), dataset_source=str(source),
        vocab=str(vocab), bert_config=str(config), shards=4), work / "recipes")
    users = Submitter(cluster, work / "recipes", work / "jobs", user, env)
    phase1, phase2 = bundle.shapes

    users.submit("dataset.sub", None, "-N2", "--ntasks-per-node=1")
    assert sorted(p.name for p in (data / "phase1").glob("*.hdf5"))[:1], "no phase 1 shards"
    users.submit("run.sub", phase1.config_name, "-N2", "--ntasks-per-node=2")
    users.submit("run.sub", phase2.config_name, "-N2", "--ntasks-per-node=2")
    _, check = users.submit("nccl.sub", None, "-N2", "--ntasks-per-node=2")

    for phase, shape in ((1, phase1), (2, phase2)):
        events = journal(results, phase)
        start = next(e for e in events if e["event"] == "start")
        assert start["world_size"] == 4 and start["global_batch"] == shape.global_batch
        assert [e["step"] for e in events if e["event"] == "step"] == list(
            range(1, shape.max_steps + 1))
        assert (checkpoints / f"phase{phase}" / f"ckpt_{shape.max_steps}.pt").is_file()
    phase2_start = next(e for e in journal(results, 2) if e["event"] == "start")
    assert phase2_start["init_checkpoint"].endswith(f"ckpt_{phase1.max_steps}.pt")
    if runtime != "host":  # the trainer saw container paths only
        assert phase2_start["init_checkpoint"].startswith("/checkpoints/")
    assert "PASS: all_reduce on 4 rank(s) / 2 node(s)" in check, check[-3000:]
    hosts = set(re.findall(r"#\s+Rank\s+\d+ .* on\s+(\S+) device", check))
    assert len(hosts) == 2, check[-3000:]  # ranks on both compute hosts


def test_recipes_run_in_charliecloud_containers_on_two_nodes_as_a_user(cluster, bert_cpu
                                                                       ) -> None:
    env = {"CHECKPOINT_EVERY": "2", "PATH": "/usr/local/bin:/usr/bin:/bin"}
    _pipeline(cluster, "charliecloud", str(bert_cpu["squashfs"]), ALICE, env)


def test_a_charliecloud_task_outliving_its_node_peers_still_reads_the_image(cluster, bert_cpu
                                                                            ) -> None:
    """Eight tasks of one step on one node: seven exit at once, the last reads the image
    afterwards.  With ch-run --join the first task's ch-run served everyone's squashfuse
    mount and unmounted it when its own task ended: the others died of SIGBUS (seen as
    "task 1: Bus error" at the end of nccl.sub).  Three launches: a shared mount fails
    each with probability 7/8."""
    from imgpipe.recipes.runtimes import prelude

    work = shared_folder("imgpipe-outlive-")
    owned_by(ALICE, work / "jobs")
    reader = ("import os, time; rank = int(os.environ['SLURM_PROCID']); "
              "rank == 7 and time.sleep(3); "
              "import json, email.mime.text, xml.dom.minidom, unittest; print('read', rank)")
    script = work / "outlive.sub"
    script.write_text("#!/bin/bash\n#SBATCH --output=%x-%j.out\nset -euo pipefail\n"
                      f"CONT={shlex.quote(str(bert_cpu['squashfs']))}\n"
                      f"{prelude('charliecloud')}step=(-N1 -n8)\n"
                      f"for attempt in 1 2 3; do launch python3 -c {shlex.quote(reader)}; done\n")
    os.chmod(script, 0o755)
    users = Submitter(cluster, work, work / "jobs", ALICE, {"PATH": "/usr/local/bin:/usr/bin:/bin"})
    _, output = users.submit("outlive.sub", None, "-N1", "-n8", timeout=300)
    assert output.count("read 7") == 3, output[-3000:]


def test_recipes_run_on_the_host_runtime_on_two_nodes(cluster) -> None:
    # The host runtime runs what the nodes have installed: this checkout's venv, which only
    # root may execute (it is made from a Python under /root), so these jobs run as root.
    venv_bin = Path(sys.executable).parent
    env = {"PYTHON": sys.executable, "CHECKPOINT_EVERY": "2",
           "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin"}
    _pipeline(cluster, "host", "/images/unused.sqsh", None, env)


# IMGPIPE_REQUEUE_RUNS=5 repeats it (with four `yes >/dev/null` loops beside it, the way
# the requeue race was found: see the README).
@pytest.mark.parametrize("run", range(int(os.environ.get("IMGPIPE_REQUEUE_RUNS", "1"))))
def test_requeue_on_the_time_limit_signal_resumes_on_two_nodes(cluster, bert_cpu, run: int
                                                                ) -> None:
    """SIGUSR1 (what Slurm sends before the time limit) to a 2-node charliecloud job: the
    trainer checkpoints, run.sub requeues the job, and it resumes at that step."""
    from bert_trainer.synthetic import write_shards

    work = shared_folder("imgpipe-requeue-")
    data, checkpoints, results = work / "data", work / "ckpt", work / "results"
    write_shards(data / "phase1", shards=4, per_shard=64, seq_len=128, max_pred=20,
                 vocab_size=64)
    for path in data.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    config = work / "bert.json"
    config.write_text(json.dumps({"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "intermediate_size": 64,
                                  "max_position_embeddings": 128}))
    os.chmod(config, 0o644)
    owned_by(ALICE, checkpoints, results, work / "jobs")
    bundle = render_bundle(RecipeInputs(
        load_profile("local"), 2, str(bert_cpu["squashfs"]), runtime="charliecloud",
        data_dir=str(data), checkpoint_dir=str(checkpoints), results_dir=str(results),
        bert_config=str(config)), work / "recipes", phases=(1,))
    env = {"CHECKPOINT_EVERY": "100000", "PATH": "/usr/local/bin:/usr/bin:/bin"}
    recipes = work / "recipes"
    submitted = cluster.run(["bash", "-c", (
        f"source {recipes / bundle.shapes[0].config_name} && MAX_STEPS=1000000 sbatch "
        f"--parsable -N2 --ntasks-per-node=2 {recipes / 'run.sub'}")],
        user=ALICE, env=env, cwd=work / "jobs")
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    users = Submitter(cluster, recipes, work / "jobs", ALICE, env)

    def describe() -> str:
        shown = cluster.run(["scontrol", "show", "job", job]).stdout
        return shown + users.job_output("run.sub", job)[-3000:]

    def events() -> list[dict]:
        return journal(results, 1)

    try:
        wait_until(lambda: any(e["event"] == "step" and e["step"] >= 3 for e in events()),
                   "three training steps", 300, describe)
        signalled = cluster.run(["scancel", "--signal=USR1", job])
        assert signalled.returncode == 0, signalled.stderr
        wait_until(lambda: any(e["event"] == "stopped" for e in events()), "a checkpoint", 120,
                   describe)

        def resumed() -> bool:  # Slurm holds a requeued job for cred_expire (10 s)
            kinds = [e["event"] for e in events()]
            return kinds.count("start") >= 2 and kinds[-1] == "step"

        wait_until(resumed, "the requeued job to train", 300, describe)
    finally:
        cluster.run(["scancel", job])
    stopped = next(e for e in events() if e["event"] == "stopped")
    starts = [e for e in events() if e["event"] == "start"]
    assert starts[0]["resumed_from"] is None
    assert starts[1]["resumed_from"] == stopped["checkpoint"]
    assert starts[1]["step"] == stopped["step"]
    assert stopped["checkpoint"].startswith("/checkpoints/phase1/")
    assert "requeueing job" in users.job_output("run.sub", job)


def test_pyxis_recipes_are_accepted_at_their_real_node_count(cluster, tmp_path: Path) -> None:
    """sbatch --test-only of every Pyxis script of every GPU profile on 2 nodes, as rendered
    (the sandbox's nodes carry fake GPUs so --gpus-per-node is checked too)."""
    from imgpipe.recipes.profiles import SHIPPED

    pinned = "head:5000/imgpipe/bert@sha256:" + "ab" * 32
    for name in SHIPPED:
        profile = load_profile(name)
        folder = shared_folder(f"imgpipe-testonly-{name}-")
        bundle = render_bundle(RecipeInputs(profile, 2, pinned), folder)
        for script in ("run.sub", "dataset.sub", "nccl.sub"):
            gpus = min(profile.gpus_per_node, 8)
            shape = (["-N2", f"--ntasks-per-node={gpus}"] if script != "dataset.sub"
                     else ["-N2", "--ntasks-per-node=1"])
            if script == "run.sub":
                exported = f"source {folder / bundle.shapes[0].config_name} && "
            else:
                exported = ""
            result = cluster.run(["bash", "-c", exported + shlex.join(
                ["sbatch", "--test-only", *shape, str(folder / script)])], user=ALICE,
                cwd="/tmp")
            assert result.returncode == 0, (name, script, result.stderr)
            assert "to start at" in result.stderr


def test_importer_one_user_on_two_nodes_converts_a_new_digest_once(cluster, registry_server,
                                                                    base_image) -> None:
    """Pyxis runs the importer as the job's user on every node.  One user's job on two
    compute hosts `gets` a digest nobody has converted, at once, from one shared squashfs
    folder (set up by node-config --make-cache): one conversion, both get the file, no
    traceback.  Another user gets a file of their own: nobody runs bytes another job user
    wrote (see test_tenants)."""
    import threading

    from tests import services
    from tests.cluster import system_imgpipe

    tag = f"race-{os.getpid()}-{time.monotonic_ns()}"
    target = f"{registry_server.address}/imgpipe/race:{tag}"
    for argv in (["tag", base_image, target], ["push", target]):
        subprocess.run([services.DOCKER, *argv], check=True, capture_output=True, timeout=600)
    digest = requests.head(
        f"http://{registry_server.address}/v2/imgpipe/race/manifests/{tag}",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
        timeout=30).headers["Docker-Content-Digest"]
    bin_dir = system_imgpipe(Path(__file__).resolve().parents[2])
    squashfs, config = node_cache("imgpipe-importer-")
    uri = f"docker://head:5000#imgpipe/race@{digest}"
    results: dict[str, subprocess.CompletedProcess[str]] = {}

    def get(user: str, node: str) -> None:
        results[node] = cluster.run(
            ["srun", "-w", node, "-N1", "-n1", str(bin_dir / "imgpipe-pyxis-importer"), "get",
             uri], user=user, env={"IMGPIPE_CONFIG": str(config)}, timeout=300, cwd="/tmp")

    threads = [threading.Thread(target=get, args=(ALICE, "node1")),
               threading.Thread(target=get, args=(ALICE, "node2"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for node, done in results.items():
        assert done.returncode == 0, (node, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    paths = {done.stdout.strip() for done in results.values()}
    [published] = list(squashfs.glob("*.sqsh"))
    assert paths == {str(published)}
    alice = pwd.getpwnam(ALICE).pw_uid
    assert published.name.endswith(f".u{alice}.sqsh") and published.stat().st_uid == alice
    assert published.stat().st_mode & 0o777 == 0o644  # every user can read, none change it
    squashed = [n for n, done in results.items() if "squash with" in done.stderr]
    assert len(squashed) == 1, {n: d.stderr for n, d in results.items()}
    bob = cluster.run([str(bin_dir / "imgpipe-pyxis-importer"), "get", uri], user=BOB,
                      env={"IMGPIPE_CONFIG": str(config)}, timeout=300, cwd="/tmp",
                      host=cluster.spec.nodes[0])
    assert bob.returncode == 0 and "squash with" in bob.stderr, bob.stderr
    assert bob.stdout.strip().endswith(f".u{pwd.getpwnam(BOB).pw_uid}.sqsh")
    for user in USERS:  # release is idempotent and never deletes the shared file
        for _ in range(2):
            done = cluster.run([str(bin_dir / "imgpipe-pyxis-importer"), "release"], user=user,
                               host=cluster.spec.nodes[0], cwd="/tmp")
            assert done.returncode == 0, done.stderr
    assert published.exists()
