"""Generated, learnable pre-training data in the HDF5 shard format (self-test, tests, benches).

Each segment is a run of consecutive token ids (wrapping inside the normal
range), so a masked token follows from its neighbours and a model that learns
anything drives the MLM loss down quickly; segment B continues A's run for
"is next" pairs and starts anywhere for random ones, so NSP is learnable too.
Masking follows the usual recipe: 15% of the tokens, 80% [MASK], 10% random,
10% unchanged; about one sequence in ten is shorter and padded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert_trainer.dataset import hdf5
from bert_trainer.dataset.instances import Instances

CLS, SEP, MASK, FIRST_NORMAL = 2, 3, 4, 5


def instances(count: int, seq_len: int, max_pred: int, vocab_size: int,
              rng: np.random.Generator) -> Instances:
    if vocab_size <= FIRST_NORMAL + 1 or seq_len < 8:
        raise ValueError("synthetic data needs a vocabulary > 6 and sequences >= 8 tokens")
    normal = vocab_size - FIRST_NORMAL
    out = Instances(np.zeros((count, seq_len), np.int32), np.zeros((count, seq_len), np.int8),
                    np.zeros((count, seq_len), np.int8), np.zeros((count, max_pred), np.int32),
                    np.zeros((count, max_pred), np.int32), np.zeros(count, np.int8))
    for row in range(count):
        length = seq_len if rng.random() >= 0.1 else int(rng.integers(8, seq_len + 1))
        body = length - 3
        a_len = body // 2
        start = int(rng.integers(normal))
        random_next = rng.random() < 0.5
        b_start = int(rng.integers(normal)) if random_next else start + a_len
        a = FIRST_NORMAL + (start + np.arange(a_len)) % normal
        b = FIRST_NORMAL + (b_start + np.arange(body - a_len)) % normal
        ids = np.concatenate([[CLS], a, [SEP], b, [SEP]])
        out.input_ids[row, :length] = ids
        out.input_mask[row, :length] = 1
        out.segment_ids[row, a_len + 2:length] = 1
        out.next_sentence_labels[row] = int(random_next)
        candidates = np.flatnonzero(ids >= FIRST_NORMAL)
        picks = np.sort(rng.choice(candidates, min(max_pred, max(1, round(0.15 * body))),
                                   replace=False))
        out.masked_lm_positions[row, :len(picks)] = picks
        out.masked_lm_ids[row, :len(picks)] = ids[picks]
        for position in picks:
            draw = rng.random()
            if draw < 0.8:
                out.input_ids[row, position] = MASK
            elif draw < 0.9:
                out.input_ids[row, position] = FIRST_NORMAL + int(rng.integers(normal))
    return out


def write_shards(folder: Path, shards: int, per_shard: int, seq_len: int, max_pred: int,
                 vocab_size: int, seed: int = 12345) -> list[Path]:
    """``shards`` files ``shard_NNNNN.hdf5`` of ``per_shard`` instances each."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(shards):
        rng = np.random.default_rng([seed, index])
        path = folder / f"shard_{index:05d}.hdf5"
        hdf5.write(instances(per_shard, seq_len, max_pred, vocab_size, rng), path)
        paths.append(path)
    return paths
