"""``--init_checkpoint`` from anyone's BERT: this trainer's checkpoints, a Hugging Face
folder or ``.safetensors`` file, NVIDIA DeepLearningExamples' checkpoint.  Their names are
mapped back and the vocabulary padded (``layouts``); anything else is one line naming what
does not fit."""

from __future__ import annotations

from pathlib import Path

import torch

from bert_trainer import checkpoint
from bert_trainer.config import BertConfig
from bert_trainer.layouts import LayoutError, detect, import_state


def _read(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` as stored (any layout)."""
    if path.is_dir():
        for name in ("model.safetensors", "bert_nvidia.pt"):
            if (path / name).is_file():
                return _read(path / name)
        return checkpoint.load(checkpoint.resolve_init(path))["model"]
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise checkpoint.CheckpointError(f"{path}: not a readable safetensors file "
                                             f"({exc})") from None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise checkpoint.CheckpointError(f"{path}: not a readable checkpoint ({exc})") from None
    if isinstance(payload, dict) and isinstance(payload.get("model"), dict):
        return payload["model"]
    if isinstance(payload, dict) and all(isinstance(v, torch.Tensor) for v in payload.values()):
        return payload  # a bare state dict (pytorch_model.bin)
    raise checkpoint.CheckpointError(f"{path}: neither a state dict nor a checkpoint with one")


def initial_weights(path: Path, config: BertConfig) -> tuple[dict[str, torch.Tensor], str]:
    """The trainer's state dict from ``path`` in any known layout, checked against
    ``config``; and the layout it was in."""
    if not path.exists():
        raise checkpoint.CheckpointError(f"--init_checkpoint {path}: no such file or folder")
    stored = _read(path)
    try:
        layout = detect(set(stored))
        return import_state(stored, config, layout), layout
    except LayoutError as exc:
        raise checkpoint.CheckpointError(f"--init_checkpoint {path}: {exc}") from None
