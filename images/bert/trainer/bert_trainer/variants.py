"""The spellings of Hugging Face and NVIDIA names that downloaded checkpoints carry, brought
to the names ``layouts`` knows before anything is compared.

- ``LayerNorm.gamma`` / ``LayerNorm.beta``: the names of checkpoints converted from Google's
  TensorFlow BERT (the hub's ``bert-base-uncased`` ``pytorch_model.bin`` keeps them);
  ``transformers`` and DeepLearningExamples read them as ``weight`` / ``bias``.
- A ``BertModel``'s keys have no ``bert.`` prefix (``embeddings.…``, ``encoder.layer.N.…``,
  ``pooler.dense.…``): the prefix is added, so it is never mistaken for the trainer's layout.
- Buffers ``transformers`` 4.x (before 4.31) saved with the weights
  (``bert.embeddings.position_ids``, ``token_type_ids``): not weights, dropped.
- The tied copies ``torch.save`` writes under their own names (``cls.predictions.decoder``'s
  weight, and its bias in ``transformers`` 4.x): dropped once they are found equal to the
  word embeddings and ``cls.predictions.bias``; a decoder that differs is an error, since
  this trainer ties it, as BERT does.
"""

from __future__ import annotations

import torch

from bert_trainer.layouts import LayoutError

BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias"}
_BERT_MODEL_PARTS = ("embeddings.", "encoder.", "pooler.")


def normalize(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``tensors`` under the names ``layouts`` uses, and one note per change made."""
    keys = set(tensors)
    if any(key.startswith("layers.") for key in keys):  # the trainer's own names
        return dict(tensors), []
    notes: list[str] = []
    out: dict[str, torch.Tensor] = {}
    bare = any(key.startswith("encoder.layer.") for key in keys)
    renamed = 0
    for key, tensor in tensors.items():
        name = f"bert.{key}" if bare and key.startswith(_BERT_MODEL_PARTS) else key
        for old, new in ((".LayerNorm.gamma", ".LayerNorm.weight"),
                         (".LayerNorm.beta", ".LayerNorm.bias")):
            if name.endswith(old):
                name = name[:-len(old)] + new
                renamed += 1
        if name in out:
            raise LayoutError(f"both {key} and another key name {name}")
        out[name] = tensor
    if bare:
        notes.append("a BertModel's names (no bert. prefix)")
    if renamed:
        notes.append(f"{renamed} LayerNorm gamma/beta names read as weight/bias")
    for name in BUFFERS:
        if name in out and not out[name].is_floating_point():
            del out[name]
    for copy, original in TIED.items():
        if copy not in out or original not in out:
            continue
        kept, tied = out[original], out.pop(copy)
        if tied.shape != kept.shape or not torch.equal(tied, kept):
            raise LayoutError(f"{copy} differs from {original}: this trainer ties the "
                              "masked-LM decoder to the word embeddings, as BERT does")
    return out, notes
