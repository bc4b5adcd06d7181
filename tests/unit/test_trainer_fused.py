"""One fused LAMB step (torch.compile of bert_trainer.lamb.lamb_step) against today's
LAMB, and the O2 option (bf16 weights, fp32 master weights in LAMB), on the CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from bert_trainer.config import TINY
from bert_trainer.data import KEYS, Position, to_batch
from bert_trainer.lamb import Lamb, parameter_groups
from bert_trainer.model import BertForPreTraining
from bert_trainer.synthetic import instances
from bert_trainer.trainer import Trainer

SEQ, PRED = 32, 5


def lamb_pair() -> tuple[list[torch.Tensor], list[torch.Tensor], Lamb, Lamb]:
    """The same weights twice (a matrix, a vector, a zero tensor in each group), and today's
    LAMB and the fused one over them."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(24, 16), (16,), (3, 5, 7), (40,), (8, 8)]
    decay = [0.01, 0.0, 0.01, 0.0, 0.01]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    weights[4].zero_()  # a zero weight: trust ratio 1
    eager = [w.clone().requires_grad_() for w in weights]
    fused = [w.clone().requires_grad_() for w in weights]

    def groups(params: list[torch.Tensor]) -> list[dict]:
        return [{"params": [p for p, d in zip(params, decay, strict=True) if d],
                 "weight_decay": 0.01},
                {"params": [p for p, d in zip(params, decay, strict=True) if not d],
                 "weight_decay": 0.0}]

    return (eager, fused, Lamb(groups(eager), lr=0.05),
            Lamb(groups(fused), lr=0.05, fused=True))


def fused_step_matches_todays() -> None:
    """Five steps of both optimizers, compared (run in a fresh interpreter: see the test)."""
    torch._dynamo.reset()
    eager, fused, one, other = lamb_pair()
    gen = torch.Generator().manual_seed(9)
    for step in range(1, 6):
        for a, b in zip(eager, fused, strict=True):
            # large gradients on odd steps: the global clipping is exercised
            a.grad = torch.randn(a.shape, generator=gen) * (5.0 if step % 2 else 0.05)
            b.grad = a.grad.clone()
        for optimizer in (one, other):
            for group in optimizer.param_groups:
                group["lr"] = 0.05 / step  # as the schedule changes it: no recompilation
        one.step()
        # the first step compiles; a new learning rate or step count must not recompile
        with torch._dynamo.config.patch(error_on_recompile=step > 1):
            other.step()
        torch.testing.assert_close(other.last_grad_norm, one.last_grad_norm, rtol=1e-6,
                                   atol=0)
        for a, b in zip(eager, fused, strict=True):
            torch.testing.assert_close(b.detach(), a.detach(), atol=1e-6, rtol=0)
    assert other.param_groups[0]["step"] == one.param_groups[0]["step"] == 5
    state = other.state_dict()  # saved and restored like today's
    assert state["param_groups"][0]["step"] == 5 and len(state["state"]) == len(fused)


def test_the_fused_lamb_step_gives_todays_update() -> None:
    """In a fresh interpreter: inductor's C++ build imports setuptools, whose distutils shim
    an earlier test of the suite's process can leave unusable (the build then fails on an
    assertion of setuptools' own, before compiling anything)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", "from tests.unit.test_trainer_fused import "
         "fused_step_matches_todays as check; check()"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def batches(count: int, size: int = 8) -> list[list]:
    made = instances(count * size, SEQ, PRED, TINY.vocab_size, np.random.default_rng(21))
    arrays = {key: getattr(made, key) for key in KEYS}
    return [[to_batch([{k: v[i * size:(i + 1) * size] for k, v in arrays.items()}],
                      Position())] for i in range(count)]


def test_o2_keeps_fp32_master_weights_and_trains_like_fp32() -> None:
    data = batches(25)
    curves = []
    for precision, o2 in (("fp32", False), ("bf16", True)):
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
