"""Is a checkpoint the network the run's config describes?  Asked both ways before a step
runs: of its weights (layers, hidden, intermediate, vocabulary, positions, token types: what
shapes tell) and of the config beside it (those and heads, activation, LayerNorm epsilon:
what only a config tells).  The first difference is one line naming both values."""

from __future__ import annotations

import re

import torch

from bert_trainer.config import ARCHITECTURE, BertConfig
from bert_trainer.layouts import Layout, LayoutError

_LAYER = re.compile(r"^(?:bert\.encoder\.layer|layers)\.(\d+)\.")
_INTERMEDIATE = {"trainer": "layers.0.intermediate.weight",
                 "hf": "bert.encoder.layer.0.intermediate.dense.weight",
                 "nvidia": "bert.encoder.layer.0.intermediate.dense_act.weight"}


class ArchitectureError(LayoutError):
    """A checkpoint of another network than the run's config (one field, both values)."""


def from_weights(tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, int]:
    """What the shapes of ``tensors`` say: ``vocab_rows`` (the word embeddings' rows, padded
    or not), hidden, intermediate, positions, token types and the number of layers."""
    prefix = "" if layout == "trainer" else "bert."
    found: dict[str, int] = {}
    for name, field in (("word_embeddings", "vocab_rows"),
                        ("position_embeddings", "max_position_embeddings"),
                        ("token_type_embeddings", "type_vocab_size")):
        tensor = tensors.get(f"{prefix}embeddings.{name}.weight")
        if tensor is not None and tensor.dim() == 2:
            found[field] = tensor.shape[0]
            found["hidden_size"] = tensor.shape[1]
    layers = sorted({int(m.group(1)) for key in tensors if (m := _LAYER.match(key))})
    if layers:
        if layers != list(range(len(layers))):
            gap = next(i for i in range(len(layers) + 1) if i not in layers)
            raise ArchitectureError(f"the weights have layers up to {layers[-1]} but no "
                                    f"layer {gap}")
        found["num_hidden_layers"] = len(layers)
    inner = tensors.get(_INTERMEDIATE[layout])
    if inner is not None and inner.dim() == 2:
        found["intermediate_size"] = inner.shape[0]
    return found


def check_weights(found: dict[str, int], config: BertConfig, run: str, padded: bool) -> None:
    """ArchitectureError at the first field where the weights' ``found`` and ``config`` (the
    run's, named ``run``) differ.  ``padded``: the layout may pad the vocabulary (to a
    multiple of 8), so either row count fits."""
    for field in ARCHITECTURE:
        if field in found and found[field] != getattr(config, field):
            raise ArchitectureError(f"{field}: the checkpoint's weights have {found[field]}, "
                                    f"{run} says {getattr(config, field)}")
    rows = found.get("vocab_rows")
    fits = {config.vocab_size, config.padded_vocab_size} if padded else {config.vocab_size}
    if rows is not None and rows not in fits:
        raise ArchitectureError(f"vocab_size: the checkpoint's word embeddings have {rows} "
                                f"rows, {run} says {config.vocab_size}")


def check_config(other: BertConfig, where: str, config: BertConfig, run: str) -> None:
    """ArchitectureError at the first architecture field where ``other`` (a checkpoint's
    config, read from ``where``) and the run's ``config`` (named ``run``) differ."""
    mine, theirs = config.architecture(), other.architecture()
    for field in ARCHITECTURE:
        if mine[field] != theirs[field]:
            raise ArchitectureError(f"{field}: {where} says {theirs[field]}, {run} says "
                                    f"{mine[field]}")
