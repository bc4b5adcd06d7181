"""The main job on this machine: ``./setup.sh demo`` (``python -m imgpipe.commands.demo.democli``).

What a team does on a cluster, with the commands a user types, on a local sandbox:

1. ``imgpipe build bert --flavor cpu``, ``imgpipe selftest bert``, ``imgpipe push bert``,
   ``imgpipe convert bert`` (the squashfs the jobs run);
2. ``imgpipe sandbox up`` (a head host and two compute hosts);
3. a corpus of English prose from /usr/share/doc and common-licenses, a WordPiece vocabulary
   (``train-vocab``) and a small BERT config;
4. ``imgpipe recipes render --profile local --nodes 2 --runtime pyxis``, pinned to the
   pushed digest (``head:5000#imgpipe/bert@sha256:…``); the sandbox's compute hosts load
   Pyxis 0.24 and Enroot 4.1.2 (built by ``./setup.sh``) with imgpipe's importer, and the
   head serves the local registry (``commands/demo/demopyxis.py``);
5. as a regular user (``imgpipe-demo``): ``sbatch dataset.sub``, then ``source config_… &&
   sbatch run.sub`` for phase 1 and phase 2, then ``sbatch nccl.sub`` (BENCH=pytorch:
   nccl-tests needs CUDA), every job in containers through ``srun --container-image`` on
   both compute hosts, watched live (state, step, loss);
6. ``imgpipe report RESULTS`` and a summary.

Idempotent: a second run builds nothing new (BuildKit's cache), self-tests only a new
image, converts nothing (the squashfs is kept per digest), and skips the dataset and the
training phases whose outputs are complete.  ``--down`` stops the sandbox and the registry.
``--runtime charliecloud`` runs the same jobs with ``ch-run`` on the squashfs file instead,
as root.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgpipe.base import process
from imgpipe.commands.demo import demopyxis
from imgpipe.commands.demo.democorpus import LICENSES
from imgpipe.commands.demo.demojobs import JOB_NAMES, Job, print_summary, pyxis_lines
from imgpipe.recipes.sandbox import Sandbox, SandboxSpec

ROOT = Path.cwd()
WORK = ROOT / "build" / "demo"
STEPS = {1: 900, 2: 300}
# What a user exports after sourcing a config, as MAX_STEPS.  Phase 1 of a 2-layer model on a
# small corpus trains faster than the profile's rate for a 16-sequence batch (0.006, 28 %
# warm-up): at 0.01 with 5 % warm-up its loss halves in 900 steps (8.3 -> 3.7).  Phase 2
# starts higher (positions 129-512 were never trained) and needs a few hundred steps of its
# own: with 16 sequences a step at 0.006 it ends near 3.9 in 300 (8 sequences at the profile's
# 0.004: 3.9-4.1 after 400, noisier and no faster).  Measured, 4 ranks on 2 cores, docs/demo.md.
# EXPORT=hf: phase 2's model leaves as a Hugging Face folder (RESULTS/<job>/export-hf).
PHASE_OVERRIDES = {1: "LR=0.01 WARMUP_PROPORTION=0.05", 2: "BATCHSIZE=4 LR=0.006 EXPORT=hf"}
CORPUS_MB = 0.3
VOCAB_WORDS = 2000


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def imgpipe(*args: str, capture: bool = False) -> dict[str, Any]:
    """An imgpipe command as a user types it; with ``capture``, its --json data."""
    argv = [str(Path(sys.executable).parent / "imgpipe"), *args]
    say("$ " + shlex.join(["imgpipe", *args]))
    if not capture:
        if process.attached(argv):
            raise SystemExit(f"error: imgpipe {' '.join(args)} failed")
        return {}
    done = process.run([*argv, "--json"], check=False, timeout=1800)
    if done.returncode:
        sys.stderr.write(done.stderr + done.stdout)
        raise SystemExit(f"error: imgpipe {' '.join(args)} failed")
    data: dict[str, Any] = json.loads(done.stdout)["data"]
    return data


def state_path() -> Path:
    return WORK / "state.json"


def load_state() -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(state_path().read_text())
        return state
    except (OSError, ValueError):
        return {}


def selftest_if_new(outcome: dict[str, Any], state: dict[str, Any],
                    save: Callable[[dict[str, Any]], None]) -> None:
    """``imgpipe selftest bert`` for a new image (or one that never passed), else a line."""
    if outcome["action"] == "built" or not state.get("selftested"):
        imgpipe("selftest", "bert", "--flavor", "cpu")
        state["selftested"] = outcome["image_id"] or "up to date"
        save(state)
    else:
        say("self-test: the image is unchanged since it passed, skipped")


def save_state(state: dict[str, Any]) -> None:
    state_path().parent.mkdir(parents=True, exist_ok=True)
    tmp = state_path().with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, state_path())


def wheels() -> list[str]:
    for folder in [*os.environ.get("IMGPIPE_WHEELS", "").split(), "/opt/wheels"]:
        if folder and list(Path(folder).glob("torch-*.whl")):
            return ["--wheels", folder]
    return []


def images(state: dict[str, Any], shared: list[str]) -> dict[str, Any]:
    served = imgpipe("registry", "up", capture=True)
    if served["mode"] == "external":
        shared.append(f"the registry on {served['url']}")
    imgpipe("base-image", "--tag", "imgpipe/debian-python:bookworm")
    built = imgpipe("build", "bert", "--flavor", "cpu", *wheels(), capture=True)
    selftest_if_new(built["images"][0], state, save_state)
    imgpipe("push", "bert")
    converted = imgpipe("convert", "bert", "--flavor", "cpu", capture=True)
    return converted


def forget_other_inputs(work: Path, state: dict[str, Any]) -> None:
    """An earlier demo's outputs made from other inputs (corpus, vocabulary, steps) are removed,
    not skipped as done."""
    wanted = {"corpus": [str(p) for p in LICENSES], "megabytes": CORPUS_MB,
              "vocab_words": VOCAB_WORDS, "steps": STEPS, "overrides": PHASE_OVERRIDES}
    wanted = json.loads(json.dumps(wanted))  # as the state file holds it
    if state.get("inputs") == wanted:
        return
    stale = [work / name for name in ("corpus", "vocab.txt", "bert_config.json", "data",
                                      "checkpoints", "results")]
    if state.get("jobs") or any(path.exists() for path in stale):
        say("inputs changed since the last demo: its corpus, data and checkpoints are made again")
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    state.pop("jobs", None)
    state["inputs"] = wanted
    save_state(state)


def inputs(work: Path) -> tuple[Path, Path, Path]:
    """Corpus, vocabulary and a small BERT config, made once."""
    from imgpipe.commands.demo.democorpus import assemble

    corpus, vocab, config = work / "corpus", work / "vocab.txt", work / "bert_config.json"
    if not (corpus / "done").exists():
        made = assemble(corpus, CORPUS_MB, LICENSES)
        (corpus / "done").write_text(json.dumps(made))
        say(f"corpus: {', '.join(p.name for p in LICENSES)} from /usr/share/common-licenses "
            f"({made['distinct_bytes'] / 1e3:.0f} KB), written to "
            f"{made['bytes'] / 1e6:.1f} MB")
    if not vocab.exists():
        say(f"$ python -m bert_trainer.dataset train-vocab --vocab-size {VOCAB_WORDS}")
        process.run([sys.executable, "-m", "bert_trainer.dataset", "train-vocab",
                     "--source", str(corpus), "--output", str(vocab), "--vocab-size",
                     str(VOCAB_WORDS)], timeout=600, what="train-vocab")
    if not config.exists():
        size = len(vocab.read_text().splitlines())
        config.write_text(json.dumps({
            "vocab_size": size, "hidden_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 512,
            "max_position_embeddings": 512, "type_vocab_size": 2,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}, indent=1))
    return corpus, vocab, config


def job_info(cluster: Sandbox, job: Job) -> None:
    shown = cluster.run(["scontrol", "show", "job", job.id, "-o"], timeout=20).stdout
    fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
    job.state = fields.get("JobState", job.state)
    job.nodes = fields.get("NodeList", job.nodes)
    job.elapsed = fields.get("RunTime", job.elapsed)


def last_step(results: Path, phase: int, job_id: str = "") -> tuple[int | None, float | None]:
    """The last logged step and loss of ``phase`` (of job ``job_id`` alone, when given)."""
    step = loss = None
    for path in results.glob(f"*{'-' + job_id if job_id else ''}/bert_phase{phase}.jsonl"):
        for line in path.read_text(errors="replace").splitlines()[-5:]:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "step":
                step, loss = event["step"], event["loss"]
    return step, loss


def show(jobs: list[Job]) -> str:
    parts = []
    for job in jobs:
        where = f" on {job.nodes}" if job.nodes and job.nodes != "(null)" else ""
        progress = f" step {job.step} loss {job.loss:.3f}" if job.step is not None else ""
        parts.append(f"{job.label}: {job.state}{where}{progress}")
    return " | ".join(parts)


def submit_and_wait(cluster: Sandbox, recipes: Path, jobs_dir: Path, job: Job, all_jobs:
                    list[Job], results: Path, command: str, phase: int | None,
                    said: list[str], user: str | None = None) -> None:
    """Submit ``command`` (as ``user``), then watch until ``job`` ends; ``said`` holds the
    last status line printed (across jobs), so a log gets a line only when something
    changed."""
    done = cluster.run(["bash", "-c", command], timeout=60, cwd=jobs_dir, user=user)
    if done.returncode:
        raise SystemExit(f"error: {command} failed: {done.stderr.strip()}")
    job.id = done.stdout.strip().split(";")[0]
    say(f"$ {command.replace(str(recipes) + '/', '')}  -> job {job.id}")
    last_print, shown = 0.0, said[0] if said else ""
    on_terminal = sys.stdout.isatty()
    while True:
        job_info(cluster, job)
        if phase:
            job.step, job.loss = last_step(results, phase, job.id)
        now, line = time.monotonic(), show(all_jobs)
        # A terminal gets a heartbeat every 3 s; a log a line only when something changed.
        if (now - last_print >= 3) if on_terminal else line != shown:
            say(line)
            last_print, shown = now, line
            said[:] = [line]
        if job.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
            break
        time.sleep(1)
    if show(all_jobs) != shown:
        say(show(all_jobs))
        said[:] = [show(all_jobs)]
    if job.state != "COMPLETED":
        log = jobs_dir / f"{JOB_NAMES[job.script]}-{job.id}.out"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise SystemExit(f"error: {job.label} ended {job.state}; its log {log}:\n{tail}")


@dataclass
class Setting:
    """Where the demo's jobs run: the cluster, the recipes, who submits, what they export."""

    cluster: Sandbox
    recipes: Path
    configs: dict[int, Path]
    runtime: str
    user: str | None
    env: str
    image: str  # what the recipes pin: the pushed digest (Pyxis) or the squashfs file


