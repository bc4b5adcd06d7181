"""Masked-LM + next-sentence instances, as the reference recipe makes them, vectorized.

The reference recipe (FACTS.md, transcribed in tests/reference_recipe.py): for every
document, ``dupe_factor`` times, chunks of sentences up to a target length (a random shorter
one with probability 0.1), each split at a random sentence into A and B; half the time
(always for a one-sentence chunk) B is replaced by text from a random start in a random
*other document of the whole corpus* and the unused sentences go back to the pool; the pair
is trimmed to fit, one token at a time from the front or the back of the longer side.  Then
``round(0.15 * len(sequence))`` positions ([CLS] and [SEP] counted in the length, never
chosen), at most P: 80% become [MASK], 10% a random token of the whole vocabulary, 10%
stay.

Done here in five passes over a shard:

1. ``plan``: the only per-instance Python loop: chunks, the A/B split and the next-sentence
   draw, from a random stream of the *document* (seed, sequence length, document number), so
   the pairs, their count and the next-sentence share do not depend on how the corpus was
   sharded or split between workers.
2. ``resolve``: random B segments located in whichever shard holds their document.
3. ``trim``: every pair's trimming in closed form (how many tokens each side loses is
   fixed by the lengths; how many of those come off the front is binomial).
4. ``gather``: the foreign B tokens copied next to the shard's own.
5. ``rows``: sequences assembled and masked a block of rows at a time (bounded memory).

Deliberate differences from the reference, none visible in the statistics: a random B is
never drawn from the document itself (the reference retries 10 times, then keeps the draw
and labels the pair "is next"); instance order within a file is a permutation from the
shard's stream, not one shuffle of the whole corpus held in memory.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from bert_trainer.dataset.tokens import Corpus, TokenShard


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
    vocab_size: int  # random replacements are drawn from [0, vocab_size), as the reference


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


@dataclass
class Pairs:
    """Every instance of a shard as token ranges; ``b_shard`` says whose tokens B are."""

    a_start: np.ndarray  # [N] int64, into the shard's own tokens
    a_len: np.ndarray
    b_shard: np.ndarray  # [N] int64
    b_start: np.ndarray  # into b_shard's tokens
    b_len: np.ndarray
    random_next: np.ndarray  # [N] int8

    def __len__(self) -> int:
        return len(self.a_start)

    def take(self, keep: np.ndarray) -> Pairs:
        return Pairs(*(getattr(self, name)[keep] for name in self.__dataclass_fields__))


def rng_for(seed: int, shard: int, seq_len: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, shard, seq_len])))


def document_stream(seed: int, seq_len: int, document: int) -> random.Random:
    """The stream of one document's decisions: the same whichever shard holds it."""
    return random.Random(f"bert-pairs:{seed}:{seq_len}:{document}".encode())


def plan(shard: TokenShard, numbers: np.ndarray, corpus_documents: int, params: Params
         ) -> tuple[list[int], ...]:
    """Pass 1.  Returns the pairs whose B follows A (a_start, a_len, b_start, b_len) and the
    random-next ones (a_start, a_len, other document, uniform for its start sentence, tokens
    wanted in B)."""
    limit = params.max_seq_len - 3
    short = params.short_seq_prob
    sentence_starts = shard.sentences
    document_starts = shard.documents.tolist()
    n_a, n_alen, n_b, n_blen = [], [], [], []
    r_a, r_alen, r_other, r_where, r_wanted = [], [], [], [], []
    others = corpus_documents - 1
    for local in range(shard.document_count):
        first_sentence, end_sentence = document_starts[local], document_starts[local + 1]
        sentences = end_sentence - first_sentence
        if sentences == 0:
            continue
        edge = sentence_starts[first_sentence:end_sentence + 1].tolist()
        number = int(numbers[local])
        draw = document_stream(params.seed, params.max_seq_len, number).random
        for _ in range(params.dupe_factor):
            target = limit
            if draw() < short:
                target = 2 + int(draw() * (limit - 1))  # randint(2, limit)
            first = 0
            while first < sentences:
                # The chunk ends at the first sentence that brings it to the target length.
                last = min(bisect_left(edge, edge[first] + target, first + 1) - 1,
                           sentences - 1)
                chunk = last + 1 - first
                a_end = first + (1 if chunk < 2 else 1 + int(draw() * (chunk - 1)))
                a_start, a_len = edge[first], edge[a_end] - edge[first]
                if chunk == 1 or draw() < 0.5:
                    if others:
                        other = int(draw() * others)
                        other += other >= number
                    else:  # a one-document corpus: B from the document itself
                        other = number
                    r_a.append(a_start)
                    r_alen.append(a_len)
                    r_other.append(other)
                    r_where.append(draw())
                    r_wanted.append(max(1, target - a_len))
                    first = a_end  # the unused sentences go back to the pool
                else:
                    n_a.append(a_start)
                    n_alen.append(a_len)
                    n_b.append(edge[a_end])
                    n_blen.append(edge[last + 1] - edge[a_end])
                    first = last + 1
    return n_a, n_alen, n_b, n_blen, r_a, r_alen, r_other, r_where, r_wanted


