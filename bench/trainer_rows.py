"""bench/bench_trainer.py's record: the JSON file of rows and profiles (rewritten whole after
each), a row's fields from its timed steps, the ratios to Hugging Face compiled (filled in
as its row lands), and the table's printed lines.

Imported by bench/bench_trainer.py, which puts images/bert/trainer and bench/ on sys.path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from bert_trainer.config import BertConfig
from bert_trainer.data import Batch
from bert_trainer.metrics import peak_tflops
from trainer_workload import real_work


class Results:
    """The JSON file, rewritten whole (temporary name, then rename) after every row."""

    def __init__(self, path: Path | None, header: dict[str, Any], append: bool) -> None:
        self.path, self.data = path, {**header, "rows": [], "profiles": []}
        if append and path is not None and path.is_file():
            kept = json.loads(path.read_text())
            self.data["rows"], self.data["profiles"] = kept["rows"], kept["profiles"]

    def add(self, key: str, item: dict[str, Any]) -> None:
        self.data[key].append(item)
        self.write()

    def write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(self.data, indent=1) + "\n")
            os.replace(partial, self.path)


def same_point(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Rows of the same phase, lengths, micro-batch and accumulation."""
    keys = ("phase", "lengths", "micro_batch", "accumulation")
    return all(one.get(k) == other.get(k) for k in keys)


def hf_compiled_rate(results: Results, row: dict[str, Any]) -> float | None:
    """Hugging Face compiled's sequences/s at ``row``'s point, from this run or one before
    it (--append): the ratio's denominator."""
    return next((r["sequences_per_s"] for r in reversed(results.data["rows"])
                 if r["impl"] == "hf-compiled" and "error" not in r and same_point(r, row)),
                None)


def add_ratios(results: Results, row: dict[str, Any]) -> None:
    """``row``'s ratio to Hugging Face compiled at its point (when that row is in), and a
    length-grouped row's imgpipe ratio to it."""
    hf = hf_compiled_rate(results, row)
    row["ratio_to_hf_compiled"] = round(row["sequences_per_s"] / hf, 3) if hf else None
    ours = next((r["sequences_per_s"] for r in results.data["rows"]
                 if r.get("name", r["impl"]) == "imgpipe" and same_point(r, row)
                 and "error" not in r), None)
    if row["impl"] == "hf-grouped" and ours:
        row["imgpipe_ratio_to_this"] = round(ours / row["sequences_per_s"], 3)


def backfill(results: Results, hf: dict[str, Any]) -> None:
    """The ratio of the rows measured before Hugging Face compiled's row at their point."""
    changed = False
    for row in results.data["rows"]:
        if row["impl"] == "hf-compiled" or "error" in row or not same_point(row, hf):
            continue
        ratio = round(row["sequences_per_s"] / hf["sequences_per_s"], 3)
        if row.get("ratio_to_hf_compiled") != ratio:
            row["ratio_to_hf_compiled"], changed = ratio, True
            print(f"      {row.get('name', row['impl'])} ({row['lengths']}, accumulation "
                  f"{row['accumulation']}): {ratio:.2f}x Hugging Face compiled", flush=True)
    if changed:
        results.write()


def row_of(config: BertConfig, phase: int, impl: str, variant: str, kind: str, shape: dict,
           accumulation: int, seconds: list[float], peak: float | None, batches: list[Batch],
           device: torch.device) -> dict[str, Any]:
    tokens, flops = real_work(config, batches, shape["max_pred"])
    mean = sum(seconds) / len(seconds)
    spread = (sum((s - mean) ** 2 for s in seconds) / len(seconds)) ** 0.5
    sequences = shape["micro_batch"] * accumulation / mean
    tflops = sequences * flops / 1e12
    top = peak_tflops(device, "bf16", None)
    widths = [b.input_ids.shape[1] for b in batches]
    return {"phase": phase, "impl": impl, "variant": variant, "lengths": kind,
            "micro_batch": shape["micro_batch"], "accumulation": accumulation,
            "seq_len": shape["seq_len"], "mean_real_tokens": round(tokens, 1),
            "padded_to": (None if variant.startswith("unpadded")
                          else round(sum(widths) / len(widths), 1)),
            "steps": len(seconds), "step_s": round(mean, 4),
            "step_sd_pct": round(100 * spread / mean, 2) if len(seconds) > 1 else None,
            "sequences_per_s": round(sequences, 1),
            "real_tokens_per_s": round(sequences * tokens, 1),
            "tflops_per_s": round(tflops, 2),
            "mfu": round(tflops / top, 4) if top else None,
            "peak_memory_gib": round(peak, 2) if peak is not None else None}


HEADER = (f"{'phase':>5} {'impl':<14} {'lengths':<9} {'micro':>5} {'acc':>4} {'seq/s':>9} "
          f"{'±step':>6} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6} {'vs hf-c':>7} "
          f"{'warm':>6}")


def print_row(row: dict[str, Any]) -> None:
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
    gib = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
    ratio, sd = row["ratio_to_hf_compiled"], row["step_sd_pct"]
    impl = row.get("name", row["impl"]) + ("*" if row["variant"].startswith("padded") else "")
    print(f"{row['phase']:>5} {impl:<14} {row['lengths']:<9} {row['micro_batch']:>5} "
          f"{row['accumulation']:>4} {row['sequences_per_s']:>9.1f} "
          f"{(f'{sd:.1f}%' if sd is not None else '-'):>6} {row['real_tokens_per_s']:>10.0f} "
          f"{row['tflops_per_s']:>8.1f} {mfu:>6} {gib:>6} "
          f"{(f'{ratio:.2f}x' if ratio else '-'):>7} {row.get('warmup_s', 0):>5.0f}s",
          flush=True)
    if row.get("recompiles_timed"):
        print(f"      {row['recompiles_timed']} graph(s) compiled during the timed steps: "
              "the rate includes compiling", flush=True)
    if row.get("imgpipe_ratio_to_this"):
        print(f"      imgpipe is {row['imgpipe_ratio_to_this']:.2f}x Hugging Face with "
              "length-grouped batches", flush=True)
