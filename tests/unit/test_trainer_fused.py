"""The O2 option (bf16 weights, fp32 master weights in LAMB) on the CPU.  The fused LAMB step
(torch.compile of bert_trainer.lamb.lamb_step) against today's LAMB compiles, so it is
tests/e2e/test_trainer_slow.py's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from bert_trainer.config import TINY
from bert_trainer.data import KEYS, Position, to_batch
from bert_trainer.lamb import parameter_groups
from bert_trainer.model import BertForPreTraining
from bert_trainer.synthetic import instances
from bert_trainer.trainer import Precision, Trainer

SEQ, PRED = 32, 5


def batches(count: int, size: int = 8) -> list[list]:
    made = instances(count * size, SEQ, PRED, TINY.vocab_size, np.random.default_rng(21))
    arrays = {key: getattr(made, key) for key in KEYS}
    return [[to_batch([{k: v[i * size:(i + 1) * size] for k, v in arrays.items()}],
                      Position())] for i in range(count)]


def test_o2_keeps_fp32_master_weights_and_trains_like_fp32() -> None:
    data = batches(25)
    curves = []
    runs: tuple[tuple[Precision, bool], ...] = (("fp32", False), ("bf16", True))
    for precision, o2 in runs:
        torch.manual_seed(0)
        trainer = Trainer(BertForPreTraining(TINY), torch.device("cpu"), precision, 2e-2,
                          0.1, 25, 1, o2=o2)
        curves.append([float(trainer.step(batch).loss) for batch in data])
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    masters = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in masters} == {torch.float32}
    assert all(math.isfinite(x) for x in curves[1])
    # bf16 activations: the curve within bf16's rounding of the fp32 one
    assert curves[1] == pytest.approx(curves[0], abs=0.02)
    saved = trainer.state_dict()["model"]
    assert {v.dtype for v in saved.values()} == {torch.float32}
    torch.manual_seed(0)
    initial = BertForPreTraining(TINY).state_dict()
    assert sum(float((saved[k] - initial[k]).abs().sum()) for k in initial) > 0
    # the bf16 model is its masters, rounded
    for name, value in trainer.model.named_parameters():
        assert torch.equal(value, saved[name].to(torch.bfloat16)), name


def test_o2_accumulates_micro_batches_in_fp32() -> None:
    """Accumulation 4 x 2 gives the gradient norm of one batch of 8 (bf16 tolerance)."""
    data = batches(4, size=8)
    norms = []
    for accumulation in (1, 4):
        torch.manual_seed(0)
        trainer = Trainer(BertForPreTraining(TINY), torch.device("cpu"), "bf16", 1e-2, 0.1,
                          4, accumulation, o2=True)
        per_step = []
        for batch in data:
            whole = batch[0]
            size = 8 // accumulation
            micro = [to_batch([slice_of(whole, i * size, size)], Position())
                     for i in range(accumulation)]
            trainer.step(micro)
            per_step.append(float(trainer.optimizer.last_grad_norm))
        norms.append(per_step)
    assert norms[1] == pytest.approx(norms[0], rel=2e-2)


def slice_of(batch, start: int, size: int) -> dict[str, np.ndarray]:
    """Shard-style arrays of rows start:start+size of a batch."""
    rows = slice(start, start + size)
    positions = batch.masked_lm_positions[rows].numpy()
    return {"input_ids": batch.input_ids[rows].numpy(),
            "input_mask": batch.input_mask[rows].numpy(),
            "segment_ids": batch.segment_ids[rows].numpy(),
            "masked_lm_positions": positions,
            "masked_lm_ids": np.where(positions > 0, batch.masked_lm_labels[rows].numpy(), 0),
            "next_sentence_labels": batch.next_sentence_labels[rows].numpy()}


def test_parameter_groups_split_decay_as_before() -> None:
    model = BertForPreTraining(TINY)
    decayed, plain = parameter_groups(model, 0.01, model.no_decay_names())
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
