"""Starting from what people download (``--init_checkpoint``): every public layout, built here
with ``transformers`` from a config, gives the trainer the logits ``transformers`` computes
for the heads it has, or is refused in one line naming what does not fit (CPU, float32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from bert_trainer.checkpoint import CheckpointError
from bert_trainer.config import BertConfig
from bert_trainer.model import BertForPreTraining
from bert_trainer.weights import Initial, load_initial, load_into

from tests.bert_layouts import (
    HIDDEN,
    LAYERS,
    POSITIONS,
    VOCAB,
    dle_checkpoint,
    hf_config,
    hub_style_folder,
    made,
)

CONFIG = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                    num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(5, VOCAB, (3, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # a padded sequence
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, 7:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
            "positions": torch.tensor([[1, 3, 5, 9], [2, 4, 6, 8], [0, 11, 14, 15]])}


def _trainer_model(initial: Initial) -> BertForPreTraining:
    torch.manual_seed(0)
    model = BertForPreTraining(CONFIG).eval()
    load_into(model, initial)
    return model


def _ours(model: BertForPreTraining) -> dict[str, torch.Tensor]:
    b = _batch()
    with torch.no_grad():
        encoded = model.encode(b["input_ids"], b["token_type_ids"], b["attention_mask"])
        mlm, nsp = model(b["input_ids"], b["token_type_ids"], b["attention_mask"],
                         b["positions"])
    return {"encoded": encoded, "pooled": model.pooled(encoded), "mlm": mlm, "nsp": nsp}


def _theirs(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    b = _batch()
    inputs = {k: b[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if isinstance(model, transformers.BertModel):
            got = model(**inputs)
            return {"encoded": got.last_hidden_state, "pooled": got.pooler_output}
        got = model(**inputs, output_hidden_states=True)
    out["encoded"] = got.hidden_states[-1]
    logits = got.prediction_logits if hasattr(got, "prediction_logits") else got.logits
    out["mlm"] = torch.gather(logits, 1, b["positions"].unsqueeze(-1).expand(-1, -1, VOCAB))
    if hasattr(got, "seq_relationship_logits"):
        out["nsp"] = got.seq_relationship_logits
    return out


def _same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, atol=1e-5, rtol=0, msg=name)


def test_the_hubs_bert_base_layout_loads_with_its_old_names(tmp_path: Path) -> None:
    theirs = made()
    folder = hub_style_folder(theirs, tmp_path / "bert-base-uncased")
    # transformers reads the folder as it is: the reference for these files
    reloaded = transformers.BertForPreTraining.from_pretrained(folder).eval()
    _same(_theirs(theirs), _theirs(reloaded))
    for path in (folder, folder / "pytorch_model.bin"):
        initial = load_initial(path, CONFIG)
        assert (initial.layout, initial.kind, initial.fresh) == ("hf", "BertForPreTraining", ())
        assert "LayerNorm gamma/beta names read as weight/bias" in " ".join(initial.notes)
        _same(_ours(_trainer_model(initial)), _theirs(theirs))


def test_sharded_folders_load_from_their_index(tmp_path: Path) -> None:
    theirs = made()
    hub_style_folder(theirs, tmp_path / "bin", shards=3)
    theirs.save_pretrained(tmp_path / "safetensors", max_shard_size="40KB")
    assert (tmp_path / "safetensors" / "model.safetensors.index.json").is_file()
    for folder in (tmp_path / "bin", tmp_path / "safetensors"):
        _same(_ours(_trainer_model(load_initial(folder, CONFIG))), _theirs(theirs))
    (tmp_path / "bin" / "pytorch_model-00002-of-00003.bin").unlink()
    with pytest.raises(CheckpointError, match="names pytorch_model-00002-of-00003.bin, which "
                       "is not there"):
        load_initial(tmp_path / "bin", CONFIG)


def test_an_mlm_only_model_gets_fresh_pooler_and_nsp_head_named_in_one_line(
        tmp_path: Path) -> None:
    theirs = made("BertForMaskedLM")  # what run_mlm.py leaves
    theirs.save_pretrained(tmp_path / "mlm")
    initial = load_initial(tmp_path / "mlm", CONFIG)
    assert initial.kind == "BertForMaskedLM"
    assert initial.fresh == ("pooler", "next-sentence head")
    assert initial.fresh_line() == (
        f"{tmp_path / 'mlm'}, a BertForMaskedLM (hf), has no pooler or next-sentence head "
        "(bert.pooler.dense.*, cls.seq_relationship.*): initialised fresh")
    ours = _trainer_model(initial)
    _same(_ours(ours), _theirs(theirs))
    torch.manual_seed(0)
    fresh = BertForPreTraining(CONFIG).state_dict()  # the run's own initialisation
    assert torch.equal(ours.state_dict()["nsp.weight"], fresh["nsp.weight"])


def test_an_encoder_only_model_gets_fresh_heads_and_a_tied_decoder(tmp_path: Path) -> None:
    theirs = made("BertModel")
    theirs.save_pretrained(tmp_path / "encoder")
    initial = load_initial(tmp_path / "encoder", CONFIG)
    assert (initial.layout, initial.kind) == ("hf", "BertModel")
    assert initial.fresh == ("masked-LM head", "next-sentence head")
    line = initial.fresh_line()
    assert line is not None and line.endswith(
        "(cls.predictions.transform.dense.*, cls.predictions.transform.LayerNorm.*, "
        "cls.predictions.bias, cls.seq_relationship.*): initialised fresh, the decoder tied "
        "to the word embeddings")
    ours = _trainer_model(initial)
    _same(_ours(ours), _theirs(theirs))  # encoder output and pooler
    assert ours.embeddings.word_embeddings.weight.shape[0] == 104  # padded, the decoder's too
    transformers.BertModel(hf_config(), add_pooling_layer=False).save_pretrained(
        tmp_path / "no-pooler")
    assert load_initial(tmp_path / "no-pooler", CONFIG).kind == "BertModel without its pooler"


@pytest.mark.parametrize("data_loader", [False, True], ids=["new", "2020-2022"])
def test_nvidia_checkpoints_load_and_a_pickled_data_loader_needs_trust(
        tmp_path: Path, data_loader: bool) -> None:
    theirs = made()
    path = dle_checkpoint(theirs, tmp_path / "results" / "ckpt_8601.pt", data_loader)
    if data_loader:
        with pytest.raises(CheckpointError) as refused:
            load_initial(path, CONFIG)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"--init_checkpoint {path}: ")
        assert "run_pretraining.WorkerInitObj" in message and "pass --trust_checkpoint" in message
    initial = load_initial(tmp_path / "results", CONFIG, trust=data_loader)
    assert (initial.layout, initial.kind) == ("nvidia", "BertForPreTraining")
    _same(_ours(_trainer_model(initial)), _theirs(theirs))


def _refused(path: Path, config: BertConfig = CONFIG, run: str = "--config_file run.json"
             ) -> str:
    with pytest.raises(CheckpointError) as refused:
        load_initial(path, config, run)
    assert "\n" not in str(refused.value)
    return str(refused.value).removeprefix(f"--init_checkpoint {path}: ")


def test_another_architecture_is_one_line_naming_both_values(tmp_path: Path) -> None:
    made(num_hidden_layers=4).save_pretrained(tmp_path / "deeper")
    config = tmp_path / "deeper" / "config.json"
    assert _refused(tmp_path / "deeper") == (
        "num_hidden_layers: the checkpoint's weights have 4, --config_file run.json says 2 "
        f"(to train that model, pass --config_file {config})")
    assert _refused(tmp_path / "deeper" / "model.safetensors").startswith(
        "num_hidden_layers: the checkpoint's weights have 4")
    made(num_attention_heads=8).save_pretrained(tmp_path / "heads")  # only the config tells
    assert _refused(tmp_path / "heads").startswith(
        f"num_attention_heads: {tmp_path / 'heads' / 'config.json'} says 8, --config_file "
        "run.json says 4")
    made(hidden_act="gelu_pytorch_tanh").save_pretrained(tmp_path / "tanh")
    assert _refused(tmp_path / "tanh").startswith("hidden_act: ")
    made(type_vocab_size=3).save_pretrained(tmp_path / "types")
    assert _refused(tmp_path / "types").startswith(
        "type_vocab_size: the checkpoint's weights have 3")
    made(max_position_embeddings=128).save_pretrained(tmp_path / "longer")
    assert _refused(tmp_path / "longer").startswith(
        "max_position_embeddings: the checkpoint's weights have 128")
    # a config.json that contradicts its own weights is caught by the weights
    theirs = made()
    theirs.save_pretrained(tmp_path / "liar")
    values = json.loads((tmp_path / "liar" / "config.json").read_text())
    (tmp_path / "liar" / "config.json").write_text(json.dumps({**values, "vocab_size": 120}))
    assert _refused(tmp_path / "liar").startswith(
        f"vocab_size: {tmp_path / 'liar' / 'config.json'} says 120")


def test_unused_keys_and_an_untied_decoder_are_refused(tmp_path: Path) -> None:
    made("BertForSequenceClassification").save_pretrained(tmp_path / "classifier")
    assert _refused(tmp_path / "classifier").startswith(
        "unused keys classifier.bias, classifier.weight: no part of a BERT of 2 layers")
    state = made().state_dict()
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1
    torch.save(state, tmp_path / "untied.bin")
    assert _refused(tmp_path / "untied.bin") == (
        "cls.predictions.decoder.weight differs from bert.embeddings.word_embeddings.weight: "
        "this trainer ties the masked-LM decoder to the word embeddings, as BERT does")
    half = {k: v for k, v in made().state_dict().items() if k != "bert.pooler.dense.bias"}
    torch.save(half, tmp_path / "half.bin")
    assert _refused(tmp_path / "half.bin") == (
        "missing bert.pooler.dense.bias (the rest of the pooler is there)")


def test_a_folder_with_nothing_to_start_from_lists_what_it_looks_for(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert _refused(tmp_path / "empty") == (
        "no ckpt_<step>.pt there or in its phase1/ folder (run phase 1 first), nor a model "
        "file (model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
        "pytorch_model.bin.index.json, bert_nvidia.pt)")


def test_the_trainer_page_shows_what_the_code_reads_and_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/trainer.md: the files and activation names it lists are the ones read, and its
    example lines are what the trainer prints for those checkpoints."""
    from bert_trainer.config import ACTIVATIONS
    from bert_trainer.pretrain import parse_args
    from bert_trainer.sources import MODEL_FILES

    page = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    assert all(f"`{name}`" in page for name in (*MODEL_FILES, *ACTIVATIONS))
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "--trust_checkpoint" in capsys.readouterr().out and "--trust_checkpoint" in page
    monkeypatch.chdir(tmp_path)
    made("BertForMaskedLM").save_pretrained("mlm")
    made(num_hidden_layers=4).save_pretrained("deep")
    warning = load_initial(Path("mlm"), CONFIG).fresh_line()
    assert json.dumps({"event": "warning", "message": warning}) in page.splitlines()
    with pytest.raises(CheckpointError) as refused:
        load_initial(Path("deep"), CONFIG, "--config_file run.json")
    assert f"error: {refused.value}" in page.splitlines()
