"""Generated, learnable pre-training data in the HDF5 shard format (self-test, tests, benches).

Each segment is a run of consecutive token ids (wrapping inside the normal
range), so a masked token follows from its neighbours and a model that learns
anything drives the MLM loss down quickly; segment B continues A's run for
"is next" pairs and starts anywhere for random ones, so NSP is learnable too.
Masking follows the usual recipe: 15% of the tokens, 80% [MASK], 10% random,
10% unchanged; about one sequence in ten is shorter and padded (``short_share``: none for
callers that cut the rows to lengths of their own, as the trainer bench does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert_trainer.dataset import hdf5
from bert_trainer.dataset.instances import Instances

CLS, SEP, MASK, FIRST_NORMAL = 2, 3, 4, 5


def instances(count: int, seq_len: int, max_pred: int, vocab_size: int,
              rng: np.random.Generator, short_share: float = 0.1) -> Instances:
    if vocab_size <= FIRST_NORMAL + 1 or seq_len < 8:
        raise ValueError("synthetic data needs a vocabulary > 6 and sequences >= 8 tokens")
    normal = vocab_size - FIRST_NORMAL
    out = Instances(np.zeros((count, seq_len), np.int32), np.zeros((count, seq_len), np.int8),
                    np.zeros((count, seq_len), np.int8), np.zeros((count, max_pred), np.int32),
                    np.zeros((count, max_pred), np.int32), np.zeros(count, np.int8))
    for row in range(count):
        length = (seq_len if rng.random() >= short_share
                  else int(rng.integers(8, seq_len + 1)))
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


# Lengths as Wikipedia's pre-training sequences have them (a model, not a corpus), for the
# trainer bench.  Phase 2: a fifth of the rows full, the rest 8 + (L - 8) x Beta(a, 2), ``a``
# set so the mean is 254 real tokens of 512, the published statistic (about half is
# padding: NVIDIA's MLPerf packing statistics; Graphcore, arXiv 2107.02027), scaled to
# other L.  Phase 1: the reference recipe's rule, short rows (probability 0.1) uniform over
# [8, L], the rest full.
PHASE2_REAL_SHARE = 254 / 512
PHASE2_FULL, PHASE1_SHORT, SHORTEST = 0.2, 0.1, 8


def _beta_quantile(p: np.ndarray, a: float) -> np.ndarray:
    """Quantiles of Beta(a, 2), whose CDF is (a + 1) x^a - a x^(a + 1), by bisection."""
    low, high = np.zeros_like(p), np.ones_like(p)
    for _ in range(50):
        mid = (low + high) / 2
        below = (a + 1) * mid**a - a * mid ** (a + 1) < p
        low, high = np.where(below, mid, low), np.where(below, high, mid)
    return (low + high) / 2


def length_quantile(p: np.ndarray, seq_len: int, phase: int) -> np.ndarray:
    """The length model's sequence lengths at quantiles ``p``."""
    span = seq_len - SHORTEST
    if phase == 1:
        short = SHORTEST + np.rint(span * np.minimum(p / PHASE1_SHORT, 1.0))
        return np.where(p < PHASE1_SHORT, short, seq_len).astype(np.int64)
    # the drawn rows' mean share of the span that makes the whole mean PHASE2_REAL_SHARE
    share = ((PHASE2_REAL_SHARE - PHASE2_FULL) * seq_len / (1 - PHASE2_FULL) - SHORTEST) / span
    drawn = _beta_quantile(np.minimum(p / (1 - PHASE2_FULL), 1.0), 2 * share / (1 - share))
    return np.where(p >= 1 - PHASE2_FULL, seq_len,
                    SHORTEST + np.rint(span * drawn)).astype(np.int64)


def length_model(seq_len: int, phase: int) -> tuple[float, float]:
    """The model's mean length and its standard deviation (over 10^5 quantiles)."""
    lengths = length_quantile((np.arange(100_000) + 0.5) / 100_000, seq_len, phase)
    return float(lengths.mean()), float(lengths.std())


def real_lengths(count: int, seq_len: int, phase: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` lengths at evenly spaced quantiles of the model, in random order: a draw
    whose mean is the model's, not one that happened to come out long or short."""
    return rng.permutation(length_quantile((np.arange(count) + 0.5) / count, seq_len, phase))


def real_length_instances(count: int, seq_len: int, max_pred: int, vocab_size: int,
                          phase: int, rng: np.random.Generator) -> Instances:
    """``instances`` with the lengths of ``real_lengths``: full rows, each cut to its drawn
    length ([CLS] ... [SEP] [PAD] ...), its predictions past the cut dropped.  Only full
    rows are cut: the generator's own short rows would stack on the model's."""
    out = instances(count, seq_len, max_pred, vocab_size, rng, short_share=0.0)
    for row, length in enumerate(real_lengths(count, seq_len, phase, rng)):
        out.input_ids[row, length:] = 0
        out.input_ids[row, length - 1] = SEP
        out.input_mask[row, length:] = 0
        out.segment_ids[row, length:] = 0
        positions = out.masked_lm_positions[row]
        keep = np.cumprod((positions < length - 1) & (positions > 0)).astype(bool)
        positions[~keep] = 0
        out.masked_lm_ids[row][~keep] = 0
    return out
