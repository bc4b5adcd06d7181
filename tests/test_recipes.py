"""Recipes: scaling keeps the global batch, scripts pass shellcheck, hostile values cannot inject.

Running the jobs on a real Slurm is the next step of the recipes issue; these
tests cover what rendering promises on its own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imgpipe.recipes.errors import RecipeError, ShapeError
from imgpipe.recipes.profiles import SHIPPED, load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle
from imgpipe.recipes.scaling import shape_for, table

PINNED = "head:5000/imgpipe/bert@sha256:" + "ab" * 32


@pytest.mark.parametrize("name", ["dgx1", "dgx2"])
@pytest.mark.parametrize("nodes", [1, 4, 16])
@pytest.mark.parametrize("phase", [1, 2])
def test_global_batch_is_kept(name: str, nodes: int, phase: int) -> None:
    profile = load_profile(name)
    shape = shape_for(profile, nodes, phase)
    assert shape.global_batch == (65536 if phase == 1 else 32768)
    assert shape.accumulation * shape.micro_batch * shape.gpus == shape.global_batch
    assert shape.per_gpu_batch * shape.gpus == shape.global_batch
    assert shape.learning_rate == (6e-3 if phase == 1 else 4e-3)
    assert shape.seq_len == (128 if phase == 1 else 512)


def test_facts_reference_points() -> None:
    # 16 GB V100 holds 16 sequences at 128 and 4 at 512; 32 GB holds 64 and 8.
    assert shape_for(load_profile("dgx1"), 1, 1).micro_batch == 16
    assert shape_for(load_profile("dgx1"), 1, 2).micro_batch == 4
    assert shape_for(load_profile("dgx2"), 1, 1).micro_batch == 64
    assert shape_for(load_profile("dgx2"), 1, 2).micro_batch == 8
    sixteen = shape_for(load_profile("dgx1"), 16, 1)
    assert (sixteen.per_gpu_batch, sixteen.accumulation) == (512, 32)


def test_shapes_that_cannot_keep_the_batch_are_refused() -> None:
    with pytest.raises(ShapeError, match="24 GPUs, which do not divide the global batch 65536"):
        shape_for(load_profile("dgx1"), 3, 1)


def test_table_matches_rendered_configs(tmp_path: Path, cli) -> None:
    code, out, _ = cli("recipes", "table", "--profile", "dgx2", "--max-nodes", "16", "--json")
    assert code == 0
    rows = json.loads(out)["data"]["shapes"]
    assert {r["nodes"] for r in rows} == {1, 2, 4, 8, 16}
    for row in rows:
        if row["nodes"] not in (1, 4, 16):
            continue
        folder = tmp_path / f"n{row['nodes']}"
        code, _, err = cli("recipes", "render", "--profile", "dgx2", "--nodes",
                           str(row["nodes"]), "--phase", str(row["phase"]), "--image", PINNED,
                           "-o", str(folder))
        assert code == 0, err
        config = (folder / row["config_name"]).read_text()
        exported = dict(line.removeprefix("export ").split("=", 1)
                        for line in config.splitlines() if line.startswith("export "))
        assert exported["BATCHSIZE"] == str(row["per_gpu_batch"])
        assert exported["GRADIENT_STEPS"] == str(row["accumulation"])
        assert exported["DGXNNODES"] == str(row["nodes"])
        assert exported["DGXNGPU"] == "16"
        assert exported["PHASE"] == str(row["phase"])
        assert float(exported["LR"]) == row["learning_rate"]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("runtime", ["pyxis", "host"])
def test_every_rendered_script_passes_shellcheck(tmp_path: Path, name: str,
                                                 runtime: str) -> None:
    profile = load_profile(name)
    nodes = 1 if name == "local" else 2
    bundle = render_bundle(RecipeInputs(profile, nodes, PINNED, runtime=runtime), tmp_path)
    scripts = [p for p in bundle.files if p.suffix in (".sub", ".sh")]
    assert len(scripts) == 5
    result = subprocess.run(["shellcheck", "--severity=style", *map(str, scripts)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    run_sub = (tmp_path / "run.sub").read_text()
    assert "#SBATCH" in run_sub
    for line in run_sub.splitlines():
        if line.startswith("#SBATCH"):
            assert "#" not in line[1:], line  # Enroot's '#' form never reaches #SBATCH


def test_image_is_pinned_in_enroot_form() -> None:
    assert "head:5000#imgpipe/bert@sha256:" in _render_text(image=PINNED)
    with pytest.raises(RecipeError, match="not pinned to a digest"):
        _render_text(image="head:5000/imgpipe/bert:latest")


def _render_text(tmp: Path | None = None, **changes) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        inputs = RecipeInputs(load_profile("local"), 1, changes.pop("image", PINNED),
                              runtime="host", **changes)
        render_bundle(inputs, Path(folder))
        return "".join(p.read_text() for p in sorted(Path(folder).iterdir()))


MARKER = f"/tmp/imgpipe-pwned-{os.getpid()}"  # created only if an injection ran
HOSTILE = [
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"a b; touch {MARKER}",
    "it's \"quoted\"",
    f"line1\nline2; touch {MARKER}",
    f"${{HOME}}/x && touch {MARKER}",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_environment_values_are_quoted(value: str, tmp_path: Path) -> None:
    bundle = render_bundle(RecipeInputs(load_profile("local"), 1, PINNED, runtime="host",
                                        env={"SITE_VALUE": value}), tmp_path)
    script = tmp_path / "run.sub"
    assert bundle.files
    line = next(x for x in script.read_text().split("\nexport ") if x.startswith("SITE_VALUE="))
    assignment = "export " + line.split("\nexport ")[0]
    probe = subprocess.run(["bash", "-c", assignment.split("\ncase ")[0]
                            + '\nprintf %s "$SITE_VALUE"'], capture_output=True, text=True)
    assert probe.stdout == value  # the shell reads it back unchanged
    assert not Path(MARKER).exists()


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_paths_are_quoted_or_refused(value: str, tmp_path: Path) -> None:
    try:
        render_bundle(RecipeInputs(load_profile("local"), 1, PINNED, runtime="host",
                                   data_dir=value), tmp_path)
    except RecipeError as exc:
        assert "\n" in value and "not a usable path" in exc.message
        return
    script = (tmp_path / "run.sub").read_text()
    assert f"default_datadir={shlex.quote(value)}\n" in script
    probe = subprocess.run(
        ["bash", "-c", f'default_datadir={shlex.quote(value)}\n'
         'DATADIR="${DATADIR:-$default_datadir}"; printf %s "$DATADIR"'],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert probe.stdout == value
    assert not Path(MARKER).exists()


@pytest.mark.parametrize("value", ["debug; rm -rf /", "batch\n#SBATCH --uid=0", "a b",
                                   "$(id)", "`id`", "x#y"])
def test_hostile_sbatch_values_are_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="cannot go in an #SBATCH line"):
        render_bundle(RecipeInputs(load_profile("local"), 1, PINNED, partition=value),
                      tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize("image", ["head:5000/bert@sha256:zz", "$(id)", "a b",
                                   "/path/with\nnewline.sqsh"])
def test_hostile_images_are_refused(image: str, tmp_path: Path) -> None:
    with pytest.raises(RecipeError):
        render_bundle(RecipeInputs(load_profile("local"), 1, image), tmp_path)


def test_hostile_env_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="not a valid shell variable"):
        render_bundle(RecipeInputs(load_profile("local"), 1, PINNED,
                                   env={"A;touch x": "1"}), tmp_path)


def test_render_without_a_pushed_image_says_how(cli) -> None:
    code, _, err = cli("recipes", "render", "--profile", "local", "--nodes", "1")
    assert code == 2
    assert "imgpipe.lock has no pushed bert/cpu to pin" in err


def test_unknown_profile_and_bad_shape_exit_2(cli) -> None:
    code, _, err = cli("recipes", "table", "--profile", "dgx9")
    assert code == 2 and "unknown profile 'dgx9'" in err
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "3", "--image",
                       PINNED)
    assert code == 2 and "do not divide the global batch" in err


def test_table_lists_only_shapes_that_keep_the_batch() -> None:
    shapes = table(load_profile("dgx-h100"), 64)
    assert shapes and all(s.global_batch % s.gpus == 0 for s in shapes)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from tests.slurm import one_node_slurm

    with one_node_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.mark.e2e
@pytest.mark.parametrize("name", SHIPPED)
def test_real_slurm_accepts_every_rendered_script(slurm, tmp_path: Path, name: str) -> None:
    profile = load_profile(name)
    nodes = 1 if name == "local" else 4
    render_bundle(RecipeInputs(profile, nodes, PINNED), tmp_path)
    for script in ("run.sub", "dataset.sub", "nccl.sub"):
        # This Slurm has one node, so the node count is lowered on the command line; every
        # #SBATCH line of the script (partition, time, signal, GPUs, ...) is still checked.
        result = slurm.run("sbatch", "--test-only", "-N1", str(tmp_path / script))
        assert result.returncode == 0, (script, result.stderr)
        assert "to start at" in result.stderr


@pytest.mark.e2e
def test_real_slurm_refuses_a_broken_directive(slurm, tmp_path: Path) -> None:
    render_bundle(RecipeInputs(load_profile("local"), 1, PINNED), tmp_path)
    script = tmp_path / "run.sub"
    script.write_text(script.read_text().replace("#SBATCH --requeue", "#SBATCH --requeue=maybe"))
    result = slurm.run("sbatch", "--test-only", str(script))
    assert result.returncode != 0  # the check above is not vacuous


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_pulling_a_missing_tag_fails_clearly(cli, registry_server, tmp_path) -> None:
    cli.write_config({"registry": {"port": registry_server.port}})
    code, _, err = cli("recipes", "pull", "imgpipe/bert-recipes:nope", "-o", str(tmp_path / "x"))
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"error: no recipe bundle {registry_server.address}/imgpipe/bert-recipes:nope in the "
        "registry (hint: list tags: imgpipe registry tags imgpipe/bert-recipes)")
    assert not (tmp_path / "x").exists()


def _tiny_bert_config(vocab: Path, path: Path) -> Path:
    from bert_trainer.config import TINY

    words = len(vocab.read_text().splitlines())
    values = json.loads(TINY.to_json())
    values.update(vocab_size=words, max_position_embeddings=512)
    path.write_text(json.dumps(values))
    return path


@pytest.mark.e2e
def test_local_pipeline_prepares_trains_both_phases_and_checks_on_slurm(tmp_path: Path) -> None:
    """dataset.sub -> run.sub phase 1 -> run.sub phase 2 -> nccl.sub, two tasks each, on the
    real one-node Slurm with --runtime host: the whole cluster workflow at a toy size."""
    from tests.slurm import one_node_slurm
    from tests.test_dataset import PY as DATASET
    from tests.test_dataset import make_corpus

    source = make_corpus(tmp_path / "corpus", files=2, documents=30)
    vocab = tmp_path / "vocab.txt"
    subprocess.run([*DATASET, "train-vocab", "--source", str(source), "--output", str(vocab),
                    "--vocab-size", "300"], check=True, capture_output=True, timeout=120)
    data, checkpoints, results = tmp_path / "data", tmp_path / "ckpt", tmp_path / "results"
    recipes = tmp_path / "recipes"
    bundle = render_bundle(RecipeInputs(
        load_profile("local"), 1, "/images/bert.sqsh", runtime="host", data_dir=str(data),
        checkpoint_dir=str(checkpoints), results_dir=str(results), dataset_source=str(source),
        vocab=str(vocab), bert_config=str(_tiny_bert_config(vocab, tmp_path / "bert.json")),
        shards=4), recipes)
    venv_bin = Path(sys.executable).parent
    env = {"PYTHON": sys.executable, "IMGPIPE": str(venv_bin / "imgpipe"),
           "MASTER_ADDR": "127.0.0.1", "PATH": f"{venv_bin}:{os.environ['PATH']}",
           "CHECKPOINT_EVERY": "2"}

    def submit(script: str, config: str | None, log: str) -> str:
        sourced = f"source {shlex.quote(str(recipes / config))} && " if config else ""
        command = (f"{sourced}sbatch --wait -N1 --ntasks-per-node=2 -o {shlex.quote(log)} "
                   f"{shlex.quote(str(recipes / script))}")
        job = slurm.run("bash", "-c", command, cwd=tmp_path, timeout=600, extra_env=env)
        output = Path(log).read_text()
        assert job.returncode == 0, (script, config, output[-3000:])
        return output

    phase1, phase2 = bundle.shapes
    with one_node_slurm(tmp_path / "slurm") as slurm:
        submit("dataset.sub", None, str(tmp_path / "dataset.out"))
        train1 = submit("run.sub", phase1.config_name, str(tmp_path / "phase1.out"))
        train2 = submit("run.sub", phase2.config_name, str(tmp_path / "phase2.out"))
        check = submit("nccl.sub", None, str(tmp_path / "nccl.out"))
    for phase, shape, output in ((1, phase1, train1), (2, phase2, train2)):
        lines = [json.loads(x) for x in
                 (results / f"bert_phase{phase}.jsonl").read_text().splitlines()]
        start = next(x for x in lines if x["event"] == "start")
        assert start["world_size"] == 2 and start["global_batch"] == shape.global_batch
        steps = [x["step"] for x in lines if x["event"] == "step"]
        assert steps == list(range(1, shape.max_steps + 1)), output[-2000:]
        assert (checkpoints / f"phase{phase}" / f"ckpt_{shape.max_steps}.pt").is_file()
        # The trainer read the dataset job's shards at this phase's sequence length.
        assert start["shards"] == 4
    assert "PASS: all_reduce on 2 rank(s)" in check


@pytest.mark.e2e
def test_run_sub_checkpoints_on_the_time_limit_signal_and_requeues_itself(tmp_path: Path
                                                                          ) -> None:
    """What Slurm does before a time limit (SIGUSR1 to the steps), done by hand: the trainer
    checkpoints and exits 3, run.sub requeues the job, and the next run resumes there."""
    from bert_trainer.synthetic import write_shards

    from tests.services import free_port
    from tests.slurm import one_node_slurm

    data, checkpoints, results = tmp_path / "data", tmp_path / "ckpt", tmp_path / "results"
    write_shards(data / "phase1", shards=2, per_shard=64, seq_len=128, max_pred=20,
                 vocab_size=64)
    config = tmp_path / "bert.json"
    config.write_text(json.dumps({"vocab_size": 64, "hidden_size": 32,
                                  "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "intermediate_size": 64, "max_position_embeddings": 128}))
    recipes = tmp_path / "recipes"
    bundle = render_bundle(RecipeInputs(
        load_profile("local"), 1, "/images/bert.sqsh", runtime="host", data_dir=str(data),
        checkpoint_dir=str(checkpoints), results_dir=str(results), bert_config=str(config)),
        recipes, phases=(1,))
    log = tmp_path / "job.out"
    env = {"PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1", "CHECKPOINT_EVERY": "100000",
           "MASTER_PORT": str(free_port())}
    with one_node_slurm(tmp_path / "slurm") as slurm:
        # Endless steps: only the signal ends the first run.
        submitted = slurm.run("bash", "-c", (
            f"source {recipes / bundle.shapes[0].config_name} && MAX_STEPS=1000000 sbatch "
            f"--parsable -N1 --ntasks-per-node=2 -o {log} {recipes / 'run.sub'}"),
            extra_env=env)
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip().split(";")[0]
        journal = results / "bert_phase1.jsonl"

        def events() -> list[dict]:
            if not journal.exists():
                return []
            return [json.loads(x) for x in journal.read_text().splitlines() if x.strip()]

        def wait_until(predicate, what: str, seconds: float = 240) -> None:
            deadline = time.monotonic() + seconds
            while not predicate():
                assert time.monotonic() < deadline, (
                    what, slurm.run("scontrol", "show", "job", job).stdout,
                    log.read_text()[-3000:] if log.exists() else "")
                time.sleep(0.5)

        try:
            wait_until(lambda: any(e["event"] == "step" and e["step"] >= 3 for e in events()),
                       "three training steps")
            signalled = slurm.run("scancel", "--signal=USR1", job)
            assert signalled.returncode == 0, signalled.stderr
            wait_until(lambda: any(e["event"] == "stopped" for e in events()), "a checkpoint")

            def restarted() -> bool:  # Slurm holds a requeued job for cred_expire (10 s)
                kinds = [e["event"] for e in events()]
                return kinds.count("start") >= 2 and kinds[-1] == "step"

            wait_until(restarted, "the requeued job to train")
        finally:
            slurm.run("scancel", job)
    stopped = next(e for e in events() if e["event"] == "stopped")
    assert Path(stopped["checkpoint"]).name == f"ckpt_{stopped['step']}.pt"
    restarts = [e for e in events() if e["event"] == "start"]
    assert restarts[0]["resumed_from"] is None
    assert restarts[1]["resumed_from"] == stopped["checkpoint"]
    assert restarts[1]["step"] == stopped["step"]
    assert "requeueing job" in log.read_text()


def test_site_paths_from_the_config_reach_the_scripts(cli, tmp_path: Path) -> None:
    cli.write_config({"recipes": {"bert_config": "/site/models/bert base.json",
                                  "data_dir": "/site/data"}})
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "1", "--image",
                       PINNED, "-o", str(tmp_path))
    assert code == 0, err
    script = (tmp_path / "run.sub").read_text()
    assert "default_bert_config='/site/models/bert base.json'" in script
    assert "default_datadir=/site/data" in script
