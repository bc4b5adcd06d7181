"""The trainer's parts in one process: LAMB, loss scaling, the schedule, the shard stream and its
prefetch, config files (tests/e2e/test_trainer.py runs the trainer itself)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from bert_trainer.config import TINY, BertConfig, ConfigError
from bert_trainer.data import KEYS, Position, ShardStream, to_batch
from bert_trainer.lamb import Lamb
from bert_trainer.model import BertForPreTraining
from bert_trainer.schedule import poly_warmup_factor
from bert_trainer.synthetic import instances, write_shards
from bert_trainer.trainer import Trainer

SEQ, PRED = 32, 5  # as tests/e2e/test_trainer.py


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


