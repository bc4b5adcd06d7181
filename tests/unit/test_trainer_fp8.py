"""``--fp8`` (bert_trainer/fp8.py): torchao's float8 training on the encoder's linear layers
only.  On the CPU through torchao's emulation (the same float8 casts, the matmul in high
precision): the converted model is the same function within float8's rounding, the right
modules were swapped and keep their names, the trainer steps with it; and every way the
flag cannot run is one line.  On a GPU with float8 matmuls (compute capability 8.9+: H100,
H200) the real kernels train, compiled (bench/gpu_trainer.sh runs this file there).  The
tests that need torchao skip only where it cannot be imported (the test extra installs it)."""

from __future__ import annotations

import builtins
import copy
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from bert_trainer import fp8
from bert_trainer.config import TINY
from bert_trainer.data import KEYS, Batch, Position, to_batch
from bert_trainer.model import BertForPreTraining, pretraining_loss
from bert_trainer.pretrain import main as pretrain_main
from bert_trainer.synthetic import instances, write_shards
from bert_trainer.trainer import Trainer
from torch import nn

from tests.trainer_signals import handlers_kept

SEQ, PRED = 32, 5
CPU = torch.device("cpu")
ENCODER = {f"layers.{i}.{name}" for i in range(TINY.num_hidden_layers)
           for name in ("qkv", "attention_out", "intermediate", "output")}


@pytest.fixture(scope="module")
def torchao() -> ModuleType:
    """torchao.float8 (its first import takes a few seconds), or a skip without torchao."""
    pytest.importorskip("torchao", reason="torchao is not installed")
    return fp8.torchao_float8()


def batches(count: int, size: int = 8, seed: int = 4) -> list[Batch]:
    made = instances(count * size, SEQ, PRED, TINY.vocab_size, np.random.default_rng(seed))
    arrays = {key: getattr(made, key) for key in KEYS}
    return [to_batch([{k: v[i * size:(i + 1) * size] for k, v in arrays.items()}], Position())
            for i in range(count)]


def forward_backward(model: BertForPreTraining, batch: Batch) -> dict:
    model.zero_grad(set_to_none=True)
    mlm, nsp = model(batch.input_ids, batch.segment_ids, batch.input_mask,
                     batch.masked_lm_positions, batch.token_index, batch.cu_seqlens)
    loss, _, _ = pretraining_loss(mlm, batch.masked_lm_labels, nsp, batch.next_sentence_labels)
    loss.backward()
    return {"loss": loss.detach().float(), "mlm": mlm.detach().float(),
            "grads": {n: grad(p) for n, p in model.named_parameters()}}


def grad(parameter: torch.Tensor) -> torch.Tensor:
    assert parameter.grad is not None
    return parameter.grad.float()


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm().clamp(min=1e-12))


def test_only_the_encoders_linear_layers_become_float8(torchao: ModuleType) -> None:
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    names = list(model.state_dict())
    assert set(fp8.convert_encoder(model, emulate=True)) == ENCODER
    swapped = {name for name, module in model.named_modules()
               if type(module).__name__ == "Float8Linear"}
    assert swapped == ENCODER
    # the heads and the pooler stay bf16 nn.Linear; the decoder is the embedding matrix
    for name in ("mlm_transform", "pooler", "nsp"):
        assert type(model.get_submodule(name)) is nn.Linear, name
    assert type(model.embeddings.word_embeddings) is nn.Embedding
    assert list(model.state_dict()) == names  # checkpoints move between --fp8 and bf16
    # the unpadded token count reaches torch._scaled_mm as the weight gradient's inner
    # dimension: torchao pads it to a multiple of 16
    layer: Any = model.get_submodule("layers.0.qkv")  # torchao's Float8Linear
    assert layer.config.pad_inner_dim and layer.config.emulate
    padded = BertForPreTraining(TINY, unpadded=False)
    fp8.convert_encoder(padded, emulate=True)
    other: Any = padded.get_submodule("layers.0.qkv")
    assert not other.config.pad_inner_dim


