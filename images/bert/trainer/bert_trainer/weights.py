"""``--init_checkpoint`` (and ``export``'s source) from anyone's BERT: this trainer's
checkpoints, a Hugging Face folder or file (``BertForPreTraining``, ``BertForMaskedLM``,
``BertModel``; safetensors or ``pytorch_model.bin``, sharded or not, old ``gamma``/``beta``
names too), NVIDIA DeepLearningExamples' checkpoints old and new.

The checkpoint is checked against the run's config both ways before anything trains: its
weights' shapes, and the config beside it (``config.json``, ``bert_config.json``, or what a
trainer checkpoint records).  Names are mapped back and the vocabulary padded
(``layouts``); heads the checkpoint lacks are left to the model's fresh initialisation (the
decoder is always the word embeddings) and named in one line, as ``transformers`` does.
Anything else is one line naming what does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from bert_trainer import sources
from bert_trainer.architecture import ArchitectureError, check_config, check_weights, from_weights
from bert_trainer.checkpoint import CheckpointError
from bert_trainer.config import BertConfig, ConfigError
from bert_trainer.layouts import (
    ALL_HEADS,
    HEADS,
    Layout,
    LayoutError,
    detect,
    head_keys,
    heads_present,
    import_state,
)
from bert_trainer.variants import normalize

_KINDS = {ALL_HEADS: "BertForPreTraining", ("masked-LM head",): "BertForMaskedLM",
          ("pooler",): "BertModel", (): "BertModel without its pooler",
          ("pooler", "next-sentence head"): "BertForNextSentencePrediction"}


@dataclass
class Initial:
    """A checkpoint's weights under the trainer's names, and what was found on the way."""

    state: dict[str, torch.Tensor]  # the heads in ``fresh`` are absent
    layout: Layout
    heads: tuple[str, ...]
    source: sources.Source
    config: BertConfig  # the run's, which the checkpoint was checked against
    notes: list[str] = field(default_factory=list)  # names read another way
    unchecked: str | None = None  # what could not be checked, when no config is beside

    @property
    def fresh(self) -> tuple[str, ...]:
        return tuple(head for head in ALL_HEADS if head not in self.heads)

    @property
    def kind(self) -> str:
        return _KINDS.get(self.heads, "BERT with " + ", ".join(self.heads))

    def describe(self) -> str:
        """``PATH (layout)``, as the start line and the checkpoints record it."""
        return f"{self.source.path} ({self.layout})"

    def fresh_line(self) -> str | None:
        """One line naming the heads initialised fresh, or None when all were there."""
        if not self.fresh:
            return None
        names: list[str] = []
        for head in self.fresh:
            for key in head_keys(self.config, self.layout, head):
                shown = key.rsplit(".", 1)[0] + ".*" if key.endswith((".weight", ".bias")) \
                    and not key.endswith("predictions.bias") else key
                if shown not in names:
                    names.append(shown)
        tied = (", the decoder tied to the word embeddings" if "masked-LM head" in self.fresh
                else "")
        return (f"{self.source.path}, a {self.kind} ({self.layout}), has no "
                f"{' or '.join(self.fresh)} ({', '.join(names)}): initialised fresh{tied}")


def from_source(source: sources.Source, config: BertConfig, run: str, what: str) -> Initial:
    """``source`` checked against ``config`` (called ``run`` in messages) and mapped to the
    trainer's names; CheckpointError (one line, starting with ``what``) where it does not
    fit."""
    try:
        return _checked(source, config, run)
    except ArchitectureError as exc:
        beside = source.configs[0][0] if source.configs else None
        hint = f" (to train that model, pass --config_file {beside})" if beside else ""
        raise CheckpointError(f"{what}: {exc}{hint}") from None
    except (LayoutError, ConfigError) as exc:
        raise CheckpointError(f"{what}: {exc}") from None


def _checked(source: sources.Source, config: BertConfig, run: str) -> Initial:
    notes: list[str] = []
    if source.is_trainer_checkpoint:
        own = BertConfig.from_dict(source.payload["config"], str(source.files[0]))
        check_config(own, "the checkpoint's config", config, run)
        tensors, layout = source.tensors, detect(set(source.tensors))
    else:
        tensors, notes = normalize(source.tensors)
        layout = detect(set(tensors))
    check_weights(from_weights(tensors, layout), config, run, padded=layout != "hf")
    for path, values in source.configs:
        check_config(BertConfig.from_dict(values, str(path)), str(path), config, run)
    unchecked = None
    if not source.configs and not source.is_trainer_checkpoint:
        unchecked = (f"no config.json or bert_config.json beside {source.files[0]}: the "
                     f"heads, activation and LayerNorm epsilon of {run} are taken unchecked")
    heads = heads_present(tensors, config, layout)
    state = import_state(tensors, config, layout, heads)
    return Initial(state, layout, heads, source, config, notes, unchecked)


def load_initial(path: Path, config: BertConfig, run: str = "the run's config",
                 what: str | None = None, trust: bool = False, phases: tuple[int, ...] = (1,)
                 ) -> Initial:
    """The checkpoint at ``path``, read (``sources.read``) and checked (``from_source``)."""
    what = what or f"--init_checkpoint {path}"
    if not path.exists():
        raise CheckpointError(f"{what}: no such file or folder")
    return from_source(sources.read(path, what, trust, phases), config, run, what)


def load_into(model: nn.Module, initial: Initial) -> None:
    """Copy ``initial``'s weights into ``model``; the heads it lacks keep the model's own
    (fresh) initialisation."""
    missing, unexpected = model.load_state_dict(initial.state, strict=False)
    fresh = {key for head in initial.fresh for key in HEADS[head]}
    if unexpected or set(missing) != fresh:  # import_state guarantees it: a bug otherwise
        raise RuntimeError(f"weights do not fit the model: missing {missing}, unexpected "
                           f"{unexpected}")


def initial_weights(path: Path, config: BertConfig) -> tuple[dict[str, torch.Tensor], str]:
    """The complete trainer state dict from ``path`` (every head there) and its layout."""
    initial = load_initial(path, config)
    if initial.fresh:
        raise CheckpointError(f"--init_checkpoint {path}: no {' or '.join(initial.fresh)}")
    return initial.state, initial.layout
