"""BERT-Large pre-training throughput: imgpipe against Hugging Face, same run, same batches.

Per phase (1: 128 tokens, 20 predictions, micro-batch 256; 2: 512, 80, 32), per kind of
lengths, per implementation, the same micro-batches already on the device:

- imgpipe: the trainer's real step (``bert_trainer.trainer.Trainer``: LAMB, schedule,
  loss), bf16, torch.compile, unpadded encoder, O2 (bf16 weights, fp32 masters), fused
  LAMB; ``imgpipe-before`` (rows: impl imgpipe, variant padded,...) the padded, autocast,
  unfused configuration it replaced;
- hf-eager / hf-compiled: ``transformers.BertForPreTraining`` (attn_implementation="sdpa",
  bf16 autocast, fused AdamW, gradient clipping at 1.0 as its Trainer does), eager and
  under torch.compile, labels at the masked slots, every batch padded to the full length
  (variant ``padded,...``: the shipped recipes' HDF5 shards come so);
- hf-grouped: the same, compiled, as a careful user would run it: the same sequences in
  length-grouped batches (sorted by length, as transformers' ``group_by_length`` sorts a
  mega-batch), each padded only to its own longest sequence (variant ``grouped,...``).

Lengths: ``generated`` (bert_trainer.synthetic: 10% short rows) and ``real``, the length
model of ``bert_trainer.synthetic.real_length_instances`` (shaped to published Wikipedia
statistics, not a corpus): phase 2 a mean of 254 real tokens of 512, scaled with --tiny;
phase 1 the reference recipe's short-sequence rule.  The lengths sit at evenly spaced
quantiles of the model, so phase 2's 128 sequences carry its mean; the run prints the mean
and how far a random draw of as many would move it (1 sd), and with it the absolute figure
of a step whose work follows the real tokens (every implementation runs the same ones).

Rates count real (non-padding) tokens: sequences/s, real tokens/s, and TFLOP/s and MFU from
the matmul FLOPs of the real tokens alone (``BertConfig.training_flops_per_sequence`` at each
sequence's length), so padding a model computes earns it nothing.  Rows at accumulation 1
and at the shipped configs' accumulation on one 8-GPU node (phase 1: 32 micro-batches,
phase 2: 128) go to ``--out`` as they come.  Every micro-batch runs once before the timing
(each shape compiled); each row times whole passes over them and records the step-to-step
spread (``step_sd_pct``).  ``--profile FILE`` adds, per phase and implementation, a
kernel-time summary (matmul / elementwise / optimizer / attention / other;
bench/trainer_kernels.py).  Without a GPU it says it skipped, unless ``--tiny``
asks for a small CPU run that checks the script itself (Hugging Face rows are left out,
with a line saying so, where transformers is not installed).

    python bench/bench_trainer.py [--phases 1,2] [--steps 10] [--deadline 420]
    python bench/bench_trainer.py --tiny --out /tmp/trainer-cpu.json      # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "images" / "bert" / "trainer"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bert_trainer.config import TINY, BertConfig  # noqa: E402
from bert_trainer.data import KEYS, Batch, Position, to_batch  # noqa: E402
from bert_trainer.metrics import peak_tflops  # noqa: E402
from bert_trainer.model import IGNORE, BertForPreTraining  # noqa: E402
from bert_trainer.synthetic import (  # noqa: E402
    instances,
    length_model,
    real_length_instances,
)
from bert_trainer.trainer import Trainer  # noqa: E402
from trainer_kernels import OPTIMIZER_RANGE, profile_steps  # noqa: E402

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


def imgpipe_step(config: BertConfig, device: torch.device, before: bool,
                 compiled: bool) -> Callable[[list[Batch]], None]:
    torch.manual_seed(0)
    model = BertForPreTraining(config, unpadded=not before)
    o2 = not before and (device.type == "cpu" or torch.cuda.is_bf16_supported())
    trainer = Trainer(model, device, "bf16", 1e-4, 0.1, 10**6, 1, compile_model=compiled,
                      fused_lamb=compiled and not before, o2=o2)

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


class Results:
    """The JSON file, rewritten whole (temporary name, then rename) after every row."""

    def __init__(self, path: Path | None, header: dict[str, Any], append: bool) -> None:
        self.path, self.data = path, {**header, "rows": [], "profiles": []}
        if append and path is not None and path.is_file():
            kept = json.loads(path.read_text())
            self.data["rows"], self.data["profiles"] = kept["rows"], kept["profiles"]

    def add(self, key: str, item: dict[str, Any]) -> None:
        self.data[key].append(item)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(self.data, indent=1) + "\n")
            os.replace(partial, self.path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--phases", default="1,2")
    parser.add_argument("--lengths", default="generated,real")
    parser.add_argument("--impls", default="imgpipe,hf-eager,hf-compiled,hf-grouped",
                        help="of imgpipe, imgpipe-before (padded, autocast, unfused LAMB: "
                        "what imgpipe replaced), hf-eager, hf-compiled (both padded to the "
                        "full length), hf-grouped (compiled, length-grouped batches padded "
                        "to their longest)")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in --out and --profile, add to them")
    parser.add_argument("--accumulation", default="1,shipped",
                        help="accumulation counts: numbers, or 'shipped' (32 / 128)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps at accumulation 1")
    parser.add_argument("--shipped-steps", type=int, default=2,
                        help="timed steps at a larger accumulation")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds: start no new measurement after this")
    parser.add_argument("--tiny", "--cpu", dest="tiny", action="store_true",
                        help="a tiny BERT on the CPU: checks the script, measures nothing real")
    parser.add_argument("--out", type=Path, default=None,
                        help="rows as they come (default bench/results/trainer-gpu.json on "
                        "a GPU, nothing with --tiny)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="kernel-share summaries, per phase and implementation")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    if not gpu and not args.tiny:
        print("bench_trainer: no GPU here: skipped (--tiny runs a CPU smoke test)")
        return 0
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    config = (BertConfig(**{**TINY.__dict__, "max_position_embeddings": 128}) if args.tiny
              else BertConfig())
    shapes = TINY_SHAPES if args.tiny else SHAPES
    impls = args.impls.split(",")
    unknown = set(impls) - {"imgpipe", "imgpipe-before", "hf-eager", "hf-compiled",
                            "hf-grouped"}
    if unknown:
        print(f"bench_trainer: unknown --impls {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    try:
        import transformers
        hf_version: str | None = transformers.__version__
    except ImportError:
        hf_version = None
        print("transformers is not installed: the Hugging Face rows are skipped")
        impls = [i for i in impls if not i.startswith("hf")]
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    out = args.out or (ROOT / "bench" / "results" / "trainer-gpu.json" if gpu else None)
    results = Results(out, {"device": name, "torch": torch.__version__,
                            "transformers": hf_version,
                            "model": "tiny" if args.tiny else "BERT-Large",
                            "precision": "bf16"}, args.append)
    profiles = Results(args.profile, {"device": name, "torch": torch.__version__},
                       args.append)
    print(f"device: {name}; model: {results.data['model']}; torch {torch.__version__}; "
          f"transformers {hf_version}")
    print("* padded to the full length; hf-grouped: length-grouped batches, each padded to "
          "its longest; ±step: step-to-step sd")
    print(HEADER, flush=True)
    started = time.perf_counter()
    for phase in (int(p) for p in args.phases.split(",")):
        shape = dict(shapes[phase])
        if args.micro_batch:
            shape["micro_batch"] = args.micro_batch
        run_phase(args, phase, shape, impls, config, device, results, profiles, started)
    if out is not None:
        print(f"rows: {out}")
    return 0


def run_phase(args: argparse.Namespace, phase: int, shape: dict, impls: list[str],
              config: BertConfig, device: torch.device, results: Results, profiles: Results,
              started: float) -> None:
    accumulations = [shape["accumulation"] if a == "shipped" else int(a)
                     for a in args.accumulation.split(",")]
    made = {kind: make_arrays(config, shape, phase, kind) for kind in args.lengths.split(",")}
    data = {kind: {"padded": batches_of(arrays, shape["micro_batch"], device)}
            for kind, arrays in made.items()}
    spread: dict[str, float | None] = {}
    for kind, arrays in made.items():
        if "hf-grouped" in impls:
            data[kind]["grouped"] = batches_of(arrays, shape["micro_batch"], device, True)
        spread[kind] = describe_lengths(phase, kind, shape, data[kind], config)
    # Hugging Face compiled first (the ratio's denominator), then imgpipe: what matters most
    # is measured before a deadline can stop the run.
    order = ["hf-compiled", "imgpipe", "hf-grouped", "imgpipe-before", "hf-eager"]
    measured: dict[tuple[str, str, int], float] = {}
    for name in sorted(impls, key=order.index):
        if args.deadline and time.perf_counter() - started > args.deadline:
            print(f"deadline reached: phase {phase} {name} not measured", flush=True)
            return
        try:
            measure(args, phase, name, shape, data, spread, accumulations, config, device,
                    results, profiles, measured)
        except Exception as exc:  # one lease, many rows: a failure costs only its own
            traceback.print_exc()
            results.add("rows", {"phase": phase, "impl": name.removesuffix("-before"),
                                 "before": name.endswith("-before"),
                                 "error": f"{type(exc).__name__}: {exc}"[:2000]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()  # each model compiles afresh; bounded cache growth


def describe_lengths(phase: int, kind: str, shape: dict, batches: dict[str, list[Batch]],
                     config: BertConfig) -> float | None:
    """Print the lengths' mean (and the model's, with the spread a random draw of as many
    sequences would give it); that spread in percent, for real lengths."""
    mean, _ = real_work(config, batches["padded"], shape["max_pred"])
    line = f"phase {phase}, {kind} lengths: mean {mean:.1f} real tokens of {shape['seq_len']}"
    spread = None
    if kind == "real":
        model, sd = length_model(shape["seq_len"], phase)
        count = POOL * shape["micro_batch"]
        spread = 100 * sd / model / count**0.5
        line += (f" (the model's mean {model:.1f}; a random {count} would move it by "
                 f"±{spread:.1f}% (1 sd), and with it the absolute figure of any step whose "
                 "work follows the real tokens; every implementation runs these same ones)")
    if "grouped" in batches:
        widths = [b.input_ids.shape[1] for b in batches["grouped"]]
        line += f"; grouped batches padded to {sum(widths) / len(widths):.0f} on average"
    print(line, flush=True)
    return spread


def measure(args: argparse.Namespace, phase: int, name: str, shape: dict,
            data: dict[str, dict[str, list[Batch]]], spread: dict[str, float | None],
            accumulations: list[int], config: BertConfig, device: torch.device,
            results: Results, profiles: Results,
            measured: dict[tuple[str, str, int], float]) -> None:
    """One implementation's rows (each kind of lengths, each accumulation) and profile."""
    impl, before = name.removesuffix("-before"), name.endswith("-before")
    compiled = device.type == "cuda" and impl != "hf-eager"
    step = (imgpipe_step(config, device, before, compiled) if impl == "imgpipe"
            else hf_step(config, device, compiled))
    variant = {"imgpipe": "unpadded,o2,fused-lamb", "imgpipe-before":
               "padded,autocast,foreach-lamb", "hf-grouped": "grouped,sdpa,autocast,fused-adamw"
               }.get(name, "padded,sdpa,autocast,fused-adamw")
    for kind, both in data.items():
        batches = both["grouped" if impl == "hf-grouped" else "padded"]
        for i in range(max(args.warmup, len(batches))):  # compiles every shape; allocator
            step([batches[i % len(batches)]])
        for accumulation in accumulations:
            steps = whole_passes(args.steps if accumulation == 1 else args.shipped_steps,
                                 accumulation, len(batches))
            seconds, peak = timed(step, batches, accumulation, steps, device)
            row = row_of(config, phase, impl, variant, kind, shape, accumulation, seconds,
                         peak, batches, device)
            sample = spread[kind]
            row["sample_spread_pct"] = round(sample, 2) if sample is not None else None
            measured[(name, kind, accumulation)] = row["sequences_per_s"]
            hf = measured.get(("hf-compiled", kind, accumulation))
            row["ratio_to_hf_compiled"] = (round(row["sequences_per_s"] / hf, 3)
                                           if hf else None)
            ours = measured.get(("imgpipe", kind, accumulation))
            if impl == "hf-grouped" and ours:
                row["imgpipe_ratio_to_this"] = round(ours / row["sequences_per_s"], 3)
            results.add("rows", row)
            print_row(row)
        if args.profile is not None and kind == next(iter(data)):
            summary = profile_steps(functools.partial(step, [batches[0]]), 2,
                                    device.type == "cuda")
            profiles.add("profiles", {"phase": phase, "impl": impl, "variant": variant,
                                      "lengths": kind, "micro_batch": shape["micro_batch"],
                                      **summary})
            shares = ", ".join(f"{k} {v['share']:.0%}" for k, v in summary["shares"].items())
            print(f"      profile {impl} ({variant}): {summary['ms_per_step']} ms/step: "
                  f"{shares}", flush=True)


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


HEADER = (f"{'phase':>5} {'impl':<12} {'lengths':<9} {'micro':>5} {'acc':>4} {'seq/s':>9} "
          f"{'±step':>6} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6} {'vs hf-c':>7}")


def print_row(row: dict[str, Any]) -> None:
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
    gib = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
    ratio, sd = row["ratio_to_hf_compiled"], row["step_sd_pct"]
    impl = row["impl"] + ("*" if row["variant"].startswith("padded") else "")
    print(f"{row['phase']:>5} {impl:<12} {row['lengths']:<9} {row['micro_batch']:>5} "
          f"{row['accumulation']:>4} {row['sequences_per_s']:>9.1f} "
          f"{(f'{sd:.1f}%' if sd is not None else '-'):>6} {row['real_tokens_per_s']:>10.0f} "
          f"{row['tflops_per_s']:>8.1f} {mfu:>6} {gib:>6} "
          f"{(f'{ratio:.2f}x' if ratio else '-'):>7}", flush=True)
    if row.get("imgpipe_ratio_to_this"):
        print(f"      imgpipe is {row['imgpipe_ratio_to_this']:.2f}x Hugging Face with "
              "length-grouped batches", flush=True)


if __name__ == "__main__":
    sys.exit(main())
