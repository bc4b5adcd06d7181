"""The trained model leaves the cluster: a trainer checkpoint exported for Hugging Face
``transformers`` and NVIDIA's DeepLearningExamples, and their checkpoints taken as
``--init_checkpoint``; the same logits on both sides of each door (CPU, float32)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (pyproject's test extra)
from bert_trainer import checkpoint
from bert_trainer.config import BertConfig
from bert_trainer.export import export, main
from bert_trainer.layouts import expected_shapes
from bert_trainer.model import BertForPreTraining
from bert_trainer.weights import initial_weights

CONFIG = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(94)]


def _trained(tmp_path: Path) -> tuple[BertForPreTraining, Path]:
    """A model whose every weight moved away from its initialisation, saved as the trainer
    saves its checkpoints (step, phase, loss, the image it ran in)."""
    torch.manual_seed(0)
    model = BertForPreTraining(CONFIG).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        model.embeddings.word_embeddings.weight[CONFIG.vocab_size:] = 0  # padding rows
        model.mlm_bias[CONFIG.vocab_size:] = 0
    payload = {"format": checkpoint.FORMAT, "phase": 2, "step": 7, "loss": 6.25,
               "config": json.loads(CONFIG.to_json()), "image": "head#imgpipe/bert@sha256:ab",
               "image_digest": "sha256:" + "ab" * 32, "model": model.state_dict()}
    return model, checkpoint.save(tmp_path / "ckpt" / "phase2", 7, payload, keep=2)


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, CONFIG.vocab_size, (3, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0  # padding at the ends of two sequences
    mask[2, 6:] = 0
    ids[mask == 0] = 0
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    positions = torch.tensor([[1, 3, 5, 9], [2, 4, 12, 15], [1, 2, 3, 4]])
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
            "positions": positions}


def _ours(model: BertForPreTraining, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                         batch["positions"])
    return mlm[..., :CONFIG.vocab_size], nsp


def _theirs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"])
    index = batch["positions"].unsqueeze(-1).expand(-1, -1, CONFIG.vocab_size)
    return torch.gather(out.prediction_logits, 1, index), out.seq_relationship_logits


def _vocab(tmp_path: Path) -> Path:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(WORDS) + "\n")
    return path


def test_an_exported_checkpoint_gives_transformers_the_same_logits(tmp_path: Path) -> None:
    model, saved = _trained(tmp_path)
    folder = export(saved.parent.parent, "hf", tmp_path / "hf", vocab=_vocab(tmp_path))
    loaded = transformers.BertForPreTraining.from_pretrained(folder).eval()
    for seed in (1, 2, 3):
        ours, theirs = _ours(model, _batch(seed)), _theirs(loaded, _batch(seed))
        torch.testing.assert_close(theirs[0], ours[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(theirs[1], ours[1], atol=1e-5, rtol=0)
    assert loaded.cls.predictions.decoder.weight.data_ptr() == \
        loaded.bert.embeddings.word_embeddings.weight.data_ptr()  # tied, as HF ties it
    for head in ("BertForMaskedLM", "BertForQuestionAnswering"):  # fine-tuning starts here
        _, info = getattr(transformers, head).from_pretrained(folder, output_loading_info=True)
        assert not [k for k in info["missing_keys"] if not k.startswith("qa_outputs")], info
    metadata = json.loads((folder / "imgpipe_export.json").read_text())
    assert metadata == {"layout": "hf", "checkpoint": str(saved), "source_layout": "trainer",
                        "phase": 2, "step": 7, "loss": 6.25,
                        "image": "head#imgpipe/bert@sha256:ab",
                        "image_digest": "sha256:" + "ab" * 32,
                        "pretraining_dropout": {"hidden_dropout_prob": 0.0,
                                                "attention_probs_dropout_prob": 0.0}}
    fill = transformers.pipeline("fill-mask", model=str(folder), device="cpu")
    assert len(fill("w1 w2 [MASK] w3", top_k=3)) == 3


def test_a_hugging_face_model_starts_a_run_with_its_own_logits(tmp_path: Path) -> None:
    torch.manual_seed(3)
    hf_config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    theirs = transformers.BertForPreTraining(hf_config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    for source in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):
        weights, layout = initial_weights(source, CONFIG)
        assert layout == "hf"
        ours = BertForPreTraining(CONFIG).eval()
        ours.load_state_dict(weights)
        mine, hers = _ours(ours, _batch()), _theirs(theirs, _batch())
        torch.testing.assert_close(mine[0], hers[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(mine[1], hers[1], atol=1e-5, rtol=0)


def test_export_import_export_is_bit_identical(tmp_path: Path) -> None:
    _, saved = _trained(tmp_path)
    vocab = _vocab(tmp_path)
    first = export(saved, "hf", tmp_path / "one", vocab=vocab)
    weights, _ = initial_weights(first, CONFIG)
    payload = checkpoint.load(saved)
    again = checkpoint.save(tmp_path / "again", 7, {**payload, "model": weights}, keep=1)
    second = export(again, "hf", tmp_path / "two", vocab=vocab)
    assert (first / "model.safetensors").read_bytes() == \
        (second / "model.safetensors").read_bytes()
    nvidia_one = export(saved, "nvidia", tmp_path / "nv1")
    weights, layout = initial_weights(nvidia_one / "bert_nvidia.pt", CONFIG)
    assert layout == "nvidia"
    for name, tensor in checkpoint.load(saved)["model"].items():
        assert torch.equal(weights[name], tensor), name


def _dle_keys_and_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """NVIDIA DeepLearningExamples' PyTorch/LanguageModeling/BERT/modeling.py
    BertForPreTraining, as its modules name their parameters: BertEmbeddings (three
    embeddings, LayerNorm), BertLayer (attention.self query/key/value, attention.output
    dense + LayerNorm, intermediate.dense_act: a LinearActivation, output dense +
    LayerNorm), BertPooler.dense_act, BertPreTrainingHeads (predictions: transform.dense_act
    + LayerNorm, decoder tied to the word embeddings, bias; seq_relationship).  Their
    pre-training pads the vocabulary to a multiple of 8."""
    h, f, v = config.hidden_size, config.intermediate_size, config.padded_vocab_size
    keys = {"bert.embeddings.word_embeddings.weight": (v, h),
            "bert.embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
            "bert.embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
            "bert.embeddings.LayerNorm.weight": (h,), "bert.embeddings.LayerNorm.bias": (h,)}
    for n in range(config.num_hidden_layers):
        p = f"bert.encoder.layer.{n}."
        for linear, shape in (("attention.self.query", (h, h)), ("attention.self.key", (h, h)),
                              ("attention.self.value", (h, h)),
                              ("attention.output.dense", (h, h)),
                              ("intermediate.dense_act", (f, h)), ("output.dense", (h, f))):
            keys[p + linear + ".weight"] = shape
            keys[p + linear + ".bias"] = (shape[0],)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            keys[p + norm + ".weight"] = keys[p + norm + ".bias"] = (h,)
    keys.update({"bert.pooler.dense_act.weight": (h, h), "bert.pooler.dense_act.bias": (h,),
                 "cls.predictions.bias": (v,),
                 "cls.predictions.transform.dense_act.weight": (h, h),
                 "cls.predictions.transform.dense_act.bias": (h,),
                 "cls.predictions.transform.LayerNorm.weight": (h,),
                 "cls.predictions.transform.LayerNorm.bias": (h,),
                 "cls.predictions.decoder.weight": (v, h),
                 "cls.seq_relationship.weight": (2, h), "cls.seq_relationship.bias": (2,)})
    return keys


def test_the_nvidia_layout_is_their_modeling_pys_keys_and_shapes(tmp_path: Path) -> None:
    bert_large = BertConfig()
    assert expected_shapes(bert_large, "nvidia") == _dle_keys_and_shapes(bert_large)
    _, saved = _trained(tmp_path)
    folder = export(saved, "nvidia", tmp_path / "nv")
    stored = torch.load(folder / "bert_nvidia.pt", weights_only=True)["model"]
    assert {k: tuple(v.shape) for k, v in stored.items()} == _dle_keys_and_shapes(CONFIG)


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, saved = _trained(tmp_path)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(saved.read_bytes()[:1000])
    assert main([str(truncated), "--to", "nvidia", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable checkpoint" in err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    bigger = BertConfig(vocab_size=99, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64)
    with pytest.raises(checkpoint.CheckpointError, match="hidden_size: the checkpoint's config "
                       "says 32, the run's config says 64"):
        initial_weights(saved, bigger)
    with pytest.raises(checkpoint.CheckpointError, match="not a readable checkpoint"):
        initial_weights(truncated, CONFIG)
    other = tmp_path / "other.pt"
    torch.save({"model": {"encoder.weight": torch.zeros(2)}}, other)
    with pytest.raises(checkpoint.CheckpointError, match="not a BERT checkpoint of a known "
                       "layout"):
        initial_weights(other, CONFIG)
    assert main([str(saved), "--to", "hf", "-o", str(tmp_path / "hf")]) == 2
    assert "pass --vocab_file" in capsys.readouterr().err
    os.makedirs(tmp_path / "taken")
    assert main([str(saved), "--to", "nvidia", "-o", str(tmp_path / "taken")]) == 2
