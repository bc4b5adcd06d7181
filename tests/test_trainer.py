"""The BERT trainer (bert_trainer.pretrain): learning, DDP equivalence, exact resume after
SIGTERM, LAMB against a per-parameter reference, fp16 loss scaling, phases, bad input."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from bert_trainer import checkpoint
from bert_trainer.config import TINY, BertConfig, ConfigError
from bert_trainer.data import KEYS, Position, ShardStream, to_batch
from bert_trainer.lamb import Lamb
from bert_trainer.model import BertForPreTraining
from bert_trainer.schedule import poly_warmup_factor
from bert_trainer.synthetic import instances, write_shards
from bert_trainer.trainer import Trainer

from tests.services import free_port

ROOT = Path(__file__).resolve().parent.parent
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


def reference_lamb(params, grads, state, lr, step, beta1=0.9, beta2=0.999, eps=1e-6,
                   decay=(), max_norm=1.0):
    """Plain per-parameter LAMB (NVIDIA's FusedLAMB semantics), written independently."""
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    clip = max_norm / total if total > max_norm else 1.0
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        g = g * clip
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        state[i] = (m, v)
        update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
        wd = decay[i]
        if wd:
            update = update + wd * p
            w_norm, u_norm = p.norm(), update.norm()
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        else:
            ratio = 1.0
        p -= lr * ratio * update


def test_lamb_matches_a_per_parameter_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = [(7, 5), (5,), (3, 4, 2), (11,)]
    decay = [0.01, 0.0, 0.01, 0.0]
    ours = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    ref = [p.clone() for p in ours]
    params = [torch.nn.Parameter(p) for p in ours]
    optimizer = Lamb([{"params": [params[i]], "weight_decay": decay[i]} for i in range(4)],
                     lr=0.05)
    state: dict = {}
    for step in range(1, 8):
        # Large gradients on some steps, so clipping by the global norm is exercised.
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) * (5.0 if step % 2 else
                                                                       0.1) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        reference_lamb(ref, grads, state, 0.05, step, decay=decay)
        for mine, theirs in zip(params, ref, strict=True):
            torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=1e-12)
    assert optimizer.param_groups[0]["step"] == 7


def test_fp16_loss_scaling_recovers_from_an_injected_overflow() -> None:
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    trainer = Trainer(model, torch.device("cpu"), "fp16", 1e-2, 0.1, 50, 1,
                      loss_scale_growth_interval=3)
    made = instances(64, SEQ, PRED, TINY.vocab_size, np.random.default_rng(5))
    arrays = {key: getattr(made, key) for key in KEYS}

    def batch(i: int):
        return [to_batch([{k: v[i * 8:(i + 1) * 8] for k, v in arrays.items()}], Position())]

    trainer.step(batch(0))
    scale = trainer.scaler.get_scale()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    poison = model.layers[0].qkv.weight.register_hook(lambda g: g * float("inf"))
    stats = trainer.step(batch(1))
    poison.remove()
    assert stats.skipped
    assert trainer.scaler.get_scale() == scale / 2
    assert trainer.step_count == 1  # the schedule did not advance
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # the bad step changed nothing
    losses = []
    for i in range(2, 8):
        stats = trainer.step(batch(i))
        assert not stats.skipped
        losses.append(float(stats.loss))
    assert all(math.isfinite(x) for x in losses)
    assert trainer.step_count == 7
    assert trainer.scaler.get_scale() == scale * 2  # grew back after 3 + 3 clean steps
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_schedule_warms_up_linearly_then_decays_to_zero() -> None:
    total, warmup = 100, 0.2
    factors = [poly_warmup_factor(s, total, warmup) for s in range(1, total + 1)]
    assert factors[9] == pytest.approx(0.5)  # step 10 of a 20-step warm-up
    assert factors[19] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[19:-1], factors[20:], strict=True))
    assert factors[-1] == 0.0
    assert factors[59] == pytest.approx(math.sqrt(0.5))  # (0.6 - 1) / (0.2 - 1) = 0.5


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


def test_every_rank_reads_distinct_shards_and_the_stream_resumes_exactly(tmp_path) -> None:
    files = write_shards(tmp_path, shards=5, per_shard=12, seq_len=SEQ, max_pred=PRED,
                         vocab_size=64)

    def stream(rank: int, world: int, start: Position | None = None) -> ShardStream:
        return ShardStream(files, rank, world, 7, 5, SEQ, PRED, 64, start)

    for epoch in range(3):
        owned = [set(stream(r, 2).shards_of_epoch(epoch)) for r in range(2)]
        assert not owned[0] & owned[1] and owned[0] | owned[1] == set(range(5))
    assert stream(0, 2).shards_of_epoch(0) != stream(0, 2).shards_of_epoch(1)
    whole = iter(stream(1, 2))
    taken = [next(whole) for _ in range(9)]  # crosses shard and epoch boundaries
    resumed = iter(stream(1, 2, taken[3].position))
    for expected in taken[4:]:
        got = next(resumed)
        assert torch.equal(got.input_ids, expected.input_ids)
        assert got.position == expected.position
    assert taken[-1].position.epoch >= 1


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


def test_config_files_from_other_trainers_load() -> None:
    config = BertConfig.from_dict({"vocab_size": 30522, "architectures": ["BertForMaskedLM"],
                                   "model_type": "bert"})
    assert config.padded_vocab_size == 30528 and config.num_hidden_layers == 24
    with pytest.raises(ConfigError, match="hidden_dropout_prob: must be in"):
        BertConfig.from_dict({"hidden_dropout_prob": 2})
    # BERT-Large's matmul FLOPs per 128-token training sequence, as FACTS.md puts it.
    assert BertConfig().training_flops_per_sequence(128, 20) == pytest.approx(240e9, rel=0.02)


def test_prefetch_errors_reach_the_training_loop(tmp_path) -> None:
    from bert_trainer.data import DataError, Prefetcher

    def broken():
        yield 1
        raise DataError("shard 3 is corrupt")

    fetched = Prefetcher(broken(), depth=1)
    assert next(fetched) == 1
    with pytest.raises(DataError, match="corrupt"):
        next(fetched)
    fetched.close()


def test_the_next_shard_is_read_while_the_current_one_is_consumed(tmp_path) -> None:
    files = write_shards(tmp_path, shards=3, per_shard=10, seq_len=SEQ, max_pred=PRED,
                         vocab_size=64)
    started: list[int] = []
    second_started = threading.Event()

    class Recording(ShardStream):
        def load(self, index: int, epoch: int):
            started.append(index)
            if len(started) == 2:
                second_started.set()
            return super().load(index, epoch)

    stream = iter(Recording(files, 0, 1, 7, 5, SEQ, PRED, 64))
    first = next(stream)  # the first batch of the first shard (10 rows, batches of 5)
    assert first.position.shard == 0 and first.position.offset == 5
    # Nothing more is asked of the stream, yet the next shard's read begins.
    assert second_started.wait(timeout=30), "the next shard was not read ahead"
    assert len(started) == 2


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