def resolve(planned: tuple[list[int], ...], corpus: Corpus, single_document: bool) -> Pairs:
    """Pass 2: random B segments located in their shards (a start sentence, then sentences
    until the wanted length)."""
    n_a, n_alen, n_b, n_blen, r_a, r_alen, r_other, r_where, r_wanted = planned
    other = np.asarray(r_other, np.int64)
    where = np.asarray(r_where, np.float64)
    wanted = np.asarray(r_wanted, np.int64)
    b_shard = np.zeros(len(other), np.int64)
    b_start = np.zeros(len(other), np.int64)
    b_len = np.zeros(len(other), np.int64)
    if len(other):
        holder = corpus.documents[other]
        b_shard[:] = holder[:, 0]
        place = holder[:, 1].astype(np.int64)
        for index in np.unique(b_shard).tolist():
            chosen = np.flatnonzero(b_shard == index)
            source = corpus.shard(index)
            first = np.asarray(source.documents[place[chosen]], np.int64)
            end = np.asarray(source.documents[place[chosen] + 1], np.int64)
            count = end - first
            usable = count > 0
            start = first + np.minimum((where[chosen] * count).astype(np.int64),
                                       np.maximum(count - 1, 0))
            start = np.where(usable, start, 0)
            starts_at = np.asarray(source.sentences[start], np.int64)
            stop = np.searchsorted(source.sentences, starts_at + wanted[chosen], "left")
            stop = np.clip(stop, start + 1, np.maximum(end, start + 1))
            b_start[chosen] = starts_at
            b_len[chosen] = np.where(usable, np.asarray(source.sentences[stop], np.int64)
                                     - starts_at, 0)
            del source
    own = np.full(len(n_a), corpus.own_index, np.int64)
    random_next = np.zeros(len(n_a) + len(other), np.int8)
    random_next[len(n_a):] = 0 if single_document else 1
    pairs = Pairs(np.asarray(n_a + r_a, np.int64), np.asarray(n_alen + r_alen, np.int64),
                  np.concatenate([own, b_shard]),
                  np.concatenate([np.asarray(n_b, np.int64), b_start]),
                  np.concatenate([np.asarray(n_blen, np.int64), b_len]), random_next)
    return pairs.take((pairs.a_len > 0) & (pairs.b_len > 0))


def trim(pairs: Pairs, limit: int, rng: np.random.Generator) -> None:
    """Pass 3: the reference trims the longer side one token at a time (B when equal), each
    token from the front or the back with equal chance.  So the longer side alone loses
    tokens until both are equal, then they alternate starting with B; the tokens taken from
    the front of a side that loses k are Binomial(k, 1/2)."""
    excess = np.maximum(pairs.a_len + pairs.b_len - limit, 0)
    a_longer = pairs.a_len > pairs.b_len
    alone = np.minimum(excess, np.abs(pairs.a_len - pairs.b_len))
    rest = excess - alone
    cut_a = np.where(a_longer, alone, 0) + rest // 2
    cut_b = np.where(a_longer, 0, alone) + (rest + 1) // 2
    front_a = rng.binomial(cut_a, 0.5)
    front_b = rng.binomial(cut_b, 0.5)
    pairs.a_start += front_a
    pairs.a_len -= cut_a
    pairs.b_start += front_b
    pairs.b_len -= cut_b


def gather(pairs: Pairs, corpus: Corpus) -> np.ndarray:
    """Pass 4: the shard's own tokens, then every foreign B (its ``b_start`` now points
    there), then one 0 that padding gathers."""
    own = corpus.own.tokens
    parts = [np.asarray(own, np.int32)]
    offset = len(own)
    for index in np.unique(pairs.b_shard).tolist():
        if index == corpus.own_index:
            continue
        chosen = np.flatnonzero(pairs.b_shard == index)
        lengths = pairs.b_len[chosen]
        total = int(lengths.sum())
        starts_in_pool = np.cumsum(lengths) - lengths
        positions = (np.repeat(pairs.b_start[chosen] - starts_in_pool, lengths)
                     + np.arange(total))
        source = corpus.shard(index)
        parts.append(np.asarray(source.tokens[positions], np.int32))
        del source
        pairs.b_start[chosen] = offset + starts_in_pool
        offset += total
    parts.append(np.zeros(1, np.int32))
    return np.concatenate(parts)


