"""Float8 matmuls for the encoder (``--fp8``): torchao's float8 training on its linear layers.

``torchao.float8.convert_to_float8_training`` swaps an ``nn.Linear`` for its
``Float8Linear``: each matmul casts its input and weight to float8 e4m3 (the gradient of
its output to e5m2) with one dynamic scale per tensor and runs ``torch._scaled_mm``, which
H100/H200 (compute capability 8.9 and later) execute at twice the bf16 rate; the weights,
the gradients LAMB sees and everything between the matmuls stay bf16 (or fp32 masters).
Only the encoder's four matmuls per layer are swapped (``layers.N.qkv``,
``attention_out``, ``intermediate``, ``output``): they are ~95 % of BERT-Large's FLOPs,
while the word embeddings, the MLM head (its decoder is the word embedding matrix), the
pooler and the NSP head keep bf16, where float8's 3-bit mantissa costs accuracy for little
time.  The swapped layers keep their parameter names, so checkpoints move between
``--fp8`` and bf16 runs.

torchao is optional: nothing imports it until ``--fp8`` asks, and then a missing
torchao, a device without float8 matmuls or a precision other than bf16 is one
``Fp8Error`` line.  ``emulate=True`` (torchao's emulation: the same casts, the matmul in
high precision) runs anywhere, for tests.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch
from torch import nn

from bert_trainer.config import ConfigError
from bert_trainer.model import BertForPreTraining

# What torch._scaled_mm needs: Ada (8.9) or Hopper (9.0) and later.
MIN_CAPABILITY = (8, 9)
ENCODER = "layers."  # the encoder's modules; the embeddings and the heads sit outside it


class Fp8Error(ConfigError):
    """``--fp8`` that this run cannot do: no torchao, no float8 matmuls, not bf16."""


def torchao_float8() -> ModuleType:
    """``torchao.float8``, or Fp8Error naming the package when torchao is not installed."""
    # torchao's import logs a warning for each of its CUDA extensions a CPU (or older)
    # torch cannot load; float8 training uses none of them (its matmul is torch's own).
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as exc:
        raise Fp8Error(f"--fp8 needs torchao (pip install torchao; {exc})") from None
    finally:
        quiet.setLevel(level)


def check_support(device: torch.device, precision: str, emulate: bool = False) -> None:
    """Fp8Error unless ``device`` has float8 matmuls (or ``emulate``), the run is bf16 and
    torchao imports."""
    if precision != "bf16":
        raise Fp8Error(f"--fp8 runs beside bf16, and this run is {precision} (pass --bf16)")
    if not emulate:
        if device.type != "cuda":
            raise Fp8Error(f"--fp8 needs a GPU with float8 matmuls (compute capability 8.9 "
                           f"or later: H100, H200, L40S), and this run is on the {device.type}")
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise Fp8Error(f"--fp8 needs compute capability 8.9 or later (H100, H200, L40S); "
                           f"{torch.cuda.get_device_name(device)} has "
                           f"{capability[0]}.{capability[1]}")
    torchao_float8()


def is_encoder_linear(module: nn.Module, name: str) -> bool:
    """The filter handed to torchao: the encoder's linear layers, nothing else."""
    return isinstance(module, nn.Linear) and name.startswith(ENCODER)


def convert_encoder(model: BertForPreTraining, emulate: bool = False) -> list[str]:
    """Swap the encoder's ``nn.Linear`` layers of ``model`` for torchao's float8 ones, in
    place; returns their names.  Raises Fp8Error when torchao is missing."""
    float8 = torchao_float8()
    # torch._scaled_mm wants the inner dimension of each matmul a multiple of 16; in the
    # weight gradient (grad_output^T @ input) that is the token count, which the unpadded
    # encoder does not round: torchao pads it with zeros when it is not (the padded
    # path's batch x seq needs no copy).
    config = float8.Float8LinearConfig(emulate=emulate, pad_inner_dim=model.unpadded)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=is_encoder_linear)
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and type(module) is not nn.Linear]