def start_cluster(args: argparse.Namespace, spec: SandboxSpec, converted: dict[str, Any],
                  shared: list[str], folders: dict[str, str]) -> Setting:
    """The sandbox (a Pyxis cluster whose head serves the local registry, or Charliecloud's
    as root) and the recipes rendered for it."""
    work, squashfs = WORK, Path(converted["squashfs"])
    spec.root.mkdir(parents=True, exist_ok=True)
    left = Sandbox.saved(spec.root)
    if left is not None and left.spec.platforms and left.is_up():
        say("the sandbox this checkout left up has an emulated node (demo --platforms): "
            "stopping it")
        imgpipe("sandbox", "down")
    up_args = ["sandbox", "up", "--nodes", "2"]
    user: str | None = None
    extra_env: list[str] = []
    image = str(squashfs)
    if args.runtime == "pyxis":
        account = demopyxis.ensure_user()
        user = account.pw_name
        bin_dir = demopyxis.node_venv(ROOT, ROOT / "build" / "state" / "node-venv")
        node_config = demopyxis.node_config(work, bin_dir / "imgpipe", squashfs.parent)
        up_args += ["--pyxis", "--serve-registry", "--importer",
                    str(bin_dir / "imgpipe-pyxis-importer")]
        repository = str(converted["reference"]).split("@")[0].split("/", 1)[1]
        image = f"head:5000/{repository}@{converted['digest']}"
        extra_env = ["--env", f"IMGPIPE_CONFIG={node_config}"]
        demopyxis.hand_over(account, *(Path(folders[k]) for k in
                                       ("data_dir", "checkpoint_dir", "results_dir")),
                            work / "jobs")
    sandbox_up = imgpipe(*up_args, capture=True)
    cluster = Sandbox.saved(Path(sandbox_up["owner"])) or Sandbox(spec)
    if not sandbox_up["started_here"]:
        shared.append(f"the sandbox {cluster.spec.name!r} ({cluster.root})")
    if shared:
        say(f"using {' and '.join(shared)}, started from another checkout: this demo "
            "leaves them running")
    recipes = work / "recipes"
    configs = render_recipes(work, recipes, folders, image, args.runtime, extra_env)
    if user is not None:
        demopyxis.readable(recipes, *(Path(folders[k]) for k in
                                      ("dataset_source", "vocab", "bert_config")))
    # Four ranks share this machine's cores: one thread each (a node would set its own).
    # LOG_FREQ=10: each logged loss is the mean of 10 steps (a 16-sequence step's loss alone
    # varies by +-0.5), so the first and final losses compare means, as NVIDIA's recipe logs.
    env = ("export USER=${USER:-root} CHECKPOINT_EVERY=50 LOG_FREQ=10 OMP_NUM_THREADS=1 "
           "PATH=/usr/local/bin:/usr/bin:/bin")
    return Setting(cluster, recipes, configs, args.runtime, user, env, image)


