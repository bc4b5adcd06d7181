"""Training batches from HDF5 shards: distinct shards per rank, exact positions, prefetched.

Each epoch the shard files are permuted from ``(seed, epoch)`` and rank ``r`` of
``W`` takes every W-th one starting at ``r``, so ranks never read the same shard
in an epoch and any number of shards >= W works (ranks may hold one more shard
than others; each rank's stream simply runs on into its next epoch).  Instances
inside a shard are permuted from ``(seed, epoch, shard)``.  A batch may span two
shards; the position after each batch (epoch, shard index, offset) is all a
checkpoint needs to resume the stream exactly.

A background thread assembles the next batches while the step runs, and a
second one reads the next shard while the current one is consumed; h5py reads
whole shards (one sequential read each), which is what the legacy format's
small files are made for.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from bert_trainer.model import IGNORE
from bert_trainer.unpad import PaddingError, host_index

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
        "next_sentence_labels")


class DataError(ValueError):
    """Shards that cannot feed this run (missing, too few, wrong shapes); names the file."""


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    shard: int = 0  # index into this rank's shard list of the epoch
    offset: int = 0  # instances of that shard already consumed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64
    segment_ids: torch.Tensor  # [B, S] int64
    input_mask: torch.Tensor  # [B, S] int8, 1 for real tokens
    masked_lm_positions: torch.Tensor  # [B, P] int64, 0 in unused slots
    masked_lm_labels: torch.Tensor  # [B, P] int64, IGNORE in unused slots
    next_sentence_labels: torch.Tensor  # [B] int64
    token_index: torch.Tensor  # [T] int64: row * S + column of each real token
    cu_seqlens: torch.Tensor  # [B + 1] int32: running sum of the lengths
    position: Position  # of the stream after this batch

    TENSORS = ("input_ids", "segment_ids", "input_mask", "masked_lm_positions",
               "masked_lm_labels", "next_sentence_labels", "token_index", "cu_seqlens")

    def map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The same batch with ``change`` applied to every tensor."""
        return Batch(**{name: change(getattr(self, name)) for name in self.TENSORS},
                     position=self.position)

    def to(self, device: torch.device) -> Batch:
        if device.type == "cpu":
            return self
        return self.map(lambda tensor: tensor.to(device, non_blocking=True))


def shard_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise DataError(f"--input_dir {folder} is not a directory")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".hdf5", ".h5")
                   and not p.name.startswith("."))
    if not files:
        raise DataError(f"--input_dir {folder} holds no .hdf5 shards "
                        "(prepare them with python -m bert_trainer.dataset prepare)")
    return files


