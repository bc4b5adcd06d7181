"""`imgpipe report`: plots and one self-contained page from what real jobs leave in
RESULTSDIR (the trainer's logs of both phases, an all-reduce benchmark's log), opened in
headless Chromium the way a person opens it."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from bert_trainer.config import TINY
from bert_trainer.synthetic import write_shards

PRETRAIN = [sys.executable, "-m", "bert_trainer.pretrain"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A RESULTSDIR as run.sub and nccl.sub leave it: <job>-<id>/bert_phaseN.jsonl per job
    (phase 1 in two jobs, as after a requeue), nccl-<id>.log."""
    root = tmp_path_factory.mktemp("workflow")
    config = root / "bert_config.json"
    config.write_text(TINY.to_json())
    out = root / "results"
    for phase, seq, pred in ((1, 32, 5), (2, 64, 8)):
        write_shards(root / "data" / f"phase{phase}", shards=2, per_shard=128, seq_len=seq,
                     max_pred=pred, vocab_size=TINY.vocab_size)
    runs = [(1, 32, 5, 30, "bert-pretrain-11"), (1, 32, 5, 60, "bert-pretrain-12"),
            (2, 64, 8, 20, "bert-pretrain-13")]
    for phase, seq, pred, steps, job in runs:
        extra = ["--phase2", f"--init_checkpoint={root / 'ckpt'}"] if phase == 2 else []
        done = subprocess.run(
            [*PRETRAIN, f"--input_dir={root / 'data' / f'phase{phase}'}",
             f"--output_dir={root / 'ckpt'}", f"--config_file={config}",
             f"--max_seq_length={seq}", f"--max_predictions_per_seq={pred}",
             "--train_batch_size=16", "--learning_rate=2e-2", "--warmup_proportion=0.05",
             f"--max_steps={steps}", "--log_freq=5", "--resume_from_checkpoint",
             "--num_steps_per_checkpoint=30", f"--results_dir={out / job}", *extra],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    torchrun = Path(sys.executable).parent / "torchrun"
    bench = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), "-m", "bert_trainer.allreduce_bench",
         "-b", "1K", "-e", "1M", "-f", "4", "-n", "5", "-w", "2"],
        capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    (out / "nccl-14.log").write_text(bench.stdout)
    (out / "workflow.json").write_text(json.dumps({
        "jobs": [{"name": "phase 1", "id": "12", "state": "COMPLETED", "nodes": "node[1-2]",
                  "elapsed": "00:00:41"}],
        "pins": {"squashfs": "/images/imgpipe+bert+sha256-abc.sqsh"}}))
    return out


def test_report_plots_and_page(cli, results: Path, tmp_path: Path) -> None:
    from PIL import Image

    code, out, err = cli("report", str(results), "-o", str(tmp_path / "report"))
    assert code == 0, out + err
    names = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert names == ["loss.png", "mlm_accuracy.png", "nccl_busbw.png", "throughput.png"]
    for name in names:
        with Image.open(tmp_path / "report" / name) as image:
            assert image.format == "PNG" and image.size[0] >= 600
            assert len(image.convert("L").getcolors(maxcolors=1 << 16)) > 10  # drawn
    assert "phase1: 60 steps" in out and "phase2: 20 steps" in out
    assert "nccl: PASS: all_reduce on 2 rank(s)" in out
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "src=\"loss.png\"" not in page

    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed (./setup.sh installs it)"
    # Copied alone into an empty folder: the page needs nothing beside it.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(tmp_path / "report" / "index.html", alone / "index.html")
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
         "--dump-dom", (alone / "index.html").as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    assert 'data-plots-loaded="4"' in dom, dom[:2000]
    training = re.search(r'<table class="training">(.*?)</table>', dom, re.S)
    assert training and training.group(1).count("<tr>") == 3  # header + two phases
    assert '<table class="jobs">' in dom and "node[1-2]" in dom
    assert '<table class="pins">' in dom and "sha256-abc.sqsh" in dom
    assert 'id="nccl-verdict">PASS' in dom


def test_report_of_an_empty_folder_is_a_one_line_error(cli, tmp_path: Path) -> None:
    code, out, err = cli("report", str(tmp_path))
    assert code != 0 and "holds no trainer log" in err and "Traceback" not in err
    code, out, err = cli("report", str(tmp_path / "missing"))
    assert code != 0 and "does not exist" in err
