"""`imgpipe report`: plots and one self-contained page from what real jobs leave in
RESULTSDIR (the trainer's logs of both phases, an all-reduce benchmark's log), opened in
headless Chromium the way a person opens it."""

from __future__ import annotations

import json
import os
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
OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


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
        # phase 1 ran in an older image than the one pinned now (a second demo after a
        # change to the image keeps phase 1 "done in an earlier run")
        image = OLD if phase == 1 else NEW
        extra = ["--phase2", f"--init_checkpoint={root / 'ckpt'}"] if phase == 2 else []
        done = subprocess.run(
            [*PRETRAIN, f"--input_dir={root / 'data' / f'phase{phase}'}",
             f"--output_dir={root / 'ckpt'}", f"--config_file={config}",
             f"--max_seq_length={seq}", f"--max_predictions_per_seq={pred}",
             "--train_batch_size=16", "--learning_rate=2e-2", "--warmup_proportion=0.05",
             f"--max_steps={steps}", "--log_freq=5", "--resume_from_checkpoint",
             "--num_steps_per_checkpoint=30", f"--results_dir={out / job}", *extra],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "IMGPIPE_IMAGE_DIGEST": image, "IMGPIPE_IMAGE": "x@" + image})
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
        "pins": {"squashfs": "/images/imgpipe+bert+sha256-abc.sqsh", "digest": NEW}}))
    # phase 2's model exported for Hugging Face, and what transformers' fill-mask makes of it
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                               + [f"word{i}" for i in range(TINY.vocab_size - 5)]) + "\n")
    exported = out / "bert-pretrain-13" / "export-hf"
    for argv in (["bert_trainer.export", str(root / "ckpt"), "--to", "hf", "-o", str(exported),
                  f"--vocab_file={vocab}"],
                 ["bert_trainer.fillmask", str(exported), f"--corpus={corpus(root)}", "-o",
                  str(out / "fill_mask.json")]):
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def corpus(root: Path) -> Path:
    text = root / "corpus.txt"
    text.write_text("".join(f"the word{i} and word{i + 1} met word{i + 2} by the river word{i}"
                            " today\n" for i in range(5, 12)))
    return text


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
    # every job shows the image it ran in; none is shown as the pinned image's when it was not
    jobs = re.search(r'<table class="jobs">(.*?)</table>', dom, re.S)
    assert jobs and OLD in jobs.group(1)  # job 12, phase 1
    mismatches = re.findall(r"<p class=\"fail image-mismatch\">(.*?)</p>", dom)
    assert sorted(m.split(" ")[0] for m in mismatches) == ["bert-pretrain-11",
                                                           "bert-pretrain-12"], mismatches
    exports = re.search(r'<table class="exports">(.*?)</table>', dom, re.S)
    assert exports and "export-hf" in exports.group(1) and NEW in exports.group(1)
    assert re.search(r'<a href="[^"]*export-hf/imgpipe_export.json">', exports.group(1))
    fill = re.search(r'<table class="fill-mask">(.*?)</table>', dom, re.S)
    assert fill and fill.group(1).count("[MASK]") >= 3, dom[-3000:]


# Injected into a copy of the page: what sticks out of a 1280-pixel window or out of the
# page's column (an element's right edge), or is cut off inside its cell.
MEASURE = """<script>window.addEventListener('load', function () {
  var width = document.documentElement.clientWidth, body = document.body, out = [];
  var column = body.getBoundingClientRect().right;
  if (document.documentElement.scrollWidth > width) out.push('page');
  document.querySelectorAll('h1, h2, p, table, td, th, figure, img').forEach(function (e) {
    var right = e.getBoundingClientRect().right;
    if (right > width + 0.5 || right > column + 0.5) out.push(e.tagName + ':' + right);
    if ((e.tagName == 'TD' || e.tagName == 'TH') && e.scrollWidth > e.clientWidth + 1)
      out.push('cut:' + e.textContent.slice(0, 30));
  });
  body.setAttribute('data-window', String(width));
  body.setAttribute('data-overflow', out.join(' | ') || 'none');
});</script>"""


def test_the_page_fits_1280_pixels_and_shows_every_jobs_image(tmp_path: Path) -> None:
    """The demo's four jobs as their scripts leave RESULTSDIR (tests/report_layout.py: the
    dataset and NCCL jobs' ran_in.json too), the page laid out by Chromium at 1280 px."""
    from imgpipe.recipes.report import write_report
    from tests.report_layout import DIGEST, JOBS, jobs_results

    page = Path(write_report(jobs_results(tmp_path))["report"])
    measured = tmp_path / "measured.html"
    measured.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed (./setup.sh installs it)"
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--hide-scrollbars", "--window-size=1280,2400", f"--user-data-dir={tmp_path / 'p'}",
         "--virtual-time-budget=5000", "--dump-dom", measured.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    assert 'data-window="1280"' in dom, dom[:2000]
    assert 'data-overflow="none"' in dom, re.findall(r'data-overflow="([^"]*)"', dom)
    jobs = re.search(r'<table class="jobs">(.*?)</table>', dom, re.S)
    assert jobs, dom[:2000]
    rows = re.findall(r"<tr>(.*?)</tr>", jobs.group(1), re.S)[1:]
    assert [re.findall(r"<td[^>]*>(.*?)</td>", row)[-1] for row in rows] == [DIGEST] * len(JOBS)


def test_report_of_an_empty_folder_is_a_one_line_error(cli, tmp_path: Path) -> None:
    code, out, err = cli("report", str(tmp_path))
    assert code != 0 and "holds no trainer log" in err and "Traceback" not in err
    code, out, err = cli("report", str(tmp_path / "missing"))
    assert code != 0 and "does not exist" in err
