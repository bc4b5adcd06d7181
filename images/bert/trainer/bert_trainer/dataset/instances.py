"""Masked-LM + next-sentence instances, deterministic from the seed, masking vectorized.

Pairs follow the reference recipe (FACTS.md): chunks of sentences up to the
target length (shorter with probability 0.1), split at a random sentence into
A and B, B taken from a random other document half of the time, the pair
trimmed to fit.  Masking is done for all instances at once with numpy: 15% of
the real tokens (at most P), of which 80% become [MASK], 10% a random token
and 10% stay.  The random stream depends only on (seed, shard, sequence
length), so any number of workers produces the same bytes.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from math import comb

import numpy as np


@dataclass(frozen=True)
class Params:
    max_seq_len: int
    max_predictions: int
    dupe_factor: int = 5
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    seed: int = 12345


@dataclass(frozen=True)
class Specials:
    cls: int
    sep: int
    mask: int
    vocab_size: int
    first_normal: int  # random replacements are drawn from [first_normal, vocab_size)


@dataclass
class Instances:
    input_ids: np.ndarray  # [N, S] int32
    input_mask: np.ndarray  # [N, S] int8
    segment_ids: np.ndarray  # [N, S] int8
    masked_lm_positions: np.ndarray  # [N, P] int32
    masked_lm_ids: np.ndarray  # [N, P] int32
    next_sentence_labels: np.ndarray  # [N] int8
    masked_tokens: int = 0
    masked_as_mask: int = 0
    masked_as_random: int = 0
    real_tokens: int = 0


def rng_for(seed: int, shard: int, seq_len: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, shard, seq_len])))


_BINOMIAL: dict[int, list[float]] = {}


class Uniforms:
    """Uniform draws served from blocks: per-call numpy scalars cost microseconds each."""

    BLOCK = 1 << 16

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng, self.values, self.next = rng, [], 0

    def random(self) -> float:
        if self.next == len(self.values):
            self.values, self.next = self.rng.random(self.BLOCK).tolist(), 0
        value = self.values[self.next]
        self.next += 1
        return value

    def integers(self, low: int, high: int) -> int:
        """An integer in [low, high)."""
        return low + min(int(self.random() * (high - low)), high - low - 1)

    def heads(self, flips: int) -> int:
        """How many of ``flips`` fair coins come up heads (one draw, by inverse CDF)."""
        if flips <= 0:
            return 0
        table = _BINOMIAL.get(flips)
        if table is None:
            total, running, table = 2.0 ** flips, 0.0, []
            for k in range(flips + 1):
                running += comb(flips, k) / total
                table.append(running)
            _BINOMIAL[flips] = table
        return min(bisect_left(table, self.random()), flips)


def _trim(a: list[int], b: list[int], limit: int, draws: Uniforms) -> None:
    """Shorten the longer of A and B one token at a time until they fit, each token from
    the front or the back at random; computed in closed form.  Ranges change in place."""
    excess = (a[1] - a[0]) + (b[1] - b[0]) - limit
    if excess <= 0:
        return
    la, lb = a[1] - a[0], b[1] - b[0]
    longer, shorter = (a, b) if la > lb else (b, a)
    first = min(excess, abs(la - lb))  # the longer one alone until both are equal
    rest = excess - first
    # Then they alternate, starting with B (ties trim B).
    cut = {id(longer): first, id(shorter): 0}
    cut[id(b)] += (rest + 1) // 2
    cut[id(a)] += rest // 2
    for side in (a, b):
        removed = cut[id(side)]
        front = draws.heads(removed)
        side[0] += front
        side[1] -= removed - front


def make_pairs(documents: list[list[np.ndarray]], params: Params, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ranges of every instance: A and B as (offset, length) into ``flatten(documents)``,
    and the next-sentence labels.  No tokens are copied here."""
    limit = params.max_seq_len - 3
    # Plain Python ints in the loop: numpy scalars cost ten times more per operation.
    bounds = [list(accumulate((len(x) for x in d), initial=0)) for d in documents]
    doc_offsets = list(accumulate((b[-1] for b in bounds), initial=0))
    a_ranges, b_ranges, labels = [], [], []
    count = len(documents)
    draws = Uniforms(rng)
    for _ in range(params.dupe_factor):
        for index in range(count):
            edge = bounds[index]
            sentences = len(edge) - 1
            target = limit
            if draws.random() < params.short_seq_prob:
                target = draws.integers(2, limit + 1)
            first = 0
            while first < sentences:
                # The chunk ends at the first sentence that brings it to the target length.
                last = min(bisect_left(edge, edge[first] + target, first + 1) - 1,
                           sentences - 1)
                chunk = last + 1 - first
                a_end = first + (1 if chunk < 2 else draws.integers(1, chunk))
                a = [edge[first], edge[a_end]]
                random_next = count > 1 and (chunk == 1 or draws.random() < 0.5)
                if random_next:
                    other = draws.integers(0, count - 1)
                    other += other >= index
                    other_edge = bounds[other]
                    start = draws.integers(0, len(other_edge) - 1)
                    wanted = max(1, target - (a[1] - a[0]))
                    stop = bisect_left(other_edge, other_edge[start] + wanted)
                    stop = min(max(stop, start + 1), len(other_edge) - 1)
                    b = [other_edge[start], other_edge[stop]]
                    b_doc = other
                    next_first = a_end  # unused sentences go back to the pool
                else:
                    b = [edge[a_end], edge[last + 1]]
                    b_doc = index
                    next_first = last + 1
                if a[1] > a[0] and b[1] > b[0]:
                    _trim(a, b, limit, draws)
                    a_ranges.append((doc_offsets[index] + a[0], a[1] - a[0]))
                    b_ranges.append((doc_offsets[b_doc] + b[0], b[1] - b[0]))
                    labels.append(int(random_next))
                first = next_first
    shape = (len(labels), 2)
    return (np.asarray(a_ranges, np.int64).reshape(shape),
            np.asarray(b_ranges, np.int64).reshape(shape), np.asarray(labels, np.int8))


