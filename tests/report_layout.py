"""A RESULTSDIR laid out as the demo's four jobs leave it, for the report's page tests.

The job scripts are rendered and run by bash as Slurm would start them, with a `srun`
that only records its arguments (the real one runs them in tests/e2e/test_cluster.py), so
every ``ran_in.json`` is written by the scripts themselves. What the programs inside would
have written (the trainer's log lines, the benchmark's table, the export's metadata, the
fill-mask predictions) is added in their formats, with values long enough to show whether
the page keeps them inside its width.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle

DIGEST = "sha256:" + "3f9a0c" * 10 + "d2e1"
IMAGE = f"/shared/imgpipe/squashfs/imgpipe+bert+{DIGEST.replace(':', '-')}.sqsh"
JOBS = [("dataset.sub", "bert-dataset", "101", "dataset"),
        ("run.sub", "bert-pretrain", "102", "phase 1"),
        ("run.sub", "bert-pretrain", "103", "phase 2"),
        ("nccl.sub", "nccl-check", "104", "nccl")]
NCCL_LOG = "\n".join([  # nccl-tests' table, as the PyTorch benchmark prints it too
    "#  Rank  0 Group  0 Pid  10 on      node1 device  0 [0x00] cpu",
    "#  Rank  1 Group  0 Pid  11 on      node2 device  0 [0x00] cpu",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong",
    "        1024           256     float     sum      -1    100.0    0.01    0.01      0"
    "    100.0    0.01    0.01      0",
    "     1048576        262144     float     sum      -1   1000.0    1.05    1.05      0"
    "   1000.0    1.05    1.05      0",
    "# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 0.53", ""])
FAKE_SRUN = "#!/bin/bash\nexit 0\n"


def jobs_results(root: Path) -> Path:
    """RESULTSDIR after dataset.sub, run.sub (phase 1 and 2) and nccl.sub; returns it."""
    results, bin_dir = root / "results", root / "bin"
    for folder in (results, bin_dir, root / "data", root / "ckpt", root / "source"):
        folder.mkdir(parents=True)
    (root / "vocab.txt").write_text("[PAD]\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).write_text(FAKE_SRUN)
        (bin_dir / tool).chmod(0o755)
    recipes = root / "recipes"
    bundle = render_bundle(RecipeInputs(
        load_profile("local"), 2, IMAGE, runtime="charliecloud", image_digest=DIGEST,
        data_dir=str(root / "data"), checkpoint_dir=str(root / "ckpt"),
        results_dir=str(results), dataset_source=str(root / "source"),
        vocab=str(root / "vocab.txt")), recipes)
    for script, name, job_id, label in JOBS:
        phase = label.removeprefix("phase ") if label.startswith("phase") else None
        sourced = (f"source {recipes / bundle.shapes[int(phase) - 1].config_name} && "
                   if phase else "")
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": job_id,
               "SLURM_JOB_NAME": name, "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "4",
               **({"PHASE": phase} if phase else {})}
        done = subprocess.run(["bash", "-c", f"{sourced}bash {recipes / script}"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, (script, done.stderr)
    _programs_output(results)
    (results / "workflow.json").write_text(json.dumps({
        "jobs": [{"name": label, "id": job_id, "state": "COMPLETED", "nodes": "node[1-2]",
                  "elapsed": "00:01:41", "runtime": "pyxis"} for _, _, job_id, label in JOBS],
        "pins": {"bert image": f"127.0.0.1:5000/imgpipe/bert@{DIGEST}", "digest": DIGEST,
                 "squashfs": IMAGE}}, indent=1))
    return results


def _programs_output(results: Path) -> None:
    for job, phase, first, final in (("bert-pretrain-102", 1, 8.32, 3.96),
                                     ("bert-pretrain-103", 2, 4.1, 3.5)):
        lines = [{"event": "start", "phase": phase, "step": 0, "image": IMAGE,
                  "image_digest": DIGEST}]
        lines += [{"event": "step", "step": step, "loss": round(first + (final - first)
                                                               * step / 100, 4),
                   "mlm_accuracy": 0.1 + step / 400, "sequences_per_s": 150.0 + step}
                  for step in range(10, 101, 10)]
        (results / job / f"bert_phase{phase}.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines))
    (results / "nccl-104.log").write_text(NCCL_LOG)
    export = results / "bert-pretrain-103" / "export-hf"
    export.mkdir()
    (export / "imgpipe_export.json").write_text(json.dumps({
        "layout": "hf", "checkpoint": "/checkpoints/phase2/ckpt_300.pt",
        "source_layout": "trainer", "phase": 2, "step": 300, "loss": 3.5, "image": IMAGE,
        "image_digest": DIGEST}))
    (results / "fill_mask.json").write_text(json.dumps([
        {"masked": "licensed under the apache license , version 2 . 0 ( the [MASK] ) ; "
                   "you may not", "word": "license",
         "predictions": [{"token": "license", "score": 0.41}, {"token": "software",
                                                               "score": 0.12}]},
        {"masked": "the software is provided \" as is \" , without [MASK] of any kind , "
                   "express or", "word": "warranty",
         "predictions": [{"token": "the", "score": 0.2}, {"token": "warranty", "score": 0.1}]},
        {"masked": "permission is hereby granted , free of charge , to any [MASK] obtaining",
         "word": "person",
         "predictions": [{"token": "copy", "score": 0.3}, {"token": "the", "score": 0.2}]}]))
