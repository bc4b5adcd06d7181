"""The unpadded encoder (bert_trainer/unpad.py) against the padded one, fp32 on the CPU: the
same loss, the same logits at the masked slots, the same gradients (1e-5), over batches of
many lengths: all full, [CLS] x [SEP] rows, a lone [CLS], holes in the mask; the same loss
curve through the trainer; and a batch it cannot take is one clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bert_trainer.config import TINY, BertConfig
from bert_trainer.data import KEYS, Position, to_batch
from bert_trainer.model import IGNORE, BertForPreTraining, pretraining_loss
from bert_trainer.synthetic import instances
from bert_trainer.trainer import Trainer
from bert_trainer.unpad import PaddingError, device_index, host_index

SEQ, PRED = 32, 6
CONFIG = BertConfig(**{**TINY.__dict__, "vocab_size": 61})  # padded to 64: the slice counts


def make_batch(lengths: list[int], seed: int, holes: bool = False) -> dict[str, torch.Tensor]:
    """Rows of the given real lengths: [CLS] body [SEP] (a length of 1 is [CLS] alone),
    masked slots among the body tokens, unused slots at position 0 with IGNORE labels."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.randint(5, CONFIG.vocab_size, (rows, SEQ), generator=gen)
    mask = torch.zeros(rows, SEQ, dtype=torch.int8)
    types = torch.zeros(rows, SEQ, dtype=torch.long)
    positions = torch.zeros(rows, PRED, dtype=torch.long)
    labels = torch.full((rows, PRED), IGNORE, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        ids[row, 0] = 2
        if length > 1:
            ids[row, length - 1] = 3
        types[row, length // 2:length] = 1
        if holes and length > 6:
            mask[row, 2] = 0  # a token the mask leaves out mid-sequence
        body = [c for c in range(1, length - 1) if mask[row, c]]
        picks = sorted(torch.randperm(len(body), generator=gen)[:PRED].tolist())
        for slot, pick in enumerate(picks):
            positions[row, slot] = body[pick]
            labels[row, slot] = int(ids[row, body[pick]])
            ids[row, body[pick]] = 4
    ids[mask == 0] = 0
    return {"input_ids": ids, "segment_ids": types, "input_mask": mask,
            "masked_lm_positions": positions, "masked_lm_labels": labels,
            "next_sentence_labels": torch.randint(0, 2, (rows,), generator=gen)}


def run(model: BertForPreTraining, batch: dict, indices: bool = False) -> dict:
    model.zero_grad(set_to_none=True)
    extra = {}
    if indices:
        token_index, cu = host_index(batch["input_mask"].numpy())
        extra = {"token_index": torch.from_numpy(token_index),
                 "cu_seqlens": torch.from_numpy(cu)}
    mlm, nsp = model(batch["input_ids"], batch["segment_ids"], batch["input_mask"],
                     batch["masked_lm_positions"], **extra)
    loss, correct, predicted = pretraining_loss(mlm, batch["masked_lm_labels"], nsp,
                                                batch["next_sentence_labels"])
    loss.backward()
    return {"loss": loss.detach(), "mlm": mlm.detach(), "nsp": nsp.detach(),
            "correct": correct, "predicted": predicted,
            "grads": {n: grad(p) for n, p in model.named_parameters()}}


def grad(parameter: torch.Tensor) -> torch.Tensor:
    assert parameter.grad is not None
    return parameter.grad.clone()


def twins() -> tuple[BertForPreTraining, BertForPreTraining]:
    torch.manual_seed(0)
    padded = BertForPreTraining(CONFIG, unpadded=False)
    with torch.no_grad():  # every weight away from its initial value (LayerNorms, biases)
        for parameter in padded.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    unpadded = BertForPreTraining(CONFIG, unpadded=True)
    unpadded.load_state_dict(padded.state_dict())
    return padded, unpadded


def assert_same(theirs: dict, ours: dict) -> None:
    torch.testing.assert_close(ours["loss"], theirs["loss"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["mlm"], theirs["mlm"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours["nsp"], theirs["nsp"], atol=1e-5, rtol=0)
    assert (ours["correct"], ours["predicted"]) == (theirs["correct"], theirs["predicted"])
    for name, grad in theirs["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, atol=1e-5, rtol=0, msg=name)


LENGTHS = {
    "all full": [SEQ] * 5,
    "cls x sep": [3] * 5,
    "a lone cls": [1, 2, 3, SEQ],
    "mixed": [SEQ, 3, 17, 1, 9, SEQ, 2, 30, 4, 25, 3, SEQ - 1],
}


@pytest.mark.parametrize("name", LENGTHS)
def test_unpadded_equals_padded_in_loss_logits_and_gradients(name: str) -> None:
    padded, unpadded = twins()
    batch = make_batch(LENGTHS[name], seed=len(name))
    reference = run(padded, batch)
    assert_same(reference, run(unpadded, batch))
    assert_same(reference, run(unpadded, batch, indices=True))  # the data loader's indices
    assert any(float(g.abs().sum()) > 0 for g in reference["grads"].values())


def test_many_random_lengths_and_holes_in_the_mask() -> None:
    padded, unpadded = twins()
    rng = np.random.default_rng(7)
    for seed in range(6):
        lengths = [int(x) for x in rng.integers(1, SEQ + 1, size=9)]
        batch = make_batch(lengths, seed, holes=seed % 2 == 1)
        assert_same(run(padded, batch), run(unpadded, batch))


def test_the_indices_from_the_host_and_from_the_device_agree() -> None:
    mask = make_batch(LENGTHS["mixed"], seed=3, holes=True)["input_mask"]
    on_host = host_index(mask.numpy())
    on_device = device_index(mask)
    assert np.array_equal(on_host[0], on_device[0].numpy())
    assert np.array_equal(on_host[1], on_device[1].numpy())
    assert on_host[1][-1] == int(mask.sum()) and on_host[1].dtype == np.int32


def test_a_sequence_starting_with_padding_is_one_clear_error() -> None:
    mask = torch.ones(3, 8, dtype=torch.int8)
    mask[1, :] = 0
    for index in (lambda: host_index(mask.numpy()), lambda: device_index(mask)):
        with pytest.raises(PaddingError, match="sequence 1 of the batch starts with padding"):
            index()


def test_the_trainer_gives_the_same_loss_curve_padded_and_unpadded() -> None:
    made = instances(60 * 8, SEQ, PRED, TINY.vocab_size, np.random.default_rng(11))
    arrays = {key: getattr(made, key) for key in KEYS}
    assert not made.input_mask.all()  # some rows are padded
    curves = []
    for unpadded in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(BertForPreTraining(TINY, unpadded=unpadded), torch.device("cpu"),
                          "fp32", 2e-2, 0.1, 30, 2)
        losses = []
        for step in range(30):
            micro = [to_batch([{k: v[(2 * step + i) * 8:(2 * step + i + 1) * 8]
                                for k, v in arrays.items()}], Position()) for i in range(2)]
            losses.append(float(trainer.step(micro).loss))
        curves.append(losses)
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
    assert sum(curves[0][-5:]) / 5 < curves[0][0]  # and it learns


def test_a_new_token_count_does_not_recompile_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer marks the unpadded token count dynamic before the first compile: batches
    of other counts reuse that graph (on BERT-Large a recompile costs minutes).  Dynamo's
    eager backend: the guards are dynamo's whatever the backend, and it compiles in a second."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    config = BertConfig(**{**TINY.__dict__, "num_hidden_layers": 1})
    made = instances(4 * 4, SEQ, PRED, config.vocab_size, np.random.default_rng(11))
    arrays = {key: getattr(made, key) for key in KEYS}
    data = [to_batch([{k: v[i * 4:(i + 1) * 4] for k, v in arrays.items()}], Position())
            for i in range(4)]
    assert len({len(batch.token_index) for batch in data}) > 1  # the counts differ
    torch._dynamo.reset()
    trainer = Trainer(BertForPreTraining(config), torch.device("cpu"), "fp32", 1e-3, 0.1, 4, 1,
                      compile_model=True)
    trainer.step([data[0]])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in data[1:]:
            trainer.step([batch])
    torch._dynamo.reset()