def build(documents: list[list[np.ndarray]], params: Params, specials: Specials,
          rng: np.random.Generator) -> Instances:
    a_ranges, b_ranges, labels = make_pairs(documents, params, rng)
    n, s, p = len(labels), params.max_seq_len, params.max_predictions
    # Every document's tokens end to end, then one 0 that padding gathers.
    tokens = np.concatenate([x for d in documents for x in d] + [np.zeros(1, np.int32)])
    pad = len(tokens) - 1
    # One gather fills every row: [CLS] A [SEP] B [SEP] then padding.
    column = np.arange(s)[None, :]
    la, lb = a_ranges[:, 1:2], b_ranges[:, 1:2]
    in_a = (column >= 1) & (column <= la)
    in_b = (column >= la + 2) & (column < la + 2 + lb)
    source = np.where(in_a, a_ranges[:, 0:1] + column - 1,
                      np.where(in_b, b_ranges[:, 0:1] + column - la - 2, pad))
    input_ids = tokens[source]
    input_ids[:, 0] = specials.cls
    rows = np.arange(n)
    input_ids[rows, 1 + la[:, 0]] = specials.sep
    input_ids[rows, 2 + la[:, 0] + lb[:, 0]] = specials.sep
    segment_ids = ((column >= la + 2) & (column <= la + 2 + lb)).view(np.int8)
    input_mask = (column < la + lb + 3).view(np.int8)
    candidates = in_a | in_b  # every real token; [CLS] and [SEP] are never masked
    real = (la + lb)[:, 0]
    to_predict = np.minimum(p, np.maximum(1, np.rint(real * params.masked_lm_prob))).astype(int)
    keys = rng.random((n, s))
    keys[~candidates] = 2.0  # never chosen
    # The to_predict smallest keys mark the masked positions: a partition finds the p
    # smallest of each row, and only those p are sorted.
    if n:
        part = np.argpartition(keys, min(p, s) - 1, axis=1)[:, :p]
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(keys, part, axis=1),
                                                    axis=1, kind="stable"), axis=1)
    else:
        order = np.zeros((0, p), int)
    valid = np.arange(p)[None, :] < to_predict[:, None]
    picked = np.where(valid, order, s)  # s sorts after every real position
    picked = np.sort(picked, axis=1)
    valid = picked < s
    positions = np.where(valid, picked, 0).astype(np.int32)
    rows = np.arange(n)[:, None]
    originals = np.where(valid, input_ids[rows, np.minimum(positions, s - 1)], 0).astype(np.int32)
    decision = rng.random((n, p))
    replacement = rng.integers(specials.first_normal, specials.vocab_size, (n, p), dtype=np.int32)
    as_mask = valid & (decision < 0.8)
    as_random = valid & (decision >= 0.9)
    new_values = np.where(as_mask, specials.mask, np.where(as_random, replacement, originals))
    flat_rows = np.broadcast_to(rows, positions.shape)[valid]
    input_ids[flat_rows, positions[valid]] = new_values[valid]
    return Instances(input_ids, input_mask, segment_ids, positions, originals, labels,
                     int(valid.sum()), int(as_mask.sum()), int(as_random.sum()), int(real.sum()))
