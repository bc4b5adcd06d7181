"""Grace beside x86 on this machine: ``./setup.sh demo --platforms linux/amd64,linux/arm64``.

What a site with x86 and Grace (GH200, GB200) nodes does, with the commands a user types:

1. ``imgpipe base-image`` for each platform (arm64: debootstrap under emulation, once);
2. ``imgpipe build bert --flavor cpu --platform linux/amd64,linux/arm64``: pip on this host
   takes each platform's wheels (the +cpu torch where one is offered, else PyPI's CUDA
   build: what a GH200 runs), and the build says which; ``selftest`` (arm64 under
   emulation), ``push`` (one index), ``convert`` each platform here;
3. ``imgpipe sandbox up --node-platform node2=linux/arm64``: node1 x86, node2 arm64;
4. ``dataset.sub`` on node1, then ``run.sub`` phase 1 for a few steps on each node
   (``--constraint=amd64``, ``--constraint=arm64``): run.sub picks each node's image;
5. ``imgpipe report``: each job with the digest it ran in, and a summary with each
   stage's time.

Its outputs are under build/demo-platforms; the default demo's are left alone.  Idempotent
as the default demo is.  It adds many minutes to the default demo (the arm64 image holds
PyPI's CUDA torch, ~5 GB; every arm64 step runs under qemu), so it is not part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from imgpipe.base.platforms import Platform, host_platform, parse_platforms
from imgpipe.commands.demo.demo import (
    PHASE_OVERRIDES,
    ROOT,
    imgpipe,
    inputs,
    say,
    selftest_if_new,
    submit_and_wait,
    wheels,
)
from imgpipe.commands.demo.demojobs import JOB_NAMES, Job
from imgpipe.recipes.sandbox import Sandbox

WORK = ROOT / "build" / "demo-platforms"
# Phase 1 steps on each node: the loss falls from 8.2 to 7.5 in 20; under emulation a step
# of 16 sequences takes about 13 s here (about 0.05 s on x86).
STEPS = 20
SANDBOX = ROOT / "build" / "state" / "sandbox"


def run(args: argparse.Namespace) -> int:
    platforms = parse_platforms(args.platforms)
    others = [p for p in platforms if p != host_platform()]
    if len(others) != 1 or host_platform() not in platforms:
        raise SystemExit(f"error: --platforms takes this host's platform ({host_platform()}) "
                         "and one other, e.g. linux/amd64,linux/arm64")
    [other] = others
    started = time.monotonic()
    timings: dict[str, float] = {}
    state = _load()
    shared: list[str] = []

    def stage(name: str, since: float) -> None:
        timings[name] = time.monotonic() - since

    since = time.monotonic()
    served = imgpipe("registry", "up", capture=True)
    if served["mode"] == "external":
        shared.append(f"the registry on {served['url']}")
    imgpipe("base-image", "--tag", "imgpipe/debian-python:bookworm")
    imgpipe("base-image", "--platform", str(other))
    stage("base images", since)

    since = time.monotonic()
    built = imgpipe("build", "bert", "--flavor", "cpu", "--platform",
                    ",".join(map(str, platforms)), *wheels(), capture=True)
    outcome = built["images"][0]
    for note in outcome.get("notes") or []:
        say(note)
    stage("build", since)

    since = time.monotonic()
    selftest_if_new(outcome, state, _save)
    stage("self-test", since)

    since = time.monotonic()
    imgpipe("push", "bert")
    stage("push", since)
    since = time.monotonic()
    converted = {str(p): imgpipe("convert", "bert", "--flavor", "cpu", "--platform", str(p),
                                 capture=True) for p in platforms}
    stage("convert", since)

    since = time.monotonic()
    node = f"node2={other}"
    cluster = _sandbox(node)
    if not cluster[1]:
        shared.append(f"the sandbox {cluster[0].spec.name!r} ({cluster[0].root})")
    stage("sandbox", since)
    if shared:
        say(f"using {' and '.join(shared)}, started from another checkout: this demo leaves "
            "them running")
    sandbox = cluster[0]

    work = WORK
    data, results, jobs_dir = work / "data", work / "results", work / "jobs"
    if state.get("steps") != STEPS:  # trained for another length: train again, from scratch
        for stale in [results, *work.glob("checkpoints-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        state.pop("jobs", None)
        state["steps"] = STEPS
        _save(state)
    for folder in (data, results, jobs_dir):
        folder.mkdir(parents=True, exist_ok=True)
    corpus, vocab, config = inputs(work)
    recipes = work / "recipes"
    # No --image: run.sub pins each platform's squashfs from imgpipe.lock and picks the
    # node's.  The folders go to sbatch in the environment, as users pass theirs
    # (DATAPATH=… sbatch dataset.sub): a --config file elsewhere would be another project.
    rendered = imgpipe("recipes", "render", "--profile", "local", "--nodes", "1", "--runtime",
                       "charliecloud", "-o", str(recipes), capture=True)
    phase1 = next(s for s in rendered["shapes"] if s["phase"] == 1)
    config_sh = recipes / (f"config_{phase1['nodes']}x{phase1['gpus_per_node']}x"
                           f"{phase1['per_gpu_batch']}x{phase1['accumulation']}.sh")

    # What a user sources before sbatch: the demo's folders for the scripts, one thread per
    # rank (two ranks share this machine's cores), a logged loss every 5 steps.
    folders = work / "env.sh"
    folders.write_text("export USER=${USER:-root} CHECKPOINT_EVERY=1000 LOG_FREQ=5 "
                       "OMP_NUM_THREADS=1 PATH=/usr/local/bin:/usr/bin:/bin\n" + "".join(
                           f"export {name}={shlex.quote(str(path))}\n" for name, path in (
                               ("DATAPATH", data), ("SOURCE", corpus), ("VOCAB", vocab),
                               ("DATADIR", data), ("RESULTSDIR", results),
                               ("BERT_CONFIG", config))))
    env = f"source {os.path.relpath(folders, jobs_dir)}"  # jobs run from jobs_dir
    here, there = host_platform().architecture, other.architecture
    jobs = [Job("dataset.sub", f"dataset ({here})"), Job("run.sub", f"phase 1 ({here})"),
            Job("run.sub", f"phase 1 ({there})")]
    said: list[str] = []
    since = time.monotonic()
    if (data / "summary.json").exists():
        jobs[0].skipped = True
        say("dataset: prepared before (data/summary.json), skipped")
    else:
        submit_and_wait(sandbox, recipes, jobs_dir, jobs[0], jobs, results,
                        f"{env} && sbatch --parsable -N1 --constraint={here} "
                        f"--ntasks-per-node=1 {recipes}/dataset.sub", None, said)
    stage(f"dataset.sub on {here}", since)
    for job, arch in ((jobs[1], here), (jobs[2], there)):
        since = time.monotonic()
        checkpoints = work / f"checkpoints-{arch}"
        final = checkpoints / "phase1" / f"ckpt_{STEPS}.pt"
        previous = state.get("jobs", {}).get(job.label)
        if final.exists() and previous:
            job.__dict__.update({**previous, "skipped": True})
            say(f"{job.label}: trained before ({final.name}), skipped")
        else:
            submit_and_wait(sandbox, recipes, jobs_dir, job, jobs, results,
                            f"{env} && export CHECKPOINTDIR="
                            f"{shlex.quote(str(checkpoints))} && source {config_sh} && "
                            f"export MAX_STEPS={STEPS} {PHASE_OVERRIDES[1]} && sbatch "
                            f"--parsable -N1 --constraint={arch} --ntasks-per-node=$DGXNGPU "
                            f"{recipes}/run.sub", 1, said)
            state.setdefault("jobs", {})[job.label] = {
                k: v for k, v in job.__dict__.items() if k in ("id", "state", "nodes",
                                                               "elapsed")}
            _save(state)
        stage(f"run.sub phase 1 on {arch}", since)

    since = time.monotonic()
    pins: dict[str, str] = {"bert image (one index)": _index_reference()}
    for name, done in converted.items():
        pins[f"digest {name}"] = str(done["digest"])
        pins[f"squashfs {name}"] = str(done["squashfs"])
    (results / "workflow.json").write_text(json.dumps({
        "jobs": [{"name": j.label, "id": j.id, "state": j.state + (" (earlier run)"
                                                                  if j.skipped else ""),
                  "nodes": j.nodes, "elapsed": j.elapsed} for j in jobs if j.id],
        "pins": pins}, indent=1))
    made = imgpipe("report", str(results), capture=True)
    stage("report", since)
    _summary(pins, converted, jobs, jobs_dir, results, made, timings,
             time.monotonic() - started, other)
    return 0


def _index_reference() -> str:
    """The index every platform's manifest is under (the lock's entry), as pinned."""
    lock = json.loads((ROOT / "imgpipe.lock").read_text())
    entry = lock["images"]["bert"]["cpu"]
    return f"{entry['repository']}@{entry['digest']}"


def _sandbox(node_platform: str) -> tuple[Sandbox, bool]:
    """``imgpipe sandbox up --node-platform NODE=OS/ARCH``; a sandbox this checkout left up
    in another shape (the default demo's) is stopped first.  (sandbox, started here)."""
    running = Sandbox.saved(SANDBOX)
    if running is not None and running.is_up() and running.spec.platforms != node_platform:
        say("the sandbox this checkout left up has no "
            f"{node_platform.split('=', 1)[1]} node: stopping it")
        imgpipe("sandbox", "down")
    up = imgpipe("sandbox", "up", "--nodes", "2", "--node-platform", node_platform,
                 capture=True)
    cluster = Sandbox.saved(Path(up["owner"]))
    if cluster is None:
        raise SystemExit(f"error: no sandbox state under {up['owner']}")
    if cluster.spec.platforms != node_platform:
        raise SystemExit(f"error: the sandbox running from {cluster.root} has no "
                         f"{node_platform}: stop it there (imgpipe sandbox down)")
    return cluster, bool(up["started_here"])


def _summary(pins: dict[str, str], converted: dict[str, dict[str, Any]], jobs: list[Job],
             jobs_dir: Path, results: Path, made: dict[str, Any], timings: dict[str, float],
             seconds: float, other: Platform) -> None:
    say("summary")
    for key, value in pins.items():
        print(f"  {key:<26} {value}")
    for name, done in converted.items():
        size = Path(done["squashfs"]).stat().st_size
        print(f"  {'squashfs size ' + name:<26} {size / 1e9:.2f} GB")
    for job in jobs:
        if not job.id:
            continue
        again = " (done in an earlier run)" if job.skipped else ""
        print(f"  {job.label:<26} job {job.id} {job.state} on {job.nodes} in {job.elapsed}"
              f"{again}")
    ran_in = made["summary"].get("ran_in", {})
    for job in jobs:
        if job.script != "run.sub" or not job.id:
            continue
        losses = _losses(results, job.id)
        image = next((d for name, d in ran_in.items() if name.endswith(f"-{job.id}")), "?")
        if losses:
            print(f"  {job.label:<26} loss {losses[0][1]:.3f} (step {losses[0][0]}) -> "
                  f"{losses[-1][1]:.3f} (step {losses[-1][0]}) in {image}")
    arm = next((j for j in jobs if j.label.endswith(f"({other.architecture})") and j.id), None)
    if arm is not None:
        log = jobs_dir / f"{JOB_NAMES[arm.script]}-{arm.id}.out"
        if log.exists():
            say(f"the {other.architecture} job's log ({log}):")
            for line in log.read_text(errors="replace").splitlines():
                if "run.sub: image" in line or '"event": "step"' in line \
                        or '"event": "start"' in line:
                    print(f"  {line[:220]}")
    say("time per stage")
    for name, spent in timings.items():
        print(f"  {name:<26} {spent:7.1f} s")
    print(f"  {'report':<26} {made['report']}")
    print(f"  {'total':<26} {seconds:7.1f} s")


def _losses(results: Path, job_id: str) -> list[tuple[int, float]]:
    found = []
    for path in results.glob(f"*-{job_id}/bert_phase1.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "step":
                found.append((int(event["step"]), float(event["loss"])))
    return sorted(found)


def _load() -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads((WORK / "state.json").read_text())
        return state
    except (OSError, ValueError):
        return {}


def _save(state: dict[str, Any]) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = WORK / "state.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, WORK / "state.json")

