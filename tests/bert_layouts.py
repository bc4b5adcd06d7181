"""BERT checkpoints as people download them, built here with ``transformers`` from a config
(nothing comes from the hub): the hub's ``bert-base-uncased`` layout as ``transformers`` 4.x
wrote ``pytorch_model.bin`` (old ``LayerNorm.gamma``/``beta`` names, the ``position_ids``
buffer, the tied decoder weight and bias saved under their own names), sharded or not;
NVIDIA DeepLearningExamples' ``ckpt_<step>.pt`` with and without the pickled data loader
their ``run_pretraining.py`` saved in 2020-2022.

The facts about each format are in the docstrings; the tests compare the trainer with the
``transformers`` model the files were made from.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader, Dataset, RandomSampler

VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS = 99, 32, 2, 4, 64, 64


def hf_config(**changes: object) -> transformers.BertConfig:
    """A tiny BERT (the vocabulary not a multiple of 8, so padding shows), dropout off."""
    values: dict[str, object] = {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": POSITIONS, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}
    values.update(changes)
    return transformers.BertConfig(**values)


def trainer_config_json(path: Path, **changes: object) -> Path:
    """The same model as a ``bert_config.json`` for ``--config_file``."""
    values = {k: v for k, v in hf_config(**changes).to_dict().items()
              if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size", "max_position_embeddings", "hidden_dropout_prob",
                       "attention_probs_dropout_prob", "hidden_act", "type_vocab_size")}
    path.write_text(json.dumps(values))
    return path


def made(kind: str = "BertForPreTraining", seed: int = 0, **changes: object
         ) -> transformers.PreTrainedModel:
    """A ``transformers`` model of ``kind`` whose weights are all away from their init (so a
    head left out or a bias dropped shows in the logits)."""
    torch.manual_seed(seed)
    model = getattr(transformers, kind)(hf_config(**changes)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def hub_config(model: transformers.PreTrainedModel) -> dict:
    """``config.json`` as the hub's bert-base-uncased has it (transformers 4.6 wrote it)."""
    values = model.config.to_dict()
    values.update({"architectures": ["BertForMaskedLM"], "gradient_checkpointing": False,
                   "position_embedding_type": "absolute", "transformers_version": "4.6.0.dev0",
                   "use_cache": True, "model_type": "bert", "pad_token_id": 0})
    return values


def hub_style_state(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s state dict as ``torch.save`` wrote it in transformers 4.x for the hub's
    bert-base-uncased: ``LayerNorm.gamma``/``beta`` (the TensorFlow names it was converted
    with), the ``bert.embeddings.position_ids`` buffer (persistent before 4.31), and the
    decoder's weight and bias stored beside the tensors they are tied to."""
    out = {}
    for key, value in model.state_dict().items():
        key = key.replace("LayerNorm.weight", "LayerNorm.gamma")
        out[key.replace("LayerNorm.bias", "LayerNorm.beta")] = value.clone()
    out["bert.embeddings.position_ids"] = torch.arange(POSITIONS).expand((1, -1))
    return out


def hub_style_folder(model: transformers.PreTrainedModel, folder: Path, shards: int = 1
                     ) -> Path:
    """A folder as the hub serves bert-base-uncased: ``config.json`` and
    ``pytorch_model.bin`` (or, with ``shards`` > 1, ``pytorch_model-0000i-of-0000n.bin``
    and ``pytorch_model.bin.index.json``, as ``save_pretrained`` sharded them)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hub_config(model), indent=2))
    state = hub_style_state(model)
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i::shards]}
        torch.save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
         "weight_map": weight_map}))
    return folder


def dle_state(model: transformers.BertForPreTraining) -> dict[str, torch.Tensor]:
    """``model``'s weights under DeepLearningExamples' ``modeling.py`` names: ``dense_act``
    for the linear layers followed by an activation (intermediate, pooler, the MLM
    transform), the vocabulary padded to a multiple of 8 (their run_pretraining.py pads
    the config before building the model, so the extra rows hold trained-looking values),
    the decoder weight stored (tied to the word embeddings)."""
    padded = (VOCAB + 7) // 8 * 8
    out = {}
    generator = torch.Generator().manual_seed(9)
    for key, value in model.state_dict().items():
        if key == "cls.predictions.decoder.bias":  # not a parameter of theirs
            continue
        for ours, theirs in (("intermediate.dense.", "intermediate.dense_act."),
                             ("pooler.dense.", "pooler.dense_act."),
                             ("transform.dense.", "transform.dense_act.")):
            key = key.replace(ours, theirs)
        value = value.clone()
        if key in ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias"):
            extra = torch.randn((padded - VOCAB, *value.shape[1:]), generator=generator)
            value = torch.cat([value, extra * 0.05])
        out[key] = value
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    return out


def dle_checkpoint(model: transformers.BertForPreTraining, path: Path,
                   data_loader: bool) -> Path:
    """``ckpt_<step>.pt`` as DLE's run_pretraining.py saves it: ``model``, ``optimizer``,
    ``master params``, ``files``, ``epoch`` and (2020-2022, when not at the last step)
    ``data_loader``: their ``DataLoader`` over ``pretraining_dataset`` with a
    ``WorkerInitObj``, classes of their script, which cannot be imported anywhere else.
    ``bert_config.json`` beside it, with the vocabulary unpadded, as theirs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = dle_state(model)
    payload: dict[str, object] = {
        "model": state,
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(2), "step": 10}},
                      "param_groups": [{"lr": 4e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "master params": [v.float() for v in list(state.values())[:2]],
        "files": [3, "/workspace/data/phase1/shard_3.hdf5"], "epoch": 0}
    try:
        if data_loader:
            payload["data_loader"] = _their_data_loader()
        torch.save(payload, path)
    finally:  # their script's module exists only while it saves, as in their job
        sys.modules.pop("run_pretraining", None)
    config = {k: v for k, v in model.config.to_dict().items()
              if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size", "hidden_act", "hidden_dropout_prob",
                       "attention_probs_dropout_prob", "max_position_embeddings",
                       "type_vocab_size", "initializer_range")}
    (path.parent / "bert_config.json").write_text(json.dumps(config, indent=2))
    return path


def _their_data_loader() -> DataLoader:
    module = types.ModuleType("run_pretraining")
    sys.modules["run_pretraining"] = module

    class pretraining_dataset(Dataset):  # noqa: N801 - their class's name
        def __init__(self, input_file: str) -> None:
            self.input_file = input_file
            self.inputs = [torch.zeros(4, dtype=torch.long)]

        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.inputs[0][index]

    class WorkerInitObj:
        def __init__(self, seed: int) -> None:
            self.seed = seed

        def __call__(self, worker: int) -> None:
            pass

    for cls in (pretraining_dataset, WorkerInitObj):
        cls.__module__ = "run_pretraining"
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    data = pretraining_dataset("/workspace/data/phase1/shard_3.hdf5")
    return DataLoader(data, sampler=RandomSampler(data), batch_size=2, num_workers=0,
                      worker_init_fn=WorkerInitObj(42), pin_memory=False)