class ShardStream:
    """This rank's endless stream of micro-batches, starting at ``start``."""

    def __init__(self, files: list[Path], rank: int, world_size: int, seed: int,
                 micro_batch: int, seq_len: int, max_pred: int, vocab_size: int,
                 start: Position | None = None, type_vocab_size: int = 2) -> None:
        if len(files) < world_size:
            raise DataError(f"{len(files)} shard(s) in {files[0].parent} for {world_size} "
                            "ranks: every rank reads distinct shards, so there must be at "
                            "least as many shards as ranks")
        self.files, self.rank, self.world_size, self.seed = files, rank, world_size, seed
        self.micro_batch, self.seq_len, self.max_pred = micro_batch, seq_len, max_pred
        self.vocab_size, self.type_vocab_size = vocab_size, type_vocab_size
        self.start = start or Position()

    def shards_of_epoch(self, epoch: int) -> list[int]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        return [int(i) for i in order[self.rank::self.world_size]]

    def load(self, index: int, epoch: int) -> dict[str, np.ndarray]:
        path = self.files[index]
        try:
            with h5py.File(path, "r") as handle:
                arrays = {key: handle[key][()] for key in KEYS}
        except (OSError, KeyError) as exc:
            raise DataError(f"{path}: not a BERT HDF5 shard ({exc})") from None
        count, seq_len = arrays["input_ids"].shape
        if seq_len != self.seq_len or arrays["masked_lm_positions"].shape[1] != self.max_pred:
            raise DataError(
                f"{path}: sequences of {seq_len} tokens with "
                f"{arrays['masked_lm_positions'].shape[1]} predictions, but this run has "
                f"--max_seq_length={self.seq_len} --max_predictions_per_seq={self.max_pred}")
        if count and int(arrays["input_ids"].max()) >= self.vocab_size:
            raise DataError(f"{path}: token id {int(arrays['input_ids'].max())} is outside the "
                            f"model's vocabulary of {self.vocab_size} (check --config_file)")
        segments = arrays["segment_ids"]
        if count and not 0 <= int(segments.min()) <= int(segments.max()) < self.type_vocab_size:
            bad = int(segments.min()) if segments.min() < 0 else int(segments.max())
            raise DataError(f"{path}: segment id {bad} is outside the model's type_vocab_size "
                            f"of {self.type_vocab_size} (check --config_file: pre-training "
                            "pairs two sentences, so BERT's type_vocab_size is 2)")
        order = np.random.default_rng([self.seed, epoch, index]).permutation(count)
        return {key: value[order] for key, value in arrays.items()}

    def _sequence(self) -> Iterator[tuple[int, int, int]]:
        """(epoch, index in the epoch's list, file index) from the start position on."""
        epoch, shard = self.start.epoch, self.start.shard
        while True:
            shards = self.shards_of_epoch(epoch)
            for position in range(shard, len(shards)):
                yield epoch, position, shards[position]
            epoch, shard = epoch + 1, 0

    def __iter__(self) -> Iterator[Batch]:
        sequence = self._sequence()
        offset = self.start.offset
        pending: list[dict[str, np.ndarray]] = []
        have = 0
        empty_since: int | None = None  # epoch of the first of a run of empty shards
        # One shard is read ahead while the current one is consumed, so crossing a shard
        # boundary does not stall the step on a whole-file read.
        with ThreadPoolExecutor(1, thread_name_prefix="bert-shard") as reader:
            epoch, shard, index = next(sequence)
            loading = reader.submit(self.load, index, epoch)
            while True:
                arrays = loading.result()
                following = next(sequence)
                loading = reader.submit(self.load, following[2], following[0])
                count = len(arrays["input_ids"])
                if count == 0:
                    empty_since = epoch if empty_since is None else empty_since
                    if epoch - empty_since > 1:  # two whole epochs without an instance
                        raise DataError(f"the shards of rank {self.rank} in "
                                        f"{self.files[0].parent} hold no instances")
                else:
                    empty_since = None
                while offset < count:
                    take = min(self.micro_batch - have, count - offset)
                    pending.append({k: v[offset:offset + take] for k, v in arrays.items()})
                    have += take
                    offset += take
                    if have == self.micro_batch:
                        yield to_batch(pending, Position(epoch, shard, offset))
                        pending, have = [], 0
                (epoch, shard, index), offset = following, 0


def to_batch(parts: list[dict[str, np.ndarray]], position: Position) -> Batch:
    """Shard rows (one or more slices) -> tensors with labels for the loss."""
    arrays = {key: np.concatenate([p[key] for p in parts]) for key in KEYS}
    positions = arrays["masked_lm_positions"].astype(np.int64)
    # The first 0 ends the list of predictions (position 0 is [CLS], never masked).
    used = np.cumprod(positions != 0, axis=1).astype(bool)
    labels = np.where(used, arrays["masked_lm_ids"], IGNORE).astype(np.int64)
    # Where the real tokens are, for the unpadded encoder: found here, on the host, so the
    # device never waits for it.
    try:
        token_index, cu_seqlens = host_index(arrays["input_mask"])
    except PaddingError as exc:
        raise DataError(f"{exc}: not a BERT pre-training instance") from None
    return Batch(
        input_ids=torch.from_numpy(arrays["input_ids"].astype(np.int64)),
        segment_ids=torch.from_numpy(arrays["segment_ids"].astype(np.int64)),
        input_mask=torch.from_numpy(arrays["input_mask"].astype(np.int8)),
        masked_lm_positions=torch.from_numpy(np.where(used, positions, 0)),
        masked_lm_labels=torch.from_numpy(labels),
        next_sentence_labels=torch.from_numpy(
            arrays["next_sentence_labels"].astype(np.int64).reshape(-1)),
        token_index=torch.from_numpy(token_index), cu_seqlens=torch.from_numpy(cu_seqlens),
        position=position)


class Prefetcher:
    """Runs an iterator in a daemon thread, ``depth`` items ahead; re-raises its errors."""

    _DONE = object()

    def __init__(self, source: Iterable, depth: int = 4, pin_memory: bool = False) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._pin = pin_memory
        self._thread = threading.Thread(target=self._run, args=(iter(source),), daemon=True,
                                        name="bert-prefetch")
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source: Iterator) -> None:
        try:
            for item in source:
                if self._pin:
                    item = item.map(torch.Tensor.pin_memory)
                if not self._put(item):
                    return
            self._put(self._DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

