"""The reference BERT pre-training data recipe, transcribed to plain Python for comparison.

What it transcribes is the behaviour of the widely used instance-creation script
(Google's ``create_pretraining_data.py`` as NVIDIA's DeepLearningExamples ship it, HDF5
output): its pure-Python WordPiece tokenizer, one ``random.Random(seed)`` stream for every
decision, every document and instance held in memory, and gzip-compressed HDF5 datasets.
The algorithm and the file format carry over; the code is written here, for two uses: the
fidelity test compares imgpipe's statistics with what this gives on the same corpus, and
``bench/bench_dataset.py`` times it as the baseline.

Input: text with one sentence a line and a blank line between documents (what imgpipe's text
shards hold).
"""

from __future__ import annotations

import random
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------- tokenizer (BERT's own)


def _is_whitespace(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    if char in "\t\n\r":
        return False
    return unicodedata.category(char).startswith("C")


def _is_punctuation(char: str) -> bool:
    code = ord(char)
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(code: int) -> bool:
    return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF
            or 0x2A700 <= code <= 0x2B73F or 0x2B740 <= code <= 0x2B81F
            or 0x2B820 <= code <= 0x2CEAF or 0xF900 <= code <= 0xFAFF
            or 0x2F800 <= code <= 0x2FA1F)


class ReferenceTokenizer:
    """Lower-casing BERT tokenizer: text cleanup, accents stripped, punctuation split, then
    greedy longest-match-first WordPiece (``##`` continuations, [UNK] for a word it cannot
    cover or longer than 100 characters)."""

    def __init__(self, vocab_file: Path) -> None:
        words = Path(vocab_file).read_text(encoding="utf-8").splitlines()
        self.vocab = {word.strip(): index for index, word in enumerate(words)}
        self.vocab_words = list(self.vocab)
        self.unk = self.vocab["[UNK]"]

    def _basic(self, text: str) -> list[str]:
        cleaned = []
        for char in text:
            code = ord(char)
            if code == 0 or code == 0xFFFD or _is_control(char):
                continue
            if _is_cjk(code):
                cleaned.append(f" {char} ")
            else:
                cleaned.append(" " if _is_whitespace(char) else char)
        pieces: list[str] = []
        for word in "".join(cleaned).split():
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                           if unicodedata.category(c) != "Mn")
            current = ""
            for char in word:
                if _is_punctuation(char):
                    if current:
                        pieces.append(current)
                    pieces.append(char)
                    current = ""
                else:
                    current += char
            if current:
                pieces.append(current)
        return pieces

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > 100:
            return [self.unk]
        ids, start = [], 0
        while start < len(word):
            end, found = len(word), None
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    found = self.vocab[piece]
                    break
                end -= 1
            if found is None:
                return [self.unk]
            ids.append(found)
            start = end
        return ids

    def encode(self, text: str) -> list[int]:
        return [i for word in self._basic(text) for i in self._wordpiece(word)]


# ---------------------------------------------------------------- instances


@dataclass
class Instance:
    tokens: list[int]
    segment_ids: list[int]
    is_random_next: bool
    masked_positions: list[int]
    masked_labels: list[int]


def read_documents(paths: Iterable[Path], tokenizer: ReferenceTokenizer) -> list[list[list[int]]]:
    documents: list[list[list[int]]] = [[]]
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                line = line.strip()
                if not line:
                    documents.append([])
                    continue
                tokens = tokenizer.encode(line)
                if tokens:
                    documents[-1].append(tokens)
    return [d for d in documents if d]


