"""bench/bench_trainer.py's data: its real lengths carry the published mean, and its
length-grouped baseline holds the same sequences.  Its CPU smoke run (every row and profile
it writes has the keys the GPU table is made from) is tests/e2e/test_trainer_slow.py's."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch
from bert_trainer.config import BertConfig

from tests.bench_scripts import load_bench


def bench() -> ModuleType:
    return load_bench("bench_trainer")


def test_real_lengths_carry_the_published_mean() -> None:
    module = bench()
    # phase 2: 254 real tokens per 512-token sequence (the generator's own short rows used
    # to stack on the cut: 232)
    arrays = module.make_arrays(BertConfig(), module.SHAPES[2], 2, "real")
    lengths = arrays["input_mask"].sum(1)
    assert len(lengths) == 128 and lengths.mean() == pytest.approx(254, abs=1)
    assert module.length_model(512, 2)[0] == pytest.approx(254, abs=0.1)
    assert (lengths == 512).mean() == pytest.approx(0.2, abs=0.01) and lengths.min() >= 8
    # every cut row still ends in [SEP] and predicts only inside itself
    rows = np.arange(len(lengths))
    assert (arrays["input_ids"][rows, lengths - 1] == 3).all()
    assert (arrays["masked_lm_positions"] < (lengths - 1)[:, None]).all()
    # phase 1: the recipe's rule, one row in ten short: 0.9 x 128 + 0.1 x 68
    phase1 = module.make_arrays(BertConfig(), module.SHAPES[1], 1, "real")
    assert phase1["input_mask"].sum(1).mean() == pytest.approx(122, abs=0.5)


def test_length_grouped_batches_hold_the_same_sequences_each_padded_to_its_longest() -> None:
    module = bench()
    arrays = module.make_arrays(BertConfig(), module.SHAPES[2], 2, "real")
    cpu = torch.device("cpu")
    padded = module.batches_of(arrays, 32, cpu)
    grouped = module.batches_of(arrays, 32, cpu, grouped=True)
    assert {b.input_ids.shape for b in padded} == {(32, 512)}
    widths = [b.input_ids.shape[1] for b in grouped]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 512
    for batch in grouped:
        assert int(batch.input_mask.sum(1).max()) == batch.input_ids.shape[1]

    def sequences(batches: list) -> list[tuple[int, ...]]:
        return sorted(tuple(row[mask.bool()].tolist()) for b in batches
                      for row, mask in zip(b.input_ids, b.input_mask, strict=True))

    assert sequences(grouped) == sequences(padded)
    assert sum(int((b.masked_lm_labels >= 0).sum()) for b in grouped) == sum(
        int((b.masked_lm_labels >= 0).sum()) for b in padded)
