"""The legacy BERT HDF5 shard format, written reproducibly (no timestamps) and atomically.

Datasets are compressed with HDF5's own filters, which every h5py reads without options
(NVIDIA's ``pretraining_dataset`` included): ``gzip`` (the default, as the reference
writes) is the byte-shuffle filter then deflate, on chunks of whole rows of about 1 MiB:
smaller than the reference's unshuffled level-4 deflate on column-shaped chunks.  The
chunks are shuffled here, deflated (zlib, level 1) and handed to HDF5 as written chunks,
without HDF5's per-chunk cache copies; ``lzf`` is HDF5's own filter, faster and larger;
``none`` is plain contiguous data.  (ISA-L deflates faster, but its output for the same
input was seen to differ between processes: files must be byte-identical when re-made.)
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Iterable
from pathlib import Path

import h5py
import numpy as np

from bert_trainer.dataset.instances import Instances

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
        "next_sentence_labels")
DTYPES = {"input_ids": np.int32, "input_mask": np.int8, "segment_ids": np.int8,
          "masked_lm_positions": np.int32, "masked_lm_ids": np.int32,
          "next_sentence_labels": np.int8}
COMPRESSIONS = ("gzip", "lzf", "none")
CHUNK_BYTES = 1 << 20


def chunk_rows(seq_len: int) -> int:
    """Rows per chunk: about CHUNK_BYTES of input_ids, the same count for every dataset."""
    return max(1, CHUNK_BYTES // (4 * seq_len))


DEFLATE_LEVEL = 1


def _filters(compression: str) -> dict:
    if compression == "gzip":
        return {"compression": "gzip", "compression_opts": 1, "shuffle": True}
    if compression == "lzf":
        return {"compression": "lzf", "shuffle": True}
    if compression == "none":
        return {}
    raise ValueError(f"compression {compression!r}: use one of {', '.join(COMPRESSIONS)}")


def write_blocks(path: Path, count: int, seq_len: int, max_pred: int,
                 parts: Iterable[Instances], compression: str = "gzip") -> list[Instances]:
    """Write ``count`` rows arriving in blocks (each a multiple of chunk_rows rows, but the
    last); returns the blocks' statistics with their arrays dropped."""
    widths = {"input_ids": seq_len, "input_mask": seq_len, "segment_ids": seq_len,
              "masked_lm_positions": max_pred, "masked_lm_ids": max_pred,
              "next_sentence_labels": None}
    filters = _filters(compression)
    rows = min(chunk_rows(seq_len), max(count, 1))
    tmp = path.with_name(f".tmp-{path.name}.{socket.gethostname()}.{os.getpid()}")
    seen: list[Instances] = []
    try:
        with h5py.File(tmp, "w", libver="earliest", track_order=False) as out:
            datasets = {}
            for key in KEYS:
                shape = (count,) if widths[key] is None else (count, widths[key])
                chunks = None
                if filters and count:
                    chunks = (rows,) if widths[key] is None else (rows, widths[key])
                # No modification times: the same inputs give byte-identical files.
                datasets[key] = out.create_dataset(key, shape=shape, dtype=DTYPES[key],
                                                   chunks=chunks, track_times=False,
                                                   **(filters if count else {}))
            written = 0
            for part in parts:
                size = len(part.input_ids)
                for key in KEYS:
                    if compression == "gzip" and size:
                        _deflate_chunks(datasets[key], getattr(part, key), written, rows)
                    else:
                        datasets[key][written:written + size] = getattr(part, key)
                written += size
                seen.append(Instances(*(np.zeros((0,)) for _ in KEYS), part.masked_tokens,
                                      part.masked_as_mask, part.masked_as_random,
                                      part.real_tokens))
            if written != count:
                raise RuntimeError(f"{path}: {written} rows written, {count} expected")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return seen


def _deflate_chunks(dataset: h5py.Dataset, block: np.ndarray, first_row: int,
                    rows: int) -> None:
    """Write ``block`` (starting at a chunk boundary) as finished chunks: each padded to the
    chunk shape, byte-shuffled as HDF5's shuffle filter does, deflated (zlib format)."""
    block = np.ascontiguousarray(block, dtype=dataset.dtype)
    width = block.itemsize
    for start in range(0, len(block), rows):
        chunk = block[start:start + rows]
        if len(chunk) < rows:
            padded = np.zeros((rows,) + block.shape[1:], block.dtype)
            padded[:len(chunk)] = chunk
            chunk = padded
        raw = chunk.view(np.uint8).reshape(-1, width)
        data = np.ascontiguousarray(raw.T).tobytes() if width > 1 else raw.tobytes()
        offset = (first_row + start,) + (0,) * (block.ndim - 1)
        dataset.id.write_direct_chunk(offset, zlib.compress(data, DEFLATE_LEVEL))


def write(instances: Instances, path: Path, compression: str = "none") -> None:
    """All rows at once (generated data, tests)."""
    n, s = instances.input_ids.shape
    write_blocks(path, n, s, instances.masked_lm_positions.shape[1], [instances], compression)


def read(path: Path) -> dict:
    with h5py.File(path, "r") as handle:
        return {key: handle[key][()] for key in KEYS}
