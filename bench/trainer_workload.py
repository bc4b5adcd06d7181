"""What bench/bench_trainer.py measures: each phase's micro-batches (generated or real
lengths, padded to the full length or length-grouped), each implementation's optimizer step
over them, and the timer of those steps.

Imported by bench/bench_trainer.py, which puts images/bert/trainer and bench/ on sys.path.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bert_trainer.config import BertConfig
from bert_trainer.data import KEYS, Batch, Position, to_batch
from bert_trainer.model import IGNORE, BertForPreTraining
from bert_trainer.synthetic import instances, real_length_instances
from bert_trainer.trainer import Trainer
from trainer_kernels import OPTIMIZER_RANGE

# Micro-batches for BERT-Large on an 80 GB GPU, and the shipped accumulation on one 8-GPU
# node (global batch 65536 / 8 GPUs / 256; 32768 / 8 / 32).
SHAPES = {1: {"seq_len": 128, "max_pred": 20, "micro_batch": 256, "accumulation": 32},
          2: {"seq_len": 512, "max_pred": 80, "micro_batch": 32, "accumulation": 128}}
TINY_SHAPES = {1: {"seq_len": 32, "max_pred": 5, "micro_batch": 4, "accumulation": 2},
               2: {"seq_len": 64, "max_pred": 10, "micro_batch": 2, "accumulation": 4}}
POOL = 4  # distinct micro-batches per shape, cycled
SEQ_KEYS = ("input_ids", "input_mask", "segment_ids")  # the keys with a sequence axis


def make_arrays(config: BertConfig, shape: dict, phase: int,
                lengths: str) -> dict[str, np.ndarray]:
    """``POOL`` micro-batches' worth of shard rows, of ``generated`` or ``real`` lengths."""
    rng = np.random.default_rng(0)
    count, seq, pred = POOL * shape["micro_batch"], shape["seq_len"], shape["max_pred"]
    made = (real_length_instances(count, seq, pred, config.vocab_size, phase, rng)
            if lengths == "real" else instances(count, seq, pred, config.vocab_size, rng))
    return {key: getattr(made, key) for key in KEYS}


def batches_of(arrays: dict[str, np.ndarray], size: int, device: torch.device,
               grouped: bool = False) -> list[Batch]:
    """Micro-batches of ``size`` rows in order, padded to the full length; ``grouped``: the
    rows sorted by length, longest first, each batch cut to its own longest sequence."""
    lengths = arrays["input_mask"].sum(1)
    order = np.argsort(-lengths, kind="stable") if grouped else np.arange(len(lengths))
    batches = []
    for start in range(0, len(order) - size + 1, size):
        rows = order[start:start + size]
        width = int(lengths[rows].max()) if grouped else arrays["input_ids"].shape[1]
        part = {key: value[rows][:, :width] if key in SEQ_KEYS else value[rows]
                for key, value in arrays.items()}
        batches.append(to_batch([part], Position()).to(device))
    return batches


def real_work(config: BertConfig, batches: list[Batch], max_pred: int) -> tuple[float, float]:
    """Mean real tokens and mean real-token matmul FLOPs per sequence of ``batches``."""
    lengths = torch.cat([b.input_mask.sum(1).cpu() for b in batches]).tolist()
    flops = [config.training_flops_per_sequence(int(n), max_pred) for n in lengths]
    return sum(lengths) / len(lengths), sum(flops) / len(flops)


def imgpipe_step(config: BertConfig, device: torch.device, name: str,
                 compiled: bool) -> Callable[[list[Batch]], None]:
    before, fp8 = name == "imgpipe-before", name == "imgpipe-fp8"
    torch.manual_seed(0)
    model = BertForPreTraining(config, unpadded=not before)
    o2 = not before and (device.type == "cpu" or torch.cuda.is_bf16_supported())
    # float8 emulated on the CPU only (the smoke run); a GPU without float8 is an error row
    trainer = Trainer(model, device, "bf16", 1e-4, 0.1, 10**6, 1, compile_model=compiled,
                      fused_lamb=compiled and not before, o2=o2, fp8=fp8,
                      fp8_emulate=fp8 and device.type == "cpu")

    def step(micro: list[Batch]) -> None:
        trainer.step(micro)

    return step


def hf_step(config: BertConfig, device: torch.device,
            compiled: bool) -> Callable[[list[Batch]], None]:
    # Any: transformers' annotations disagree with its own documented calls
    transformers: Any = importlib.import_module("transformers")
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        attn_implementation="sdpa")
    model = transformers.BertForPreTraining(hf_config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                  fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model

    def step(micro: list[Batch]) -> None:
        for batch in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = forward(input_ids=batch.input_ids, attention_mask=batch.input_mask,
                              token_type_ids=batch.segment_ids, labels=hf_labels(batch),
                              next_sentence_label=batch.next_sentence_labels)
            (out.loss / len(micro)).backward()
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def hf_labels(batch: Batch) -> torch.Tensor:
    """[B, S] labels: the masked slots' ids at their positions, IGNORE elsewhere."""
    # unused slots point at position 0 ([CLS], never masked) and carry IGNORE themselves
    labels = torch.full_like(batch.input_ids, IGNORE)
    return labels.scatter(1, batch.masked_lm_positions, batch.masked_lm_labels)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark(device: torch.device) -> Any:
    """A point in time: a recorded CUDA event (no sync), or the CPU clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def timed(step: Callable[[list[Batch]], None], batches: list[Batch], accumulation: int,
          steps: int, device: torch.device) -> tuple[list[float], float | None]:
    """Seconds of each optimizer step, peak memory (GiB) over those steps."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    marks = [_mark(device)]
    for i in range(steps):
        step([batches[(i * accumulation + j) % len(batches)] for j in range(accumulation)])
        marks.append(_mark(device))
    sync(device)
    seconds = [b - a if isinstance(a, float) else a.elapsed_time(b) / 1000
               for a, b in zip(marks, marks[1:], strict=False)]
    peak = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
            else None)
    return seconds, peak


def whole_passes(steps: int, accumulation: int, pool: int) -> int:
    """``steps`` rounded up so the timed micro-batches are whole passes over the pool (the
    rates count the pool's mean tokens; grouped batches differ in length by design)."""
    while steps * accumulation % pool:
        steps += 1
    return steps


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