def run_jobs(setting: Setting, state: dict[str, Any], work: Path, corpus: Path) -> list[Job]:
    """The dataset, both phases and the NCCL check, each skipped when an earlier run left
    its complete output."""
    data, ckpt, results, jobs_dir = (work / "data", work / "checkpoints", work / "results",
                                     work / "jobs")
    cluster, recipes, env, user = setting.cluster, setting.recipes, setting.env, setting.user
    jobs = [Job("dataset.sub", "dataset"), Job("run.sub", "phase 1"),
            Job("run.sub", "phase 2"), Job("nccl.sub", "nccl")]
    for job in jobs:
        job.runtime = setting.runtime
    previous = {j["label"]: j for j in state.get("jobs", [])}
    said: list[str] = []  # the last job status line printed
    # 1. the dataset, unless a complete one is there
    if (data / "summary.json").exists() and "dataset" in previous:
        jobs[0].__dict__.update({**previous["dataset"], "skipped": True})
        say("dataset: prepared before (data/summary.json), skipped")
    else:
        submit_and_wait(cluster, recipes, jobs_dir, jobs[0], jobs, results,
                        f"{env} && sbatch --parsable -N2 --ntasks-per-node=1 "
                        f"{recipes}/dataset.sub", None, said, user)
    # 2. both phases
    for phase, job in ((1, jobs[1]), (2, jobs[2])):
        final = ckpt / f"phase{phase}" / f"ckpt_{STEPS[phase]}.pt"
        if final.exists() and job.label in previous:
            job.__dict__.update({**previous[job.label], "skipped": True})
            say(f"{job.label}: trained before ({final.name}), skipped")
            continue
        submit_and_wait(cluster, recipes, jobs_dir, job, jobs, results,
                        f"{env} && source {setting.configs[phase]} && export "
                        f"MAX_STEPS={STEPS[phase]} {PHASE_OVERRIDES[phase]} "
                        f"&& sbatch --parsable -N$DGXNNODES "
                        f"--ntasks-per-node=$DGXNGPU {recipes}/run.sub", phase, said, user)
        job.step, job.loss = last_step(results, phase)
    fill_mask(results, corpus)
    # 3. the NCCL check (bus bandwidth with PyTorch's all-reduce: nccl-tests needs CUDA)
    submit_and_wait(cluster, recipes, jobs_dir, jobs[3], jobs, results,
                    f"{env} && sbatch --parsable -N2 --ntasks-per-node=2 {recipes}/nccl.sub",
                    None, said, user)
    return jobs


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    spec = SandboxSpec(root=ROOT / "build" / "state" / "sandbox", compute_nodes=2,
                       cpus=max(2, os.cpu_count() or 2))
    if args.down:
        return stop_demo()
    state = load_state()
    shared: list[str] = []
    converted = images(state, shared)
    squashfs = Path(converted["squashfs"])
    work = WORK
    data, ckpt, results, jobs_dir = (work / "data", work / "checkpoints", work / "results",
                                     work / "jobs")
    forget_other_inputs(work, state)
    for folder in (data, ckpt, results, jobs_dir):
        folder.mkdir(parents=True, exist_ok=True)
    corpus, vocab, config = inputs(work)
    setting = start_cluster(args, spec, converted, shared, {
        "data_dir": str(data), "checkpoint_dir": str(ckpt), "results_dir": str(results),
        "dataset_source": str(corpus), "vocab": str(vocab), "bert_config": str(config)})
    jobs = run_jobs(setting, state, work, corpus)
    state["jobs"] = [{k: v for k, v in j.__dict__.items() if k != "skipped"} for j in jobs]
    save_state(state)
    pins = {"bert image": str(converted["reference"]), "digest": str(converted["digest"]),
            "squashfs": str(squashfs), "jobs ran": f"{setting.image} ({setting.runtime})"}
    (results / "workflow.json").write_text(json.dumps({
        "jobs": [{"name": j.label, "id": j.id, "state": j.state + (" (earlier run)"
                                                                  if j.skipped else ""),
                  "nodes": j.nodes, "elapsed": j.elapsed, "runtime": j.runtime}
                 for j in jobs],
        "pins": pins}, indent=1))
    made = imgpipe("report", str(results), capture=True)
    print_summary(pins, jobs, made, setting.recipes, time.monotonic() - started)
    pyxis_lines(jobs, jobs_dir)
    return 0


