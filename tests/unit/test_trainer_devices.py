"""Numerics across devices: a checkpoint resumes in a fresh trainer (CPU -> CPU here; GPU ->
CPU -> GPU where there is a GPU), and on a GPU: the fast path (unpadded FlashAttention,
O2, fused LAMB, torch.compile) gives the CPU's fp32 loss curve over 200 tiny steps within
bf16 tolerance, the unpadded path equals the padded one, and bf16 and fp16 (loss scaling)
both train.  The GPU tests skip without one (bench/gpu_trainer.sh runs them there)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from bert_trainer.config import TINY
from bert_trainer.data import KEYS, Batch, Position, to_batch
from bert_trainer.model import BertForPreTraining, pretraining_loss
from bert_trainer.synthetic import instances
from bert_trainer.trainer import Trainer

SEQ, PRED = 32, 5
CPU = torch.device("cpu")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def batches(count: int, size: int = 16, seed: int = 13) -> list[Batch]:
    made = instances(count * size, SEQ, PRED, TINY.vocab_size, np.random.default_rng(seed))
    arrays = {key: getattr(made, key) for key in KEYS}
    return [to_batch([{k: v[i * size:(i + 1) * size] for k, v in arrays.items()}], Position())
            for i in range(count)]


def trainer(device: torch.device, precision: str = "fp32", steps: int = 200,
            fast: bool = False) -> Trainer:
    torch.manual_seed(0)
    return Trainer(BertForPreTraining(TINY), device, precision, 2e-2, 0.05, steps, 1,
                   compile_model=fast, fused_lamb=fast, o2=fast and precision == "bf16")


def curve(run: Trainer, data: list[Batch], device: torch.device) -> list[float]:
    return [float(run.step([batch.to(device)]).loss) for batch in data]


def moved(saved: dict) -> dict:
    """A trainer's state through bytes, as a checkpoint file carries it (loaded on the CPU)."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16-o2"])
def test_a_checkpoint_resumes_in_a_fresh_trainer(precision: str) -> None:
    data = batches(7, size=8)
    kind = precision.split("-")[0]
    o2 = precision.endswith("o2")
    torch.manual_seed(0)
    first = Trainer(BertForPreTraining(TINY), CPU, kind, 2e-2, 0.2, 10, 1, o2=o2)
    curve(first, data[:4], CPU)
    state = moved(first.state_dict())
    straight = curve(first, data[4:], CPU)
    torch.manual_seed(1)  # other initial weights: all must come from the checkpoint
    second = Trainer(BertForPreTraining(TINY), CPU, kind, 2e-2, 0.2, 10, 1, o2=o2)
    second.load_state_dict(state)
    assert second.step_count == 4
    assert curve(second, data[4:], CPU) == straight
    for name, value in first.state_dict()["model"].items():
        assert torch.equal(second.state_dict()["model"][name], value), name


@gpu
def test_the_gpu_fast_path_gives_the_cpu_loss_curve_over_200_steps() -> None:
    data = batches(200)
    on_cpu = curve(trainer(CPU), data, CPU)
    on_gpu = curve(trainer(torch.device("cuda"), "bf16", fast=True), data,
                   torch.device("cuda"))
    assert all(math.isfinite(x) for x in on_gpu)
    gaps = [abs(a - b) for a, b in zip(on_cpu, on_gpu, strict=True)]
    assert max(gaps) < 0.15 and sum(gaps) / len(gaps) < 0.05, (max(gaps), on_cpu[-5:],
                                                               on_gpu[-5:])
    assert sum(on_gpu[-10:]) < sum(on_gpu[:10])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpadded_equals_padded_on_the_gpu(dtype: torch.dtype) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    batch = batches(1, size=32, seed=5)[0].to(device)
    torch.manual_seed(0)
    padded = BertForPreTraining(TINY, unpadded=False).to(device, dtype)
    unpadded = BertForPreTraining(TINY).to(device, dtype)
    unpadded.load_state_dict(padded.state_dict())
    outs = []
    for model in (padded, unpadded):
        mlm, nsp = model(batch.input_ids, batch.segment_ids, batch.input_mask,
                         batch.masked_lm_positions, batch.token_index, batch.cu_seqlens)
        loss, _, _ = pretraining_loss(mlm, batch.masked_lm_labels, nsp,
                                      batch.next_sentence_labels)
        loss.backward()
        outs.append((loss.detach().float(), mlm.detach().float(),
                     torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for ours, theirs in zip(outs[1], outs[0], strict=True):
        error = float((ours - theirs).norm() / theirs.norm().clamp(min=1e-12))
        assert error < tolerance, (dtype, error)


@gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_and_fp16_train_on_the_gpu(precision: str) -> None:
    device = torch.device("cuda")
    run = trainer(device, precision, steps=80)
    losses = curve(run, batches(80, size=32, seed=3), device)
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10]) - 1.0, losses[::10]


@gpu
def test_a_gpu_checkpoint_resumes_on_the_cpu_and_back() -> None:
    device = torch.device("cuda")
    data = batches(9, size=8)
    on_gpu = trainer(device, steps=10)
    curve(on_gpu, data[:3], device)
    cpu = trainer(CPU, steps=10)
    cpu.load_state_dict(moved(on_gpu.state_dict()))
    reference = curve(on_gpu, data[3:6], device)
    resumed = curve(cpu, data[3:6], CPU)
    assert resumed == pytest.approx(reference, abs=1e-3)
    back = trainer(device, steps=10)
    back.load_state_dict(moved(cpu.state_dict()))
    assert back.step_count == cpu.step_count == 6
    assert curve(back, data[6:], device) == pytest.approx(curve(cpu, data[6:], CPU), abs=1e-3)
