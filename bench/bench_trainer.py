"""BERT-Large pre-training throughput (sequences/s, MFU) at the phase 1 and phase 2 shapes.

Runs the trainer's real optimizer step (``bert_trainer.trainer.Trainer``: LAMB,
schedule, loss, accumulation) on generated batches already on the GPU, so the
number is the model's speed, not the file system's.  Two configurations side by
side, same model, same batch:

- baseline: fp32 with TF32 off, eager (what a plain PyTorch port does);
- imgpipe:  bf16 autocast (fp16 with loss scaling on GPUs without bf16),
            torch.compile, SDPA flash/memory-efficient attention.

Goal on one H100 in bf16: >= 1300 sequences/s at phase 1 (about 40% MFU) and
>= 300 at phase 2.  Without a GPU it prints that it skipped, unless --tiny asks
for a small CPU run that checks the script itself.

    .venv/bin/python bench/bench_trainer.py [--phases 1,2] [--steps 20] [--json OUT]
    .venv/bin/python bench/bench_trainer.py --tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bert_trainer.config import TINY, BertConfig
from bert_trainer.data import KEYS, Position, to_batch
from bert_trainer.metrics import peak_tflops
from bert_trainer.model import BertForPreTraining
from bert_trainer.synthetic import instances
from bert_trainer.trainer import Trainer, default_precision

# Micro-batches for BERT-Large on an 80 GB GPU (the scaling table's 80 GB row).
SHAPES = {1: {"seq_len": 128, "max_pred": 20, "micro_batch": 256},
          2: {"seq_len": 512, "max_pred": 80, "micro_batch": 32}}


def batches(config: BertConfig, count: int, size: int, seq_len: int, max_pred: int,
            device: torch.device) -> list:
    made = instances(count * size, seq_len, max_pred, config.vocab_size,
                     np.random.default_rng(0))
    arrays = {key: getattr(made, key) for key in KEYS}
    return [to_batch([{k: v[i * size:(i + 1) * size] for k, v in arrays.items()}],
                     Position()).to(device) for i in range(count)]


def measure(config: BertConfig, device: torch.device, precision: str, tf32: bool,
            compile_model: bool, shape: dict, steps: int, warmup: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    trainer = Trainer(BertForPreTraining(config), device, precision, 1e-3, 0.1,
                      steps + warmup, 1, compile_model=compile_model)
    data = batches(config, 4, shape["micro_batch"], shape["seq_len"], shape["max_pred"], device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(warmup):  # compilation and allocator warm-up
        trainer.step([data[i % len(data)]])
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for i in range(steps):
        stats = trainer.step([data[i % len(data)]])
    loss = float(stats.loss)  # synchronizes
    sync()
    seconds = time.perf_counter() - started
    sequences = steps * shape["micro_batch"] / seconds
    flops = config.training_flops_per_sequence(shape["seq_len"], shape["max_pred"])
    peak = peak_tflops(device, precision, None)
    result = {"precision": precision, "compile": compile_model,
              "micro_batch": shape["micro_batch"], "sequences_per_s": round(sequences, 1),
              "tflops_per_s": round(sequences * flops / 1e12, 1),
              "mfu": round(sequences * flops / 1e12 / peak, 3) if peak else None,
              "loss": round(loss, 3)}
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    del trainer, data
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="1,2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="override the per-phase micro-batch (e.g. for a smaller GPU)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny BERT on the CPU: checks the script, measures nothing real")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.tiny:
        print("bench_trainer: no GPU here: skipped (--tiny runs a CPU smoke test)")
        return 0
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny \
        else torch.device("cpu")
    config = BertConfig(**{**json.loads(TINY.to_json()), "max_position_embeddings": 512}) \
        if args.tiny else BertConfig()
    fast = default_precision(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; model: {'tiny' if args.tiny else 'BERT-Large'}; "
          f"torch {torch.__version__}")
    print(f"{'phase':>5} {'config':<22} {'micro':>5} {'seq/s':>9} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'ratio':>6}")
    results = []
    for phase in (int(p) for p in args.phases.split(",")):
        shape = dict(SHAPES[phase])
        if args.micro_batch or args.tiny:
            shape["micro_batch"] = args.micro_batch or 8
        runs = []
        if not args.no_baseline:
            runs.append(("baseline fp32 eager", "fp32", False, False))
        compiled = device.type == "cuda"
        runs.append((f"imgpipe {fast}{' compiled' if compiled else ''}", fast, True, compiled))
        base = None
        for label, precision, tf32, compile_model in runs:
            out = measure(config, device, precision, tf32, compile_model, shape, args.steps,
                          args.warmup)
            base = base or out["sequences_per_s"]
            ratio = out["sequences_per_s"] / base
            mfu = f"{out['mfu']:.1%}" if out["mfu"] is not None else "-"
            print(f"{phase:>5} {label:<22} {shape['micro_batch']:>5} "
                  f"{out['sequences_per_s']:>9.1f} {out['tflops_per_s']:>8.1f} {mfu:>6} "
                  f"{ratio:>5.2f}x", flush=True)
            results.append({"phase": phase, "label": label, **out, "ratio": round(ratio, 3)})
    if args.json:
        args.json.write_text(json.dumps({"device": name, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
