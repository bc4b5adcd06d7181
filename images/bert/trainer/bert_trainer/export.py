"""Export a trainer checkpoint for the code people fine-tune with.

    python -m bert_trainer.export CHECKPOINT --to hf -o DIR [--vocab_file vocab.txt]
    python -m bert_trainer.export CHECKPOINT --to nvidia -o DIR

``--to hf``: a Hugging Face folder (``config.json`` for ``BertForPreTraining``,
``model.safetensors`` under their names, the vocabulary and tokenizer files), which
``transformers``' ``BertForPreTraining``, ``BertForMaskedLM`` and
``BertForQuestionAnswering.from_pretrained(DIR)`` load.  ``--to nvidia``: NVIDIA
DeepLearningExamples' layout, ``DIR/bert_nvidia.pt`` holding ``{"model": state_dict}``
under their ``modeling.py`` names, which their ``run_squad.py`` takes as
``--init_checkpoint``.  Both write ``imgpipe_export.json``: the run the weights come from
(image, phase, step, loss).  CHECKPOINT is a ``ckpt_<step>.pt`` or a checkpoint folder
(its phase2/, else phase1/, latest).  Nothing is left half-written: the folder appears
whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bert_trainer import checkpoint
from bert_trainer.config import BertConfig, ConfigError
from bert_trainer.layouts import LAYOUTS, Layout, LayoutError, export_state

METADATA = "imgpipe_export.json"
NVIDIA_FILE = "bert_nvidia.pt"


def find_checkpoint(path: Path) -> Path:
    """A checkpoint file, or the latest of a folder's phase2/ (else phase1/, else itself)."""
    if path.is_file():
        return path
    for folder in (checkpoint.phase_dir(path, 2), checkpoint.phase_dir(path, 1), path):
        found = checkpoint.latest(folder)
        if found:
            return found
    raise checkpoint.CheckpointError(f"{path}: no ckpt_<step>.pt there, nor in its phase2/ "
                                     "or phase1/ folder")


def hf_config(config: BertConfig) -> dict:
    values = asdict(config)
    values["hidden_act"] = "gelu" if config.hidden_act == "gelu" else "gelu_pytorch_tanh"
    return {"architectures": ["BertForPreTraining"], "model_type": "bert",
            "pad_token_id": 0, "tie_word_embeddings": True, **values}


def _tokenizer_files(vocab: Path, folder: Path) -> None:
    from tokenizers import BertWordPieceTokenizer

    shutil.copyfile(vocab, folder / "vocab.txt")
    # the dataset tools' tokenizer: lower-cased WordPiece
    BertWordPieceTokenizer(str(vocab), lowercase=True).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True,
        "model_max_length": 512, "unk_token": "[UNK]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}, indent=2) + "\n")


def export(source: Path, layout: Layout, dest: Path, config_file: Path | None = None,
           vocab: Path | None = None) -> Path:
    """Write ``dest`` (a new folder) from the checkpoint ``source``; the folder."""
    if layout == "trainer":
        raise LayoutError("export to hf or nvidia; a trainer checkpoint is already that")
    path = find_checkpoint(source)
    payload = checkpoint.load(path)
    config = (BertConfig.from_dict(payload["config"], str(path)) if "config" in payload
              and config_file is None else BertConfig.load(config_file))
    if layout == "hf" and vocab is None:
        raise LayoutError("a Hugging Face folder needs its vocabulary: pass --vocab_file")
    if vocab is not None and len(vocab.read_text().splitlines()) != config.vocab_size:
        raise LayoutError(f"{vocab} holds {len(vocab.read_text().splitlines())} tokens, the "
                          f"model's vocabulary {config.vocab_size}")
    state = export_state(payload["model"], config, layout)
    if dest.exists():
        raise FileExistsError(f"{dest} exists: choose a new folder (-o)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        if layout == "hf":
            from safetensors.torch import save_file

            save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
            (work / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
        else:
            torch.save({"model": state}, work / NVIDIA_FILE)
            (work / "bert_config.json").write_text(config.to_json())
        if vocab is not None:
            _tokenizer_files(vocab, work)
        (work / METADATA).write_text(json.dumps(provenance(payload, path, layout), indent=2)
                                     + "\n")
        os.chmod(work, 0o755)
        os.rename(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def provenance(payload: dict, path: Path, layout: str) -> dict:
    """What run the weights come from: the checkpoint and what its run recorded."""
    return {"layout": layout, "checkpoint": str(path), "phase": payload.get("phase"),
            "step": payload.get("step"), "loss": payload.get("loss"),
            "image": payload.get("image"), "image_digest": payload.get("image_digest")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_trainer.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--to", dest="layout", choices=[x for x in LAYOUTS if x != "trainer"],
                        required=True)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--config_file", type=Path, default=None,
                        help="the model's config (default: the one the checkpoint records)")
    parser.add_argument("--vocab_file", type=Path, default=None,
                        help="the vocabulary the data was made with (needed for --to hf)")
    args = parser.parse_args(argv)
    try:
        done = export(args.checkpoint, args.layout, args.output, args.config_file,
                      args.vocab_file)
    except (checkpoint.CheckpointError, ConfigError, LayoutError, FileExistsError,
            OSError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
