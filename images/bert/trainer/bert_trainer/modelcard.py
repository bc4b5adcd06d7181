"""The ``README.md`` an export carries: what the model is, what it was trained on and how
(each phase's data, sequence length, batch, steps and final loss, from the checkpoint's
``lineage``), the image it was trained in, and how to fine-tune it as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bert_trainer.config import BertConfig

NVIDIA_FILE = "bert_nvidia.pt"


def _cell(value: object) -> str:
    return "–" if value is None or value == "" else str(value).replace("|", "\\|")


def _data(record: dict[str, Any]) -> str:
    text = f"`{record.get('input_dir')}` ({record.get('shards')} shards"
    data = record.get("data") or {}
    for key, word in (("instances", "sequences"), ("tokens", "tokens of text"),
                      ("documents", "documents")):
        if data.get(key) is not None:
            text += f", {data[key]:,} {word}"
    return text + ")"


def _batch(record: dict[str, Any]) -> str:
    """The global batch, or each one with its steps where a resumed run changed it."""
    batches = record.get("batches")
    if not batches:
        return _cell(record.get("global_batch"))
    ends = [b["from_step"] - 1 for b in batches[1:]] + [record.get("step")]
    return ", ".join(f"{_cell(b['global_batch'])} (steps {b['from_step']}-{_cell(end)})"
                     for b, end in zip(batches, ends, strict=True))


def training_table(lineage: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: where the weights started, then one row per phase."""
    lines = ["| phase | data | sequence length | masked per sequence | global batch | steps "
             "| final loss | image |", "|---|---|---|---|---|---|---|---|"]
    for record in lineage:
        if "from" in record:
            lines.append(f"| started from | `{record['from']}` ({_cell(record.get('kind'))}) "
                         "| | | | | | |")
        elif "input_dir" in record:
            lines.append(
                f"| {record.get('phase')} | {_data(record)} | {_cell(record.get('max_seq_length'))}"
                f" | {_cell(record.get('max_predictions_per_seq'))} "
                f"| {_batch(record)} | {_cell(record.get('step'))} "
                f"| {_cell(record.get('loss'))} "
                f"| {_cell(record.get('image_digest') or record.get('image'))} |")
        else:  # a checkpoint from before lineage was recorded: what it said of itself
            lines.append(f"| {_cell(record.get('phase'))} | (not recorded) | | | "
                         f"| {_cell(record.get('step'))} | {_cell(record.get('loss'))} "
                         f"| {_cell(record.get('image_digest') or record.get('image'))} |")
    return lines


def _fine_tuning(layout: str, folder: Path, config: BertConfig, has_vocab: bool
                 ) -> list[str]:
    vocab = folder / "vocab.txt" if has_vocab else "VOCAB.txt"
    if layout == "hf":
        return [
            "Any `transformers` head starts from this folder as it is (the tokenizer stops at "
            f"{config.max_position_embeddings} tokens, the model's positions):", "",
            "```python", "import torch",
            "from transformers import AutoModelForSequenceClassification, AutoTokenizer", "",
            f'folder = "{folder}"',
            "tokenizer = AutoTokenizer.from_pretrained(folder)",
            "model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)",
            'batch = tokenizer(["a first example", "and a second one"], padding=True,',
            '                  truncation=True, return_tensors="pt")',
            "loss = model(**batch, labels=torch.tensor([0, 1])).loss",
            "loss.backward()  # then your optimizer's step, as in any fine-tuning loop",
            "```", "",
            "`BertForQuestionAnswering`, `BertForTokenClassification` and `BertForMaskedLM` "
            "load it the same way; `pipeline(\"fill-mask\", model=folder)` shows what it "
            "predicts."]
    return [
        "NVIDIA DeepLearningExamples' fine-tuning scripts take it as their "
        "`--init_checkpoint` (their `modeling.py` names; the vocabulary padded to a multiple "
        "of 8, as their pre-training pads it):", "",
        "```sh",
        f"python run_squad.py --init_checkpoint={folder / NVIDIA_FILE} \\",
        f"  --config_file={folder / 'bert_config.json'} --vocab_file={vocab} --do_lower_case "
        "\\",
        "  --do_train --train_file=train-v1.1.json --max_seq_length="
        f"{min(384, config.max_position_embeddings)} ...",
        "```", *([] if has_vocab else [
            "", "(VOCAB.txt: the vocabulary the pre-training data was made with; export with "
            "--vocab_file to keep it in this folder.)"])]


def model_card(layout: str, folder: Path, config: BertConfig, metadata: dict[str, Any],
               lineage: list[dict[str, Any]], fine_tuning_dropout: float, has_vocab: bool
               ) -> str:
    """The card's Markdown; ``folder`` is where the export will be."""
    shape = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
             f"{config.num_attention_heads} heads")
    front = (["---", "library_name: transformers", "pipeline_tag: fill-mask",
              "tags: [bert, imgpipe]", "---", ""] if layout == "hf" else [])
    what = ("a Hugging Face folder (`BertForPreTraining`)" if layout == "hf"
            else "NVIDIA DeepLearningExamples' layout (`bert_nvidia.pt`)")
    dropout = metadata.get("pretraining_dropout") or {}
    lines = [*front, f"# BERT, {shape}", "",
             f"Exported by imgpipe's BERT trainer (`python -m bert_trainer.export`) from "
             f"`{metadata.get('checkpoint')}` as {what}.", "", "## Training", ""]
    if any("input_dir" in r or "phase" in r for r in lineage):
        lines += training_table(lineage)
    else:
        lines.append("Not trained here: these are the weights of "
                     f"`{metadata.get('checkpoint')}` ({metadata.get('source_layout')} layout), "
                     "converted.")
    digest = metadata.get("image_digest")
    lines += ["", "## Image", "",
              (f"The last phase ran in `{metadata.get('image')}`, digest `{digest}`."
               if digest or metadata.get("image") else "The run recorded no image (it ran "
               "outside imgpipe's recipes)."),
              "", "## Model", "",
              "| layers | hidden | heads | intermediate | vocabulary | positions | token types "
              "| activation |", "|---|---|---|---|---|---|---|---|",
              f"| {config.num_hidden_layers} | {config.hidden_size} | "
              f"{config.num_attention_heads} | {config.intermediate_size} | {config.vocab_size} "
              f"| {config.max_position_embeddings} | {config.type_vocab_size} "
              f"| {config.hidden_act} |", "",
              f"Dropout: the config sets {fine_tuning_dropout} (hidden and attention), the usual "
              "value for fine-tuning; pre-training used "
              f"{dropout.get('hidden_dropout_prob')} and "
              f"{dropout.get('attention_probs_dropout_prob')} "
              "(`imgpipe_export.json`, `pretraining_dropout`).", "",
              "## Fine-tuning", "", *_fine_tuning(layout, folder, config, has_vocab), ""]
    return "\n".join(lines)
