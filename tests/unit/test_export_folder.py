"""What an export hands a fine-tuning user: a folder they can take as it is (its modes the
exporting user's umask gives, never wider: a private run stays private; fine-tuning dropout,
the tokenizer stopping at the model's positions, activation names each side reads back, a
model card whose example runs), and conversions of public checkpoints with no run at all."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from bert_trainer import checkpoint
from bert_trainer.config import BertConfig
from bert_trainer.export import export, main
from bert_trainer.layouts import expected_shapes
from bert_trainer.model import BertForPreTraining
from bert_trainer.weights import initial_weights, load_initial, load_into

from tests.bert_layouts import VOCAB, dle_checkpoint, hub_style_folder, made

CONFIG = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
DIGEST = "sha256:" + "ab" * 32
# the lineage a phase-2 checkpoint carries, as pretrain writes it
LINEAGE = [{"phase": 1, "input_dir": "/data/phase1", "shards": 4,
            "data": {"documents": 120, "tokens": 51234, "instances": 3000},
            "max_seq_length": 32, "max_predictions_per_seq": 5, "global_batch": 64,
            "learning_rate": 0.01, "max_steps": 900, "init_checkpoint": None,
            "image": "x@" + DIGEST, "image_digest": DIGEST, "step": 900, "loss": 3.9612},
           {"phase": 2, "input_dir": "/data/phase2", "shards": 4, "data": None,
            "max_seq_length": 64, "max_predictions_per_seq": 10, "global_batch": 32,
            "learning_rate": 0.006, "max_steps": 300,
            "init_checkpoint": "/checkpoints/phase1/ckpt_900.pt", "image": "x@" + DIGEST,
            "image_digest": DIGEST, "step": 300, "loss": 3.5021}]


@pytest.fixture
def private_umask() -> Iterator[None]:
    old = os.umask(0o077)  # what many clusters set: files 0600 unless made readable
    yield
    os.umask(old)


def _saved(tmp_path: Path, config: BertConfig = CONFIG) -> tuple[BertForPreTraining, Path]:
    torch.manual_seed(0)
    model = BertForPreTraining(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    payload = {"format": checkpoint.FORMAT, "phase": 2, "step": 300, "loss": 3.5021,
               "config": json.loads(config.to_json()), "image": "x@" + DIGEST,
               "image_digest": DIGEST, "lineage": LINEAGE, "model": model.state_dict()}
    return model, checkpoint.save(tmp_path / "ckpt" / "phase2", 300, payload, keep=1)


def _vocab(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    return folder / "vocab.txt"


def _logits(model: torch.nn.Module, theirs: transformers.PreTrainedModel) -> None:
    ids = torch.randint(5, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    mask, types = torch.ones_like(ids), torch.zeros_like(ids)
    positions = torch.tensor([[1, 4, 7], [2, 3, 11]])
    with torch.no_grad():
        mlm, nsp = model(ids, types, mask, positions)
        out = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types)
    at = torch.gather(out.prediction_logits, 1, positions.unsqueeze(-1).expand(-1, -1, VOCAB))
    torch.testing.assert_close(at, mlm, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.seq_relationship_logits, nsp, atol=1e-5, rtol=0)


def test_an_export_is_a_folder_to_fine_tune_from_as_it_is(tmp_path: Path,
                                                           private_umask: None) -> None:
    _, saved = _saved(tmp_path)
    folder = export(saved, "hf", tmp_path / "shared" / "bert", vocab=_vocab(tmp_path / "v"))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # umask 077: the user's alone
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "vocab.txt", "tokenizer.json",
         "tokenizer_config.json", "imgpipe_export.json", "README.md"], 0o600)
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_dropout_prob"], config["attention_probs_dropout_prob"]) == (0.1, 0.1)
    assert json.loads((folder / "imgpipe_export.json").read_text())["pretraining_dropout"] == {
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.model_max_length == 64  # the model's positions, not 512
    assert len(tokenizer(" ".join(WORDS[5:]) * 3, truncation=True)["input_ids"]) == 64
    card = (folder / "README.md").read_text()
    training = card.split("## Training")[1].split("## ")[0]
    rows = [line for line in training.splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert rows == [
        "| 1 | `/data/phase1` (4 shards, 3,000 sequences, 51,234 tokens of text, 120 documents)"
        f" | 32 | 5 | 64 | 900 | 3.9612 | {DIGEST} |",
        f"| 2 | `/data/phase2` (4 shards) | 64 | 10 | 32 | 300 | 3.5021 | {DIGEST} |"]
    assert f"digest `{DIGEST}`" in card and "pre-training used 0.0 and 0.0" in card
    # the card's fine-tuning example runs as written, on this folder
    example = re.search(r"```python\n(.*?)```", card, re.S)
    assert example and f'folder = "{folder}"' in example.group(1)
    scope: dict = {}
    exec(example.group(1), scope)  # noqa: S102 - the card's own code, the point of the test
    assert scope["model"].bert.encoder.layer[0].attention.self.query.weight.grad is not None


def test_gelu_tanh_models_keep_their_activation_each_way(tmp_path: Path) -> None:
    tanh = BertConfig(**{**json.loads(CONFIG.to_json()), "hidden_act": "gelu_tanh"})
    model, saved = _saved(tmp_path, tanh)
    folder = export(saved, "hf", tmp_path / "hf", vocab=_vocab(tmp_path / "v"))
    assert json.loads((folder / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"
    _logits(model, transformers.BertForPreTraining.from_pretrained(folder).eval())
    weights, _ = initial_weights(folder, tanh)  # the trainer reads transformers' name back
    assert torch.equal(weights["layers.0.qkv.weight"], model.state_dict()["layers.0.qkv.weight"])
    with pytest.raises(Exception, match="DeepLearningExamples' modeling.py has no tanh-"
                       "approximated GeLU .*: export this model --to hf"):
        export(saved, "nvidia", tmp_path / "nv")
    assert not (tmp_path / "nv").exists()
    nvidia = export(_saved(tmp_path / "exact")[1], "nvidia", tmp_path / "nv-exact")
    assert json.loads((nvidia / "bert_config.json").read_text())["hidden_act"] == "gelu"


def test_public_checkpoints_convert_with_no_run(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    theirs = made()
    hub = hub_style_folder(theirs, tmp_path / "bert-base-uncased")
    _vocab(hub)
    nvidia = export(hub, "nvidia", tmp_path / "as-nvidia")
    stored = torch.load(nvidia / "bert_nvidia.pt", weights_only=True)["model"]
    assert {k: tuple(v.shape) for k, v in stored.items()} == expected_shapes(CONFIG, "nvidia")
    assert "Not trained here" in (nvidia / "README.md").read_text()
    back = export(nvidia / "bert_nvidia.pt", "hf", tmp_path / "back-to-hf")  # vocab.txt beside
    loaded = transformers.BertForPreTraining.from_pretrained(back).eval()
    ours = BertForPreTraining(CONFIG).eval()
    load_into(ours, load_initial(back, CONFIG))
    _logits(ours, theirs)
    _logits(ours, loaded)
    # NVIDIA's own checkpoints, the pickled kind only when trusted
    dle = dle_checkpoint(theirs, tmp_path / "dle" / "ckpt_8601.pt", data_loader=True)
    capsys.readouterr()  # transformers' progress bars
    assert main([str(dle), "--to", "hf", "-o", str(tmp_path / "x"),
                 f"--vocab_file={hub / 'vocab.txt'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --trust_checkpoint" in err
    assert not (tmp_path / "x").exists()
    assert main([str(dle), "--to", "hf", "-o", str(tmp_path / "x"), "--trust_checkpoint",
                 f"--vocab_file={hub / 'vocab.txt'}"]) == 0
    _logits(ours, transformers.BertForPreTraining.from_pretrained(tmp_path / "x").eval())


@pytest.mark.parametrize("case", ["mlm-only", "no config", "config of fewer layers"])
def test_what_an_export_cannot_be_is_one_line(tmp_path: Path, case: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    extra: list[str] = []
    if case == "mlm-only":
        made("BertForMaskedLM").save_pretrained(tmp_path / "src")
        source, expected = tmp_path / "src", (
            f"export: {tmp_path / 'src'}: a BertForMaskedLM has no pooler or next-sentence "
            "head: exports hold BERT with pre-training heads; start a run from it "
            "(--init_checkpoint) instead")
    elif case == "no config":
        source = tmp_path / "weights.bin"
        torch.save(made().state_dict(), source)
        expected = (f"export: {source}: no config.json or bert_config.json beside {source}: "
                    "pass --config_file")
    else:
        _, source = _saved(tmp_path)
        one = tmp_path / "one-layer.json"
        one.write_text(json.dumps({**json.loads(CONFIG.to_json()), "num_hidden_layers": 1}))
        extra = [f"--config_file={one}"]
        expected = (f"export: {source}: num_hidden_layers: the checkpoint's config says 2, "
                    f"--config_file {one} says 1")
    capsys.readouterr()  # transformers' progress bars
    assert main([str(source), "--to", "nvidia", "-o", str(tmp_path / "out"), *extra]) == 2
    assert capsys.readouterr().err == expected + "\n"
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
