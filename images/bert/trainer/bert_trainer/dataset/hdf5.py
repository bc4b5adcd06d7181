"""The legacy BERT HDF5 shard format, written reproducibly (no timestamps) and atomically."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import h5py

from bert_trainer.dataset.instances import Instances

KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
        "next_sentence_labels")


def write(instances: Instances, path: Path) -> None:
    tmp = path.with_name(f".tmp-{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        with h5py.File(tmp, "w", libver="earliest", track_order=False) as out:
            for key in KEYS:
                # No modification times: the same inputs give byte-identical files.
                out.create_dataset(key, data=getattr(instances, key), track_times=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read(path: Path) -> dict:
    with h5py.File(path, "r") as handle:
        return {key: handle[key][()] for key in KEYS}
