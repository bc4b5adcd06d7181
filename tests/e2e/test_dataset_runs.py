"""Dataset preparation (bert_trainer.dataset) run after run: the same seed gives the same
bytes with 1, 2 or 3 workers and split over Slurm tasks, another seed other bytes; a run
killed mid-way resumes to the same output.  Format, statistics and corruption:
tests/unit/test_dataset.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.unit.test_dataset import PY, corpus_with_vocab, digests, prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    return corpus_with_vocab(tmp_path_factory.mktemp("corpus"))


def test_same_seed_same_bytes_with_1_2_or_3_workers(corpus, tmp_path: Path) -> None:
    source, vocab = corpus
    outputs = []
    for workers in (1, 2, 3):
        prepare(source, vocab, tmp_path / f"w{workers}", "--workers", str(workers))
        outputs.append(digests(tmp_path / f"w{workers}"))
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 12
    # Two Slurm tasks splitting the shards give the same bytes too.
    env_out = tmp_path / "tasks"
    procs = [subprocess.Popen([*PY, "prepare", "--source", str(source), "--output", str(env_out),
                               "--vocab", str(vocab), "--shards", "6", "--dupe-factor", "2"],
                              env={**os.environ, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in (0, 1)]
    for proc in procs:
        assert proc.wait(300) == 0, proc.stderr.read()[-2000:]
    assert digests(env_out) == outputs[0]
    prepare(source, vocab, tmp_path / "other-seed", "--seed", "1")
    assert digests(tmp_path / "other-seed") != outputs[0]


def test_killed_run_resumes_to_the_same_output(corpus, tmp_path: Path) -> None:
    source, vocab = corpus
    reference = tmp_path / "reference"
    prepare(source, vocab, reference, "--workers", "1")
    partial = tmp_path / "partial"
    proc = subprocess.Popen([*PY, "prepare", "--source", str(source), "--output", str(partial),
                             "--vocab", str(vocab), "--shards", "6", "--dupe-factor", "2",
                             "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(partial.glob("records/shard_*.json")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(list(partial.glob("records/shard_*.json")))
    assert 1 <= done_before < 6, f"{done_before} shards done when killed: not mid-way"
    summary = prepare(source, vocab, partial, "--workers", "1")
    assert summary["phases"]["1"]["instances"] > 0
    assert digests(partial) == digests(reference)
    assert not list(partial.rglob(".tmp-*"))
