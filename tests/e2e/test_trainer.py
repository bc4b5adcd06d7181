"""The BERT trainer (bert_trainer.pretrain): learning, DDP equivalence, exact resume after
SIGTERM, LAMB against a per-parameter reference, fp16 loss scaling, phases, bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bert_trainer import checkpoint
from bert_trainer.config import TINY
from bert_trainer.model import BertForPreTraining
from bert_trainer.synthetic import write_shards

from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = [sys.executable, "-m", "bert_trainer.pretrain"]
SEQ, PRED = 32, 5


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards") / "phase1"
    write_shards(folder, shards=4, per_shard=256, seq_len=SEQ, max_pred=PRED,
                 vocab_size=TINY.vocab_size)
    return folder


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "bert_config.json"
    path.write_text(TINY.to_json())
    return path


def pretrain(shards: Path, config: Path, output: Path, *extra: str, check: bool = True,
             env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [*PRETRAIN, f"--input_dir={shards}", f"--output_dir={output}",
            f"--config_file={config}", f"--max_seq_length={SEQ}",
            f"--max_predictions_per_seq={PRED}", "--train_batch_size=32",
            "--learning_rate=2e-2", "--warmup_proportion=0.05", *extra]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(text: str, event: str = "step") -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == event]


def test_tiny_bert_loss_falls_clearly_on_learnable_data(shards, tiny_config, tmp_path) -> None:
    result = pretrain(shards, tiny_config, tmp_path / "ckpt", "--max_steps=300",
                      "--log_freq=25", f"--results_dir={tmp_path / 'results'}")
    steps = records(result.stdout)
    assert [s["step"] for s in steps] == list(range(25, 301, 25))
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"], steps
    assert steps[-1]["mlm_accuracy"] > 0.4
    assert all(s["sequences_per_s"] > 0 and s["tokens_per_s"] == pytest.approx(
        s["sequences_per_s"] * SEQ, rel=1e-3) for s in steps)
    summary = records(result.stdout, "summary")[0]
    assert summary["steps"] == 300 and Path(summary["checkpoint"]).name == "ckpt_300.pt"
    # The same lines land in the results folder.
    logged = (tmp_path / "results" / "bert_phase1.jsonl").read_text()
    assert records(logged) == steps


def run_ranks(out: Path, world: int, steps: int, accumulation: int, *extra: str) -> dict:
    out.mkdir()
    worker = [sys.executable, "-m", "tests.trainer_worker", str(out), str(steps),
              str(accumulation), *extra]
    port = str(free_port())
    procs = [subprocess.Popen(worker, cwd=ROOT, env={
        **os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port}) for r in range(world)]
    assert [p.wait(timeout=600) for p in procs] == [0] * world
    return {"steps": json.loads((out / "steps.json").read_text()),
            "weights": torch.load(out / "weights.pt")}


def assert_same_training(one: dict, other: dict, rtol: float, atol: float) -> None:
    # Gradient norms are sensitive to scale (LAMB's update is not): a wrong average
    # over ranks or micro-batches shows here even when the weights would agree.
    assert other["steps"]["grad_norms"] == pytest.approx(one["steps"]["grad_norms"], rel=rtol)
    initial = BertForPreTraining(TINY).state_dict()
    assert sum(float((one["weights"][k] - initial[k]).abs().sum()) for k in initial) > 0
    for name, value in one["weights"].items():
        torch.testing.assert_close(other["weights"][name], value, rtol=rtol, atol=atol,
                                   msg=name)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory) -> dict:
    return run_ranks(tmp_path_factory.mktemp("ddp") / "one", 1, 6, 1)


def test_two_rank_ddp_with_accumulation_equals_one_process_on_the_whole_batch(
        single_process_run, tmp_path) -> None:
    assert_same_training(single_process_run, run_ranks(tmp_path / "two", 2, 6, 2),
                         rtol=1e-4, atol=1e-5)


def test_compiled_ddp_with_no_sync_trains_like_eager(single_process_run, tmp_path) -> None:
    """torch.compile (the default on GPUs) around DDP, with no_sync during accumulation:
    inductor's CPU backend runs the same code path here, so it is checked without a GPU."""
    assert_same_training(single_process_run, run_ranks(tmp_path / "compiled", 2, 6, 2,
                                                       "compile"), rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_logs_the_same_losses(shards, tiny_config,
                                                             tmp_path) -> None:
    common = ["--max_steps=40", "--log_freq=1", "--num_steps_per_checkpoint=1000",
              "--gradient_accumulation_steps=2", "--resume_from_checkpoint"]
    # Dropout on, so the RNG state must be restored too.
    config = tmp_path / "dropout.json"
    config.write_text(json.dumps({**json.loads(tiny_config.read_text()),
                                  "hidden_dropout_prob": 0.1,
                                  "attention_probs_dropout_prob": 0.1}))
    straight = records(pretrain(shards, config, tmp_path / "a", *common).stdout)
    argv = [*PRETRAIN, f"--input_dir={shards}", f"--output_dir={tmp_path / 'b'}",
            f"--config_file={config}", f"--max_seq_length={SEQ}",
            f"--max_predictions_per_seq={PRED}", "--train_batch_size=32",
            "--learning_rate=2e-2", "--warmup_proportion=0.05", *common]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_lines = []
    for line in proc.stdout:
        first_lines.append(line)
        if '"step": 15,' in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3
    first = records("".join(first_lines) + rest)
    stopped = records(rest, "stopped")[0]
    assert stopped["step"] >= 15 and Path(stopped["checkpoint"]).is_file()
    resumed_run = pretrain(shards, config, tmp_path / "b", *common)
    start = records(resumed_run.stdout, "start")[0]
    assert start["step"] == stopped["step"] and start["resumed_from"] == stopped["checkpoint"]
    assert start["data_position"]["offset"] > 0  # mid-shard, where the stopped run left it
    resumed = records(resumed_run.stdout)
    assert resumed[0]["step"] == stopped["step"] + 1
    combined = [(s["step"], s["loss"], s["grad_norm"]) for s in first + resumed]
    assert combined == [(s["step"], s["loss"], s["grad_norm"]) for s in straight]


def test_phase2_starts_from_phase1_with_a_fresh_schedule(shards, tiny_config,
                                                         tmp_path) -> None:
    out = tmp_path / "ckpt"
    pretrain(shards, tiny_config, out, "--max_steps=30", "--log_freq=30")
    phase1 = checkpoint.load(out / "phase1" / "ckpt_30.pt")
    result = pretrain(shards, tiny_config, out, "--max_steps=5", "--log_freq=1", "--phase2",
                      f"--init_checkpoint={out}", "--resume_from_checkpoint",
                      "--learning_rate=1e-2", "--warmup_proportion=0.4")
    steps = records(result.stdout)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert steps[0]["learning_rate"] == pytest.approx(1e-2 * (1 / 5) / 0.4)  # fresh warm-up
    phase2 = checkpoint.load(out / "phase2" / "ckpt_5.pt")
    assert phase2["phase"] == 2 and phase2["scheduler"]["last_epoch"] == 5
    # It started from phase 1's weights, not from a new initialization: still close to them.
    fresh = BertForPreTraining(TINY).state_dict()
    name = "layers.1.output.weight"
    assert ((phase2["model"][name] - phase1["model"][name]).norm()
            < (phase2["model"][name] - fresh[name]).norm())
    assert phase1["optimizer"]["param_groups"][0]["step"] == 30


def test_phase2_starts_from_hugging_face_or_nvidia_weights_and_records_its_image(
        shards, tiny_config, tmp_path) -> None:
    """Phase 1 here, exported; phase 2 from the export in each layout: the weights arrive
    (the first losses equal phase 1's last), and every log line, checkpoint and export says
    which image the run was in."""
    from bert_trainer.export import main as export

    image = {"IMGPIPE_IMAGE": "head#imgpipe/bert@sha256:" + "c" * 64,
             "IMGPIPE_IMAGE_DIGEST": "sha256:" + "c" * 64}
    out = tmp_path / "ckpt"
    first = pretrain(shards, tiny_config, out, "--max_steps=20", "--log_freq=20", env=image)
    start = records(first.stdout, "start")[0]
    assert start["image_digest"] == image["IMGPIPE_IMAGE_DIGEST"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"{t}\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                             + [f"t{i}" for i in range(5, TINY.vocab_size)]))
    assert export([str(out), "--to", "hf", "-o", str(tmp_path / "hf"),
                   f"--vocab_file={vocab}"]) == 0
    assert export([str(out), "--to", "nvidia", "-o", str(tmp_path / "nv")]) == 0
    # the trained model, as transformers loads it, gives the trainer's logits (padded batch)
    import transformers

    theirs = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ours = BertForPreTraining(TINY).eval()
    ours.load_state_dict(checkpoint.load(out / "phase1" / "ckpt_20.pt")["model"])
    ids = torch.randint(5, TINY.vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, SEQ // 2:] = 0
    ids[mask == 0] = 0
    types = (torch.arange(SEQ) >= SEQ // 3).long().expand(4, -1)
    positions = torch.tensor([[1, 2, 3]] * 4)
    with torch.no_grad():
        mlm, nsp = ours(ids, types, mask, positions)
        hf = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    at = torch.gather(hf.prediction_logits, 1, positions.unsqueeze(-1).expand(-1, -1,
                                                                              TINY.vocab_size))
    torch.testing.assert_close(at, mlm[..., :TINY.vocab_size], atol=1e-5, rtol=0)
    torch.testing.assert_close(hf.seq_relationship_logits, nsp, atol=1e-5, rtol=0)
    meta = json.loads((tmp_path / "hf" / "imgpipe_export.json").read_text())
    assert (meta["phase"], meta["step"], meta["image_digest"]) == (
        1, 20, image["IMGPIPE_IMAGE_DIGEST"]) and meta["loss"] > 0
    # the model card's training table is the run's own record of itself
    card = (tmp_path / "hf" / "README.md").read_text()
    assert (f"| 1 | `{shards}` (4 shards) | {SEQ} | {PRED} | 32 | 20 | {meta['loss']} "
            f"| {image['IMGPIPE_IMAGE_DIGEST']} |") in card.splitlines()
    assert meta["loss"] == records(first.stdout)[-1]["loss"]
    reference = pretrain(shards, tiny_config, tmp_path / "from-ckpt", "--max_steps=2",
                         "--log_freq=1", "--phase2", f"--init_checkpoint={out}")
    for source, layout in ((tmp_path / "hf", "hf"), (tmp_path / "nv" / "bert_nvidia.pt",
                                                      "nvidia")):
        result = pretrain(shards, tiny_config, tmp_path / f"from-{layout}", "--max_steps=2",
                          "--log_freq=1", "--phase2", f"--init_checkpoint={source}")
        assert records(result.stdout, "start")[0]["init_checkpoint"] == f"{source} ({layout})"
        assert [s["loss"] for s in records(result.stdout)] == pytest.approx(
            [s["loss"] for s in records(reference.stdout)], abs=1e-5)


@pytest.fixture(scope="module")
def public_shards(tmp_path_factory) -> Path:
    """Shards for tests.bert_layouts' models: a vocabulary of 99, which the trainer pads
    to 104 (so the padding's share of the softmax would show in the loss)."""
    folder = tmp_path_factory.mktemp("public") / "phase1"
    write_shards(folder, shards=2, per_shard=64, seq_len=SEQ, max_pred=PRED, vocab_size=99)
    return folder


def test_phase1_from_public_weights_starts_at_the_loss_transformers_computes(
        public_shards, tmp_path) -> None:
    """Continued pre-training from the hub's bert-base-uncased layout (pytorch_model.bin
    with old LayerNorm names, config.json beside): the first logged loss is the loss
    transformers' BertForPreTraining computes for the first batch of the run."""
    from bert_trainer.data import ShardStream, shard_files
    from bert_trainer.model import IGNORE

    from tests.bert_layouts import hub_style_folder, made

    theirs = made()
    hub = hub_style_folder(theirs, tmp_path / "bert-base-uncased")
    result = pretrain(public_shards, hub / "config.json", tmp_path / "ckpt", "--max_steps=1",
                      "--log_freq=1", f"--init_checkpoint={hub}")
    assert records(result.stdout, "start")[0]["init_checkpoint"] == f"{hub} (hf)"
    first = records(result.stdout)[0]["loss"]
    # the run's first batch, from its own data stream: rank 0 of 1, the default seed
    batch = next(iter(ShardStream(shard_files(public_shards), 0, 1, 12345, 32, SEQ, PRED, 99)))
    labels = torch.full_like(batch.input_ids, IGNORE)
    used = batch.masked_lm_labels != IGNORE
    rows = torch.arange(len(labels)).unsqueeze(1).expand_as(used)
    labels[rows[used], batch.masked_lm_positions[used]] = batch.masked_lm_labels[used]
    with torch.no_grad():
        reference = theirs(input_ids=batch.input_ids, attention_mask=batch.input_mask.long(),
                           token_type_ids=batch.segment_ids, labels=labels,
                           next_sentence_label=batch.next_sentence_labels).loss
    assert first == pytest.approx(float(reference), abs=1e-5)
    assert int(used.sum()) > 32  # a real MLM loss: many masked slots, not a few


def test_every_public_layout_starts_a_run_or_fails_in_one_line(public_shards, tmp_path) -> None:
    from tests.bert_layouts import dle_checkpoint, made

    config = tmp_path / "config.json"
    made().save_pretrained(tmp_path / "pretraining")  # the same shape, as the run's config
    config.write_text((tmp_path / "pretraining" / "config.json").read_text())
    made("BertForMaskedLM").save_pretrained(tmp_path / "mlm")
    made("BertModel").save_pretrained(tmp_path / "encoder")
    dle = dle_checkpoint(made(), tmp_path / "dle" / "ckpt_8601.pt", data_loader=True)
    made(num_hidden_layers=4).save_pretrained(tmp_path / "deeper")

    def run(init: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        out = tmp_path / f"out-{init.name}-{len(extra)}"
        return pretrain(public_shards, config, out, "--max_steps=1", "--log_freq=1",
                        f"--init_checkpoint={init}", *extra, check=check)

    for init, fresh in ((tmp_path / "mlm", "BertForMaskedLM (hf), has no pooler or "
                         "next-sentence head"),
                        (tmp_path / "encoder", "BertModel (hf), has no masked-LM head or "
                         "next-sentence head")):
        result = run(init)
        warnings = [w["message"] for w in records(result.stdout, "warning")]
        assert warnings == [next(w for w in warnings if fresh in w)], warnings
        assert len(records(result.stdout)) == 1
    for init, trust, expected in (
            (dle, (), "pass --trust_checkpoint"),
            (tmp_path / "deeper", (), "num_hidden_layers: the checkpoint's weights have 4, "
             f"--config_file {config} says 2")):
        result = run(init, *trust, check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.count("\n") == 1 and expected in result.stderr
        assert not records(result.stdout) and not list(tmp_path.glob(f"out-{init.name}-*/*"))
    trusted = run(dle.parent, "--trust_checkpoint")
    assert records(trusted.stdout, "start")[0]["init_checkpoint"] == f"{dle.parent} (nvidia)"


def test_a_resumed_run_says_it_did_not_read_init_checkpoint(shards, tiny_config,
                                                            tmp_path) -> None:
    out = tmp_path / "ckpt"
    pretrain(shards, tiny_config, out, "--max_steps=2", "--log_freq=2")
    again = pretrain(shards, tiny_config, out, "--max_steps=4", "--log_freq=2",
                     "--resume_from_checkpoint", f"--init_checkpoint={tmp_path / 'other'}")
    [warning] = records(again.stdout, "warning")
    assert warning["message"] == (
        f"--init_checkpoint {tmp_path / 'other'} not read: resuming from "
        f"{out / 'phase1' / 'ckpt_2.pt'}, which started from fresh weights")


def test_phase2_without_a_phase1_checkpoint_is_refused(shards, tiny_config, tmp_path) -> None:
    result = pretrain(shards, tiny_config, tmp_path / "c", "--max_steps=5", "--phase2",
                      f"--init_checkpoint={tmp_path / 'nothing'}", check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: --init_checkpoint {tmp_path / 'nothing'}: no ckpt_<step>.pt there")


def test_checkpoints_keep_the_last_k_and_leave_no_temporaries(shards, tiny_config,
                                                              tmp_path) -> None:
    out = tmp_path / "ckpt"
    pretrain(shards, tiny_config, out, "--max_steps=10", "--num_steps_per_checkpoint=2",
             "--keep_checkpoints=2", "--log_freq=10")
    assert sorted(p.name for p in (out / "phase1").iterdir()) == ["ckpt_10.pt", "ckpt_8.pt"]


def test_bad_input_is_one_clear_line(shards, tiny_config, tmp_path) -> None:
    def fails(*extra: str, code: int = 1) -> str:
        result = pretrain(shards, tiny_config, tmp_path / "x", "--max_steps=2", *extra,
                          check=False)
        assert result.returncode == code, result.stderr
        assert "Traceback" not in result.stderr
        return result.stderr.strip().splitlines()[-1]

    assert "is not a multiple of --gradient_accumulation_steps 5" in fails(
        "--gradient_accumulation_steps=5", code=2)
    assert fails(f"--input_dir={tmp_path}") == (
        f"error: --input_dir {tmp_path} holds no .hdf5 shards (prepare them with python -m "
        "bert_trainer.dataset prepare)")
    assert "sequences of 32 tokens with 5 predictions, but this run has --max_seq_length=128" \
        in fails("--max_seq_length=128")
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 30, "num_attention_heads": 4}')
    assert fails(f"--config_file={bad}") == (
        f"error: {bad}: hidden_size 30 is not a multiple of num_attention_heads 4")
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**json.loads(tiny_config.read_text()), "vocab_size": 16}))
    assert "outside the model's vocabulary of 16" in fails(f"--config_file={small}")
    assert fails(f"--output_dir={small}/checkpoints") == (
        f"error: Not a directory: {small}/checkpoints/phase1")
    assert fails(f"--init_checkpoint={tmp_path / 'bert-base-uncasd'}") == (
        f"error: --init_checkpoint {tmp_path / 'bert-base-uncasd'}: no such file or folder")
    assert fails("--max_seq_length=256") == (
        f"error: --max_seq_length 256 is longer than the model's 128 positions "
        f"(max_position_embeddings of --config_file {tiny_config})")


def test_fewer_shards_than_ranks_is_refused(tiny_config, tmp_path) -> None:
    folder = tmp_path / "one"
    write_shards(folder, shards=1, per_shard=16, seq_len=SEQ, max_pred=PRED, vocab_size=64)
    port = str(free_port())
    procs = [subprocess.Popen(
        [*PRETRAIN, f"--input_dir={folder}", f"--output_dir={tmp_path / 'o'}",
         f"--config_file={tiny_config}", f"--max_seq_length={SEQ}",
         f"--max_predictions_per_seq={PRED}", "--max_steps=2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port}) for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert outputs[0][1].strip().splitlines()[-1] == (
        f"error: 1 shard(s) in {folder} for 2 ranks: every rank reads distinct shards, so "
        "there must be at least as many shards as ranks")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_train_end_to_end(precision, shards, tiny_config,
                                               tmp_path) -> None:
    result = pretrain(shards, tiny_config, tmp_path / "ckpt", "--max_steps=60",
                      "--log_freq=20", f"--{precision}")
    assert records(result.stdout, "start")[0]["precision"] == precision
    steps = records(result.stdout)
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    # Only fp16 scales the loss, and the scale is reported with each line.
    assert all(("loss_scale" in s) == (precision == "fp16") for s in steps)


def test_resuming_on_another_rank_count_restarts_the_data_at_the_next_epoch(
        shards, tiny_config, tmp_path) -> None:
    out = tmp_path / "ckpt"
    pretrain(shards, tiny_config, out, "--max_steps=8", "--num_steps_per_checkpoint=4",
             "--log_freq=4")
    (out / "phase1" / "ckpt_8.pt").unlink()  # as if stopped at step 4
    port = str(free_port())
    argv = [*PRETRAIN, f"--input_dir={shards}", f"--output_dir={out}",
            f"--config_file={tiny_config}", f"--max_seq_length={SEQ}",
            f"--max_predictions_per_seq={PRED}", "--train_batch_size=16",
            "--learning_rate=2e-2", "--warmup_proportion=0.05", "--max_steps=8",
            "--log_freq=1", "--resume_from_checkpoint"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:]
    stdout = outputs[0][0]
    assert records(stdout, "warning")[0]["message"] == (
        "checkpoint from 1 ranks resumed on 2: data restarts at epoch 1")
    assert records(stdout, "start")[0]["data_position"] == {"epoch": 1, "shard": 0,
                                                            "offset": 0}
    assert [s["step"] for s in records(stdout)] == [5, 6, 7, 8]
    assert outputs[1][0] == ""  # only rank 0 logs