def _truncate(tokens_a: list[int], tokens_b: list[int], limit: int, rng: random.Random) -> None:
    while len(tokens_a) + len(tokens_b) > limit:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(tokens: list[int], specials: dict[str, int], vocab_size: int, masked_lm_prob: float,
          max_predictions: int, rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    candidates = [i for i, t in enumerate(tokens) if t not in (specials["cls"], specials["sep"])]
    rng.shuffle(candidates)
    output = list(tokens)
    # The count comes from the whole sequence, [CLS] and [SEP] included.
    count = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    chosen = []
    for index in candidates[:count]:
        if rng.random() < 0.8:
            output[index] = specials["mask"]
        elif rng.random() >= 0.5:
            # Any word of the vocabulary, special tokens included.
            output[index] = rng.randint(0, vocab_size - 1)
        chosen.append(index)
    chosen.sort()
    return output, chosen, [tokens[i] for i in chosen]


def instances_from_document(documents: list[list[list[int]]], index: int, max_seq_len: int,
                            short_seq_prob: float, masked_lm_prob: float, max_predictions: int,
                            specials: dict[str, int], vocab_size: int, rng: random.Random
                            ) -> list[Instance]:
    document = documents[index]
    limit = max_seq_len - 3
    target = limit
    if rng.random() < short_seq_prob:
        target = rng.randint(2, limit)
    made: list[Instance] = []
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = 1 if len(chunk) < 2 else rng.randint(1, len(chunk) - 1)
            tokens_a = [t for sentence in chunk[:a_end] for t in sentence]
            tokens_b: list[int] = []
            if len(chunk) == 1 or rng.random() < 0.5:
                is_random_next = True
                for _ in range(10):
                    other = rng.randint(0, len(documents) - 1)
                    if other != index:
                        break
                if other == index:
                    is_random_next = False
                source = documents[other]
                for sentence in source[rng.randint(0, len(source) - 1):]:
                    tokens_b.extend(sentence)
                    if len(tokens_b) >= target - len(tokens_a):
                        break
                i -= len(chunk) - a_end  # the unused sentences go back
            else:
                is_random_next = False
                tokens_b = [t for sentence in chunk[a_end:] for t in sentence]
            _truncate(tokens_a, tokens_b, limit, rng)
            tokens = [specials["cls"], *tokens_a, specials["sep"], *tokens_b, specials["sep"]]
            segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
            tokens, positions, labels = _mask(tokens, specials, vocab_size, masked_lm_prob,
                                              max_predictions, rng)
            made.append(Instance(tokens, segments, is_random_next, positions, labels))
            chunk, length = [], 0
        i += 1
    return made


def create_instances(documents: list[list[list[int]]], specials: dict[str, int],
                     vocab_size: int, max_seq_len: int, max_predictions: int,
                     dupe_factor: int = 5, short_seq_prob: float = 0.1,
                     masked_lm_prob: float = 0.15, seed: int = 12345) -> list[Instance]:
    rng = random.Random(seed)
    documents = list(documents)
    rng.shuffle(documents)
    made: list[Instance] = []
    for _ in range(dupe_factor):
        for index in range(len(documents)):
            made.extend(instances_from_document(documents, index, max_seq_len, short_seq_prob,
                                                masked_lm_prob, max_predictions, specials,
                                                vocab_size, rng))
    rng.shuffle(made)
    return made


def features(made: list[Instance], max_seq_len: int, max_predictions: int
             ) -> dict[str, np.ndarray]:
    """The legacy HDF5 arrays, filled row by row as the reference does."""
    n = len(made)
    arrays = {"input_ids": np.zeros((n, max_seq_len), "int32"),
              "input_mask": np.zeros((n, max_seq_len), "int32"),
              "segment_ids": np.zeros((n, max_seq_len), "int32"),
              "masked_lm_positions": np.zeros((n, max_predictions), "int32"),
              "masked_lm_ids": np.zeros((n, max_predictions), "int32"),
              "next_sentence_labels": np.zeros(n, "int32")}
    for row, instance in enumerate(made):
        ids = instance.tokens + [0] * (max_seq_len - len(instance.tokens))
        arrays["input_ids"][row] = ids
        arrays["input_mask"][row] = [1] * len(instance.tokens) + [0] * (max_seq_len
                                                                        - len(instance.tokens))
        arrays["segment_ids"][row] = instance.segment_ids + [0] * (max_seq_len
                                                                   - len(instance.tokens))
        pad = max_predictions - len(instance.masked_positions)
        arrays["masked_lm_positions"][row] = instance.masked_positions + [0] * pad
        arrays["masked_lm_ids"][row] = instance.masked_labels + [0] * pad
        arrays["next_sentence_labels"][row] = int(instance.is_random_next)
    return arrays


DTYPES = {"input_ids": "i4", "input_mask": "i1", "segment_ids": "i1",
          "masked_lm_positions": "i4", "masked_lm_ids": "i4", "next_sentence_labels": "i1"}


def write_hdf5(arrays: dict[str, np.ndarray], path: Path) -> None:
    """Every dataset gzip-compressed (h5py's default level), as the reference writes them."""
    import h5py

    with h5py.File(path, "w") as out:
        for key, dtype in DTYPES.items():
            out.create_dataset(key, data=arrays[key], dtype=dtype, compression="gzip")


def specials_of(tokenizer: ReferenceTokenizer) -> dict[str, int]:
    return {"cls": tokenizer.vocab["[CLS]"], "sep": tokenizer.vocab["[SEP]"],
            "mask": tokenizer.vocab["[MASK]"]}


def prepare(inputs: list[Path], vocab: Path, output: Path, max_seq_len: int,
            max_predictions: int, dupe_factor: int = 5, seed: int = 12345) -> int:
    """The whole reference job for one output file: tokenize, create, write.  Returns the
    instance count."""
    tokenizer = ReferenceTokenizer(vocab)
    documents = read_documents(inputs, tokenizer)
    made = create_instances(documents, specials_of(tokenizer), len(tokenizer.vocab_words),
                            max_seq_len, max_predictions, dupe_factor=dupe_factor, seed=seed)
    write_hdf5(features(made, max_seq_len, max_predictions), output)
    return len(made)