def stop_demo() -> int:
    """`--down`: stop the sandbox and the registry this checkout started."""
    stopped = imgpipe("sandbox", "down", capture=True)
    registry = imgpipe("registry", "down", capture=True)
    say(("sandbox stopped" if stopped.get("stopped") else
         f"sandbox left running: started from {stopped.get('owner')}") + "; " +
        ("registry stopped" if registry.get("stopped") else
         "registry left running: not started from this checkout"
         if registry.get("mode") == "external" else "registry was not running"))
    return 0


def render_recipes(work: Path, recipes: Path, folders: dict[str, str], image: str,
                   runtime: str = "charliecloud", extra: list[str] | None = None
                   ) -> dict[int, Path]:
    """The demo's recipes under ``recipes``, pinned to ``image`` (a squashfs file, or the
    pushed digest for Pyxis); each phase's config file."""
    config_file = work / "imgpipe-demo.yaml"
    config_file.write_text(json.dumps({"recipes": folders}))
    rendered = imgpipe("--config", str(config_file), "recipes", "render", "--profile",
                       "local", "--nodes", "2", "--runtime", runtime, "--image", image,
                       *(extra or []), "-o", str(recipes), capture=True)
    return {s["phase"]: recipes / (f"config_{s['nodes']}x{s['gpus_per_node']}x"
                                   f"{s['per_gpu_batch']}x{s['accumulation']}.sh")
            for s in rendered["shapes"]}


def fill_mask(results: Path, corpus: Path) -> None:
    """What the exported phase 2 model predicts for a few masked corpus sentences, through
    transformers' fill-mask pipeline (this venv has it): RESULTS/fill_mask.json, which the
    report shows."""
    exports = sorted(results.glob("*/export-hf"), key=lambda p: p.stat().st_mtime)
    if not exports:
        say("no exported model in the results (phase 2 ran before EXPORT=hf): no fill-mask")
        return
    text = next(p for p in sorted(corpus.iterdir()) if p.is_file() and p.name != "done")
    say(f"$ python -m bert_trainer.fillmask {exports[-1]} --corpus {text}")
    process.run([sys.executable, "-m", "bert_trainer.fillmask", str(exports[-1]),
                 "--corpus", str(text), "-o", str(results / "fill_mask.json")],
                timeout=600, what="fill-mask")