def test_the_float8_model_is_the_same_function_within_float8_rounding(
        torchao: ModuleType) -> None:
    torch.manual_seed(0)
    reference = BertForPreTraining(TINY).to(torch.bfloat16)
    converted = copy.deepcopy(reference)
    fp8.convert_encoder(converted, emulate=True)
    batch = batches(1, size=16)[0]
    theirs, ours = forward_backward(reference, batch), forward_backward(converted, batch)
    # e4m3 (3-bit mantissa) activations and weights: the outputs within 2 %
    assert relative(ours["loss"], theirs["loss"]) < 0.02
    assert 0 < relative(ours["mlm"], theirs["mlm"]) < 0.02  # and float8 did run
    for name, grad in theirs["grads"].items():
        # e5m2 (2-bit mantissa) output gradients: an encoder weight's gradient within 15 %
        limit = 0.15 if name.startswith("layers.") else 0.05
        assert relative(ours["grads"][name], grad) < limit, name


def test_the_trainer_steps_with_float8_beside_o2(torchao: ModuleType) -> None:
    data = batches(2)
    curves = []
    for use_fp8 in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(BertForPreTraining(TINY), CPU, "bf16", 2e-2, 0.1, 2, 1, o2=True,
                          fp8=use_fp8, fp8_emulate=True)
        curves.append([float(trainer.step([batch]).loss) for batch in data])
    assert set(trainer.fp8_layers) == ENCODER
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert all(math.isfinite(x) for x in curves[1])
    assert curves[1] == pytest.approx(curves[0], abs=0.05)


def test_float8_needs_bf16_and_a_device_with_float8_matmuls(torchao: ModuleType) -> None:
    with pytest.raises(fp8.Fp8Error, match=r"^--fp8 needs a GPU with float8 matmuls .*"
                       r"H100, H200.*this run is on the cpu$"):
        fp8.check_support(CPU, "bf16")
    with pytest.raises(fp8.Fp8Error, match=r"this run is fp32 \(pass --bf16\)"):
        fp8.check_support(CPU, "fp32", emulate=True)
    fp8.check_support(CPU, "bf16", emulate=True)


def test_float8_without_torchao_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_torchao(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torchao" or name.startswith("torchao."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for name in [n for n in sys.modules if n.split(".")[0] == "torchao"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(fp8.Fp8Error, match=r"^--fp8 needs torchao \(pip install torchao; "):
        fp8.check_support(CPU, "bf16", emulate=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's refusal")
def test_the_trainer_refuses_fp8_on_the_cpu_in_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "phase1"
    write_shards(data, shards=1, per_shard=8, seq_len=SEQ, max_pred=PRED,
                 vocab_size=TINY.vocab_size)
    config = tmp_path / "bert_config.json"
    config.write_text(TINY.to_json())
    with handlers_kept():
        code = pretrain_main([f"--input_dir={data}", f"--output_dir={tmp_path / 'ckpt'}",
                              f"--config_file={config}", f"--max_seq_length={SEQ}",
                              f"--max_predictions_per_seq={PRED}", "--bf16", "--fp8",
                              "--max_steps=1", "--train_batch_size=4"])
    err = capfd.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: --fp8 needs "), err
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


float8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY,
    reason="needs a GPU with float8 matmuls (compute capability 8.9+)")


@float8_gpu
def test_float8_trains_on_the_gpu_compiled_like_bf16(torchao: ModuleType) -> None:
    device = torch.device("cuda")
    data = batches(60, size=32, seed=7)
    curves = []
    for use_fp8 in (False, True):  # bf16 eager, float8 compiled (as the trainer runs it)
        torch.manual_seed(0)
        trainer = Trainer(BertForPreTraining(TINY), device, "bf16", 2e-2, 0.1, 60, 1,
                          compile_model=use_fp8, o2=True, fp8=use_fp8)
        curves.append([float(trainer.step([b.to(device)]).loss) for b in data])
    assert set(trainer.fp8_layers) == ENCODER
    assert all(math.isfinite(x) for x in curves[1])
    gaps = [abs(a - b) for a, b in zip(curves[0], curves[1], strict=True)]
    assert max(gaps) < 0.3 and sum(gaps) / len(gaps) < 0.1, (curves[0][-5:], curves[1][-5:])
    assert sum(curves[1][-10:]) < sum(curves[1][:10])
