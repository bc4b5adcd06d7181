"""Export a checkpoint for the code people fine-tune with, or convert one between layouts.

    python -m bert_trainer.export CHECKPOINT --to hf -o DIR [--vocab_file vocab.txt]
    python -m bert_trainer.export CHECKPOINT --to nvidia -o DIR

``--to hf``: a Hugging Face folder (``config.json`` for ``BertForPreTraining``,
``model.safetensors`` under their names, the vocabulary and tokenizer files), which
``transformers``' ``BertForPreTraining``, ``BertForMaskedLM`` and
``BertForQuestionAnswering.from_pretrained(DIR)`` load.  ``--to nvidia``: NVIDIA
DeepLearningExamples' layout, ``DIR/bert_nvidia.pt`` holding ``{"model": state_dict}``
under their ``modeling.py`` names, which their ``run_squad.py`` takes as
``--init_checkpoint``.  Both write ``imgpipe_export.json`` (the run the weights come from:
image, phase, step, loss, the pre-training dropout) and a ``README.md`` model card; the
config carries fine-tuning dropout (0.1).

CHECKPOINT is a ``ckpt_<step>.pt`` or a checkpoint folder (its phase2/, else phase1/,
latest), or anything ``--init_checkpoint`` takes (a Hugging Face folder or file, an NVIDIA
checkpoint), converted directly with the config beside it (or ``--config_file``).  Nothing
is left half-written: the folder appears whole or not at all, its permissions as the umask
makes them (a private model stays private).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import stat
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from bert_trainer import checkpoint, sources
from bert_trainer.config import BertConfig, ConfigError
from bert_trainer.layouts import LAYOUTS, Layout, LayoutError, export_state
from bert_trainer.lineage import earlier
from bert_trainer.modelcard import NVIDIA_FILE, model_card
from bert_trainer.weights import Initial, from_source

METADATA = "imgpipe_export.json"
FINE_TUNING_DROPOUT = 0.1  # what the hub's BERT configs carry, and fine-tuning inherits
# what tokenizer_config.json names, and BertWordPieceTokenizer needs in the vocabulary
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def fine_tuning_config(config: BertConfig) -> BertConfig:
    return replace(config, hidden_dropout_prob=FINE_TUNING_DROPOUT,
                   attention_probs_dropout_prob=FINE_TUNING_DROPOUT)


def hf_config(config: BertConfig) -> dict:
    values = asdict(fine_tuning_config(config))
    values["hidden_act"] = "gelu" if config.hidden_act == "gelu" else "gelu_pytorch_tanh"
    return {"architectures": ["BertForPreTraining"], "model_type": "bert",
            "pad_token_id": 0, "tie_word_embeddings": True, **values}


def _tokenizer_files(vocab: Path, folder: Path, config: BertConfig, lowercase: bool) -> None:
    from tokenizers import BertWordPieceTokenizer

    shutil.copyfile(vocab, folder / "vocab.txt")
    # the dataset tools' tokenizer: lower-cased WordPiece
    BertWordPieceTokenizer(str(vocab), lowercase=lowercase).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": lowercase,
        # truncation=True stops where the model's positions do
        "model_max_length": config.max_position_embeddings, "unk_token": "[UNK]",
        "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
        "mask_token": "[MASK]"}, indent=2) + "\n")


def _config(source: sources.Source, config_file: Path | None) -> tuple[BertConfig, str]:
    """The model's config and how messages name it: --config_file, else the checkpoint's
    own, else the one beside it."""
    if config_file is not None:
        return BertConfig.load(config_file), f"--config_file {config_file}"
    if source.is_trainer_checkpoint:
        return (BertConfig.from_dict(source.payload["config"], str(source.files[0])),
                "the checkpoint's config")
    if source.configs:
        path, values = source.configs[0]
        return BertConfig.from_dict(values, str(path)), str(path)
    raise ConfigError(f"{source.path}: no config.json or bert_config.json beside "
                      f"{source.files[0]}: pass --config_file")


def _lowercase(source: sources.Source) -> bool:
    """Whether the source's tokenizer lower-cases (its tokenizer_config.json; the dataset
    tools' tokenizer does)."""
    path = source.files[0].parent / "tokenizer_config.json"
    try:
        return bool(json.loads(path.read_text()).get("do_lower_case", True))
    except (OSError, ValueError, AttributeError):
        return True


def load_source(path: Path, config_file: Path | None, trust: bool = False
                ) -> tuple[Initial, BertConfig]:
    """The weights to export, checked against their config (CheckpointError otherwise)."""
    if not path.exists():
        raise checkpoint.CheckpointError(f"{path}: no such file or folder")
    source = sources.read(path, str(path), trust, phases=(2, 1))
    config, name = _config(source, config_file)
    initial = from_source(source, config, name, str(path))
    if initial.fresh:
        raise LayoutError(f"{path}: a {initial.kind} has no {' or '.join(initial.fresh)}: "
                          "exports hold BERT with pre-training heads; start a run from it "
                          "(--init_checkpoint) instead")
    return initial, config


