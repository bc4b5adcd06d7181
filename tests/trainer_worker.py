"""One rank of the DDP-equivalence check:
``python -m tests.trainer_worker OUT STEPS ACCUM [compile]``.

Every rank builds the same tiny BERT, takes its slice of the same global batch
of 8 sequences per step, splits it into ACCUM micro-batches and runs the real
Trainer (DDP over gloo when WORLD_SIZE > 1).  Rank 0 writes the final weights
and the per-step gradient norms and losses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from bert_trainer.config import TINY
from bert_trainer.data import KEYS, Position, to_batch
from bert_trainer.model import BertForPreTraining
from bert_trainer.synthetic import instances
from bert_trainer.trainer import Trainer

GLOBAL_BATCH, SEQ, PRED = 8, 32, 5


def global_batches(steps: int) -> list[dict[str, np.ndarray]]:
    made = instances(steps * GLOBAL_BATCH * 2, SEQ, PRED, TINY.vocab_size,
                     np.random.default_rng(3))
    full = made.input_mask.all(axis=1)  # full-length rows: equal prediction counts
    arrays = {key: getattr(made, key)[full] for key in KEYS}
    return [{k: v[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for k, v in arrays.items()}
            for i in range(steps)]


def main(out: str, steps: int, accumulation: int, compile_model: bool) -> int:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method="env://")
    torch.manual_seed(0)
    trainer = Trainer(BertForPreTraining(TINY), torch.device("cpu"), "fp32", 1e-2, 0.25, steps,
                      accumulation, distributed=world > 1, compile_model=compile_model)
    per_rank = GLOBAL_BATCH // world
    micro = per_rank // accumulation
    norms, losses = [], []
    for batch in global_batches(steps):
        mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
        micro_batches = [to_batch([{k: v[i * micro:(i + 1) * micro] for k, v in mine.items()}],
                                  Position()) for i in range(accumulation)]
        stats = trainer.step(micro_batches)
        norms.append(float(trainer.optimizer.last_grad_norm))
        losses.append(float(stats.loss))
    if rank == 0:
        torch.save(trainer.model.state_dict(), Path(out) / "weights.pt")
        (Path(out) / "steps.json").write_text(json.dumps({"grad_norms": norms,
                                                          "losses": losses}))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                  sys.argv[4:] == ["compile"]))
