"""The trainer's weights under the ecosystem's names, and back.

Three layouts of one BERT with pre-training heads:

- ``trainer``: this package's ``BertForPreTraining`` (fused ``qkv``, ``layers.N.*``, the
  vocabulary padded to a multiple of 8, the MLM decoder tied to the word embeddings);
- ``hf``: Hugging Face ``transformers.BertForPreTraining`` (``bert.encoder.layer.N.*``,
  query/key/value apart, the vocabulary as the tokenizer has it; the decoder tied to the
  embeddings, so its weight is not stored, as ``save_pretrained`` leaves it out);
- ``nvidia``: NVIDIA DeepLearningExamples' PyTorch BERT (``modeling.py``): Hugging Face's
  names but ``dense_act`` for the linear layers followed by an activation, the vocabulary
  padded (their pre-training pads it to a multiple of 8) and the decoder weight stored.

Each rule is written once, in ``_pairs``: one row per tensor, its name in each layout.
The heads are optional on the way in (``HEADS``): a ``BertForMaskedLM`` has no pooler and
no next-sentence head, a ``BertModel`` neither head; keys that no rule names are an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from bert_trainer.config import BertConfig

Layout = Literal["trainer", "hf", "nvidia"]
LAYOUTS: tuple[Layout, ...] = ("trainer", "hf", "nvidia")


class LayoutError(ValueError):
    """Weights that are not the model the config describes (a key, a shape)."""


def _pairs(config: BertConfig) -> Iterator[tuple[str, str, str]]:
    """(trainer name, Hugging Face name, NVIDIA name) of every stored tensor except the
    fused attention projection (``_QKV``) and the decoder (tied)."""
    both = ("weight", "bias")
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        yield (f"embeddings.{name}.weight", f"bert.embeddings.{name}.weight",
               f"bert.embeddings.{name}.weight")
    for kind in both:
        yield (f"embeddings.LayerNorm.{kind}", f"bert.embeddings.LayerNorm.{kind}",
               f"bert.embeddings.LayerNorm.{kind}")
    for n in range(config.num_hidden_layers):
        ours, theirs = f"layers.{n}", f"bert.encoder.layer.{n}"
        for kind in both:
            yield (f"{ours}.attention_out.{kind}", f"{theirs}.attention.output.dense.{kind}",
                   f"{theirs}.attention.output.dense.{kind}")
            yield (f"{ours}.attention_norm.{kind}", f"{theirs}.attention.output.LayerNorm.{kind}",
                   f"{theirs}.attention.output.LayerNorm.{kind}")
            yield (f"{ours}.intermediate.{kind}", f"{theirs}.intermediate.dense.{kind}",
                   f"{theirs}.intermediate.dense_act.{kind}")
            yield (f"{ours}.output.{kind}", f"{theirs}.output.dense.{kind}",
                   f"{theirs}.output.dense.{kind}")
            yield (f"{ours}.output_norm.{kind}", f"{theirs}.output.LayerNorm.{kind}",
                   f"{theirs}.output.LayerNorm.{kind}")
    for kind in both:
        yield (f"mlm_transform.{kind}", f"cls.predictions.transform.dense.{kind}",
               f"cls.predictions.transform.dense_act.{kind}")
        yield (f"mlm_norm.{kind}", f"cls.predictions.transform.LayerNorm.{kind}",
               f"cls.predictions.transform.LayerNorm.{kind}")
        yield (f"pooler.{kind}", f"bert.pooler.dense.{kind}", f"bert.pooler.dense_act.{kind}")
        yield (f"nsp.{kind}", f"cls.seq_relationship.{kind}", f"cls.seq_relationship.{kind}")
    yield ("mlm_bias", "cls.predictions.bias", "cls.predictions.bias")


def _qkv(config: BertConfig) -> Iterator[tuple[str, list[str]]]:
    """(fused trainer name, its three parts' names: the same in hf and nvidia) of every
    attention projection."""
    for n in range(config.num_hidden_layers):
        for kind in ("weight", "bias"):
            yield (f"layers.{n}.qkv.{kind}",
                   [f"bert.encoder.layer.{n}.attention.self.{part}.{kind}"
                    for part in ("query", "key", "value")])


VOCAB_ROWS = {"embeddings.word_embeddings.weight", "mlm_bias"}  # padded in the trainer
DECODER = "cls.predictions.decoder.weight"

# The parts a checkpoint may lack, under the trainer's names; the encoder is never optional.
HEADS: dict[str, tuple[str, ...]] = {
    "pooler": ("pooler.weight", "pooler.bias"),
    "masked-LM head": ("mlm_transform.weight", "mlm_transform.bias", "mlm_norm.weight",
                       "mlm_norm.bias", "mlm_bias"),
    "next-sentence head": ("nsp.weight", "nsp.bias")}
ALL_HEADS = tuple(HEADS)


def head_keys(config: BertConfig, layout: Layout, head: str) -> list[str]:
    """The names of ``head``'s tensors in ``layout``."""
    if layout == "trainer":
        return list(HEADS[head])
    names = {row[0]: row[_column(layout)] for row in _pairs(config)}
    return [names[key] for key in HEADS[head]]


def heads_present(state: dict[str, torch.Tensor], config: BertConfig, layout: Layout
                  ) -> tuple[str, ...]:
    """The heads whose tensors ``state`` holds; LayoutError for a head only partly there."""
    present = []
    for head in HEADS:
        keys = head_keys(config, layout, head)
        there = [key for key in keys if key in state]
        if there and len(there) < len(keys):
            missing = next(key for key in keys if key not in state)
            raise LayoutError(f"missing {missing} (the rest of the {head} is there)")
        if there:
            present.append(head)
    return tuple(present)


def _column(layout: Layout) -> int:
    return {"hf": 1, "nvidia": 2}[layout]


def _vocab_rows(config: BertConfig, layout: Layout) -> int:
    return config.vocab_size if layout == "hf" else config.padded_vocab_size


def export_state(state: dict[str, torch.Tensor], config: BertConfig, layout: Layout
                 ) -> dict[str, torch.Tensor]:
    """The trainer's state dict under ``layout``'s names (new, contiguous tensors)."""
    check_keys(state, config, "trainer")
    out: dict[str, torch.Tensor] = {}
    rows = _vocab_rows(config, layout)
    for row in _pairs(config):
        tensor = state[row[0]]
        if row[0] in VOCAB_ROWS:
            tensor = tensor[:rows]
        out[row[_column(layout)]] = tensor.detach().clone().contiguous()
    for fused, parts in _qkv(config):
        for name, piece in zip(parts, state[fused].chunk(3, dim=0), strict=True):
            out[name] = piece.detach().clone().contiguous()
    if layout == "nvidia":  # their state dict lists the tied decoder under its own name
        out[DECODER] = out["bert.embeddings.word_embeddings.weight"]
    return out


def import_state(state: dict[str, torch.Tensor], config: BertConfig, layout: Layout,
                 heads: tuple[str, ...] = ALL_HEADS) -> dict[str, torch.Tensor]:
    """``layout``'s state dict as the trainer's (the vocabulary padded with zero rows);
    the heads not in ``heads`` are absent from both."""
    if layout == "trainer":
        check_keys(state, config, "trainer", heads)
        return dict(state)
    state = {k: v for k, v in state.items() if k != DECODER}
    check_keys(state, config, layout, heads)
    out: dict[str, torch.Tensor] = {}
    for row in _pairs(config):
        if row[_column(layout)] not in state:  # a head this checkpoint does not have
            continue
        tensor = state[row[_column(layout)]]
        if row[0] in VOCAB_ROWS:
            padded = torch.zeros((config.padded_vocab_size, *tensor.shape[1:]),
                                 dtype=tensor.dtype)
            padded[:tensor.shape[0]] = tensor
            tensor = padded
        out[row[0]] = tensor.detach().clone()
    for fused, parts in _qkv(config):
        out[fused] = torch.cat([state[name] for name in parts], dim=0)
    return out


def expected_shapes(config: BertConfig, layout: Layout, heads: tuple[str, ...] = ALL_HEADS
                    ) -> dict[str, tuple[int, ...]]:
    """Every key of ``layout`` and its shape, for ``config`` (with ``heads`` only)."""
    h, f = config.hidden_size, config.intermediate_size
    vocab = config.padded_vocab_size if layout != "hf" else config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}
    sizes = {"embeddings.word_embeddings.weight": (vocab, h),
             "embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
             "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
             "mlm_bias": (vocab,), "nsp.weight": (2, h), "nsp.bias": (2,)}
    for row in _pairs(config):
        ours = row[0]
        if ours in sizes:
            shape = sizes[ours]
        elif ours.endswith(".intermediate.weight"):
            shape = (f, h)
        elif ours.endswith(".intermediate.bias"):
            shape = (f,)
        elif ours.endswith(".output.weight"):
            shape = (h, f)
        elif ours.endswith(".weight") and not ours.endswith(("norm.weight", "LayerNorm.weight")):
            shape = (h, h)
        else:
            shape = (h,)
        shapes[ours if layout == "trainer" else row[_column(layout)]] = shape
    for fused, parts in _qkv(config):
        kind = fused.rsplit(".", 1)[1]
        if layout == "trainer":
            shapes[fused] = (3 * h, h) if kind == "weight" else (3 * h,)
        else:
            for name in parts:
                shapes[name] = (h, h) if kind == "weight" else (h,)
    if layout == "nvidia" and "masked-LM head" in heads:
        shapes[DECODER] = (vocab, h)
    for head in ALL_HEADS:
        if head not in heads:
            for key in head_keys(config, layout, head):
                shapes.pop(key)
    return shapes