def export(source: Path, layout: Layout, dest: Path, config_file: Path | None = None,
           vocab: Path | None = None, trust: bool = False) -> Path:
    """Write ``dest`` (a new folder) from the checkpoint ``source``; the folder."""
    if layout == "trainer":
        raise LayoutError("export to hf or nvidia; a trainer checkpoint is already that")
    initial, config = load_source(source, config_file, trust)
    if layout == "nvidia" and config.hidden_act != "gelu":
        raise LayoutError(f"{source}: DeepLearningExamples' modeling.py has no tanh-"
                          "approximated GeLU (its hidden_act: gelu, bias_gelu, bias_tanh, relu, "
                          "swish): export this model --to hf")
    beside = initial.source.files[0].parent / "vocab.txt"
    vocab = vocab or (beside if beside.is_file() else None)
    if layout == "hf" and vocab is None:
        raise LayoutError("a Hugging Face folder needs its vocabulary: pass --vocab_file")
    if vocab is not None:
        check_vocab(vocab, config)
    state = export_state(initial.state, config, layout)
    if dest.exists():
        raise FileExistsError(f"{dest} exists: choose a new folder (-o)")
    metadata = provenance(initial, layout, config)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = _work_folder(dest)
    try:
        _write(work, layout, state, config, vocab, _lowercase(initial.source))
        (work / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
        payload = initial.source.payload if initial.source.is_trainer_checkpoint else None
        lineage = earlier(payload, None, None, None) if payload is not None else []
        (work / "README.md").write_text(model_card(layout, dest.absolute(), config, metadata,
                                                   lineage, FINE_TUNING_DROPOUT,
                                                   vocab is not None))
        # safetensors writes its file 0600 whatever the umask: every file gets the mode
        # open() gave the metadata file (0666 less the umask), as the folder has its own
        made = stat.S_IMODE((work / METADATA).stat().st_mode)
        for path in work.iterdir():
            os.chmod(path, made)
        os.rename(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def check_vocab(vocab: Path, config: BertConfig) -> None:
    """LayoutError unless ``vocab`` has the model's size and BERT's special tokens."""
    try:
        tokens = vocab.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise LayoutError(f"{vocab}: not a UTF-8 vocabulary ({exc.reason} at byte "
                          f"{exc.start})") from None
    if len(tokens) != config.vocab_size:
        raise LayoutError(f"{vocab} holds {len(tokens)} tokens, the model's vocabulary "
                          f"{config.vocab_size}")
    missing = [token for token in SPECIAL_TOKENS if token not in set(tokens)]
    if missing:
        raise LayoutError(f"{vocab} lacks BERT's {', '.join(missing)} token"
                          f"{'s' if len(missing) > 1 else ''}: pass the vocabulary the data "
                          "was made with (--vocab_file)")


def _work_folder(dest: Path) -> Path:
    """A new hidden folder beside ``dest`` with the permissions the umask gives a folder
    (mkdtemp's is always 0700; issue 62: forcing 0755/0644 instead made a private model
    world-readable)."""
    work = dest.parent / f".{dest.name}.{os.getpid()}.{secrets.token_hex(6)}"
    work.mkdir()
    return work


def _write(work: Path, layout: Layout, state: dict[str, torch.Tensor], config: BertConfig,
           vocab: Path | None, lowercase: bool) -> None:
    if layout == "hf":
        from safetensors.torch import save_file

        save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    else:
        torch.save({"model": state}, work / NVIDIA_FILE)
        (work / "bert_config.json").write_text(fine_tuning_config(config).to_json())
    if vocab is not None:
        _tokenizer_files(vocab, work, config, lowercase)


def provenance(initial: Initial, layout: str, config: BertConfig) -> dict[str, Any]:
    """What the weights are: the checkpoint, what its run recorded, the pre-training dropout
    (the exported config carries fine-tuning's)."""
    payload = initial.source.payload
    return {"layout": layout, "checkpoint": str(initial.source.files[0]),
            "source_layout": initial.layout, "phase": payload.get("phase"),
            "step": payload.get("step"), "loss": payload.get("loss"),
            "image": payload.get("image"), "image_digest": payload.get("image_digest"),
            "pretraining_dropout": {
                "hidden_dropout_prob": config.hidden_dropout_prob,
                "attention_probs_dropout_prob": config.attention_probs_dropout_prob}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_trainer.export",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--to", dest="layout", choices=[x for x in LAYOUTS if x != "trainer"],
                        required=True)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--config_file", type=Path, default=None,
                        help="the model's config (default: the one the checkpoint records, "
                        "or the config.json / bert_config.json beside it)")
    parser.add_argument("--vocab_file", type=Path, default=None,
                        help="the vocabulary the data was made with (needed for --to hf "
                        "unless a vocab.txt is beside the checkpoint)")
    parser.add_argument("--trust_checkpoint", action="store_true",
                        help="let CHECKPOINT hold pickled Python objects (NVIDIA's of "
                        "2020-2022 hold a data loader): only for files you trust")
    args = parser.parse_args(argv)
    try:
        done = export(args.checkpoint, args.layout, args.output, args.config_file,
                      args.vocab_file, args.trust_checkpoint)
    except (checkpoint.CheckpointError, ConfigError, LayoutError, FileExistsError,
            OSError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