def make_pairs(corpus: Corpus, numbers: np.ndarray, params: Params, rng: np.random.Generator
               ) -> tuple[Pairs, np.ndarray]:
    """Passes 1-4: the shard's pairs in a random order, and the tokens they point into."""
    planned = plan(corpus.own, numbers, corpus.size, params)
    pairs = resolve(planned, corpus, corpus.size == 1)
    trim(pairs, params.max_seq_len - 3, rng)
    pairs = pairs.take(rng.permutation(len(pairs)))
    return pairs, gather(pairs, corpus)


def rows(pairs: Pairs, tokens: np.ndarray, params: Params, specials: Specials,
         rng: np.random.Generator) -> Instances:
    """Pass 5 for one block of pairs: sequences, segments, mask and the masked LM."""
    n, s, p = len(pairs), params.max_seq_len, params.max_predictions
    pad = len(tokens) - 1
    column = np.arange(s)[None, :]
    la, lb = pairs.a_len[:, None], pairs.b_len[:, None]
    in_a = (column >= 1) & (column <= la)
    in_b = (column >= la + 2) & (column < la + 2 + lb)
    source = np.full((n, s), pad, np.int64)
    np.copyto(source, pairs.a_start[:, None] + column - 1, where=in_a)
    np.copyto(source, pairs.b_start[:, None] + column - la - 2, where=in_b)
    input_ids = tokens[source]
    input_ids[:, 0] = specials.cls
    every = np.arange(n)
    input_ids[every, 1 + la[:, 0]] = specials.sep
    input_ids[every, 2 + la[:, 0] + lb[:, 0]] = specials.sep
    segment_ids = ((column >= la + 2) & (column <= la + 2 + lb)).view(np.int8)
    input_mask = (column < la + lb + 3).view(np.int8)
    candidates = in_a | in_b  # [CLS] and [SEP] are never chosen
    real = (la + lb)[:, 0]
    # The reference counts the whole sequence, [CLS] and both [SEP] included (round half
    # to even, as Python's round), then picks among the real tokens.
    to_predict = np.minimum(np.minimum(p, real),
                            np.maximum(1, np.rint((real + 3) * params.masked_lm_prob)))
    to_predict = to_predict.astype(np.int64)
    keys = rng.random((n, s), dtype=np.float32)
    keys[~candidates] = 2.0  # never chosen
    # The to_predict smallest keys mark the masked positions: a partition finds the p
    # smallest of each row, and only those p are sorted.
    if n:
        part = np.argpartition(keys, min(p, s) - 1, axis=1)[:, :p]
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(keys, part, axis=1),
                                                    axis=1, kind="stable"), axis=1)
    else:
        order = np.zeros((0, p), np.int64)
    valid = np.arange(p)[None, :] < to_predict[:, None]
    picked = np.sort(np.where(valid, order, s), axis=1)  # s sorts after every position
    valid = picked < s
    positions = np.where(valid, picked, 0).astype(np.int32)
    at = every[:, None]
    originals = np.where(valid, input_ids[at, np.minimum(positions, s - 1)], 0).astype(np.int32)
    decision = rng.random((n, p), dtype=np.float32)
    replacement = rng.integers(0, specials.vocab_size, (n, p), dtype=np.int32)
    as_mask = valid & (decision < 0.8)
    as_random = valid & (decision >= 0.9)
    new_values = np.where(as_mask, specials.mask, np.where(as_random, replacement, originals))
    flat_rows = np.broadcast_to(at, positions.shape)[valid]
    input_ids[flat_rows, positions[valid]] = new_values[valid]
    return Instances(input_ids.astype(np.int32, copy=False), input_mask, segment_ids,
                     positions, originals, pairs.random_next.copy(), int(valid.sum()),
                     int(as_mask.sum()), int(as_random.sum()), int(real.sum()))


def blocks(pairs: Pairs, tokens: np.ndarray, params: Params, specials: Specials,
           rng: np.random.Generator, block_rows: int) -> Iterator[Instances]:
    for start in range(0, len(pairs), block_rows):
        chosen = np.arange(start, min(start + block_rows, len(pairs)))
        yield rows(pairs.take(chosen), tokens, params, specials, rng)
