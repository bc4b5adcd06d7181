"""The token store: every text shard tokenized once, kept on disk, read by any shard's job.

Instance creation draws the random "next" segment from any document of the corpus, so each
shard's tokens are written as three ``.npy`` arrays that other jobs map without reading
them whole: the token ids end to end (uint16 when the vocabulary fits, else int32), where
each sentence starts (token offsets, one more than the sentences), and where each document
starts (sentence indexes, one more than the documents).  ``text/documents.npy`` says which
shard holds every document of the corpus, and at which place, in the order the source
gave them: a document's number is the same whatever the shard count.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PARTS = ("tokens", "sentences", "documents")


@dataclass
class TokenShard:
    tokens: np.ndarray  # [T] uint16 or int32
    sentences: np.ndarray  # [S + 1] int64: token offset where each sentence starts, then T
    documents: np.ndarray  # [D + 1] int64: sentence where each document starts, then S

    @property
    def document_count(self) -> int:
        return len(self.documents) - 1


def paths(folder: Path, index: int) -> dict[str, Path]:
    return {part: folder / f"shard_{index:05d}.{part}.npy" for part in PARTS}


def save_array(path: Path, array: np.ndarray) -> None:
    """Write under a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".tmp-{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(folder: Path, index: int, shard: TokenShard) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    where = paths(folder, index)
    for part, path in where.items():
        save_array(path, getattr(shard, part))
    return where


def load(folder: Path, index: int, mapped: bool = True) -> TokenShard:
    """The arrays of one shard; ``mapped`` reads pages only where they are used."""
    mode = "r" if mapped else None
    arrays = {part: np.load(path, mmap_mode=mode, allow_pickle=False)
              for part, path in paths(folder, index).items()}
    return TokenShard(**arrays)


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def tokenize(documents: list[list[str]], encode, vocab_size: int, batch_chars: int = 1 << 17
             ) -> TokenShard:
    """Documents of sentences -> a TokenShard.  ``encode`` maps a list of sentences to lists
    of ids, called on about ``batch_chars`` of text at a time (the tokenizer's per-token
    objects cost ~100 bytes each); sentences with no token are dropped (a document may end
    up with none: it keeps its number, and a random segment drawn from it is empty, so that
    pair is skipped)."""
    dtype = token_dtype(vocab_size)
    pieces: list[np.ndarray] = []
    sentence_ends: list[int] = []
    document_ends: list[int] = []
    tokens_so_far = 0
    pending: list[str] = []
    # Each document's sentences in ``pending``: (count, whether the document ends there).
    runs: list[tuple[int, bool]] = []

    def flush() -> None:
        nonlocal tokens_so_far
        encoded = encode(pending) if pending else []
        cursor = 0
        for count, ends in runs:
            for ids in encoded[cursor:cursor + count]:
                if ids:
                    pieces.append(np.asarray(ids, dtype))
                    tokens_so_far += len(ids)
                    sentence_ends.append(tokens_so_far)
            cursor += count
            if ends:
                document_ends.append(len(sentence_ends))
        pending.clear()
        runs.clear()

    chars = 0
    for document in documents:
        taken = 0
        for sentence in document:
            pending.append(sentence)
            taken += 1
            chars += len(sentence)
            if chars >= batch_chars:
                runs.append((taken, False))
                flush()
                taken = chars = 0
        runs.append((taken, True))
    flush()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    sentences = np.asarray([0, *sentence_ends], np.int64)
    starts = np.asarray([0, *document_ends], np.int64)
    return TokenShard(tokens, sentences, starts)


class Corpus:
    """Every shard's tokens, found by document number; shards are mapped when first used."""

    def __init__(self, folder: Path, documents: np.ndarray, own_index: int,
                 own: TokenShard) -> None:
        self.folder = folder
        self.documents = documents  # [D, 2] int32: (shard, place in that shard)
        self.own_index, self.own = own_index, own

    @property
    def size(self) -> int:
        return len(self.documents)

    def shard(self, index: int) -> TokenShard:
        return self.own if index == self.own_index else load(self.folder, index)