def check_keys(state: dict[str, torch.Tensor], config: BertConfig, layout: Layout,
               heads: tuple[str, ...] = ALL_HEADS) -> None:
    """LayoutError naming the first missing key, wrong shape or unused key (one line)."""
    wanted = expected_shapes(config, layout, heads)
    if layout == "nvidia" and DECODER not in state:
        wanted.pop(DECODER, None)
    for name, shape in wanted.items():
        if name not in state:
            raise LayoutError(f"missing {name} (is it a BERT with pre-training heads of "
                              f"{config.num_hidden_layers} layers?)")
        if tuple(state[name].shape) != shape:
            raise LayoutError(f"{name} has shape {tuple(state[name].shape)}, the config "
                              f"wants {shape}")
    unused = sorted(set(state) - set(wanted))
    if unused:
        shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3
                                          else "")
        raise LayoutError(f"unused keys {shown}: no part of a BERT of "
                          f"{config.num_hidden_layers} layers with pre-training heads has "
                          "them (a fine-tuned model's task head?)")


def detect(keys: set[str]) -> Layout:
    """Which layout a state dict's keys are in (``variants.normalize`` first: a
    ``BertModel``'s keys have no ``bert.`` prefix)."""
    if any(key.startswith("layers.") for key in keys):
        return "trainer"
    if any(".dense_act." in key for key in keys):
        return "nvidia"
    if "bert.embeddings.word_embeddings.weight" in keys:
        return "hf"
    shown = ", ".join(sorted(keys)[:3]) or "no tensors"
    raise LayoutError(f"not a BERT checkpoint of a known layout (its keys begin {shown})")
