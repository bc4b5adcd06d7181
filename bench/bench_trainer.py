"""BERT-Large pre-training throughput: imgpipe against Hugging Face, same run, same batches.

Per phase (1: 128 tokens, 20 predictions, micro-batch 256; 2: 512, 80, 32), per kind of
lengths, per implementation, the same micro-batches already on the device:

- imgpipe: the trainer's real step (``bert_trainer.trainer.Trainer``: LAMB, schedule,
  loss), bf16, torch.compile, unpadded encoder, O2 (bf16 weights, fp32 masters), fused
  LAMB; ``imgpipe-before`` (rows: impl imgpipe, variant padded,...) the padded, autocast,
  unfused configuration it replaced; ``imgpipe-fp8`` (impl imgpipe, variant ...,fp8) the
  same with ``--fp8``: torchao's float8 matmuls in the encoder (H100/H200; on the CPU
  torchao's emulation, variant ...,fp8-emulated, which checks the script only);
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
phase 2: 128) go to ``--out`` as they come, each written the moment it is measured (a
failure leaves an ``error`` row and the rows before it; SIGTERM, a stage's ``timeout``,
leaves a ``stopped`` row saying what was under way).  Every micro-batch runs once before the
timing (each shape compiled); each row records those warm-up seconds, compiling included
(``warmup_s``), the graphs dynamo compiled then and during the timing (``graphs_compiled``,
``recompiles_timed``: 0 unless a shape recompiled), times whole passes over the
micro-batches and records the step-to-step spread (``step_sd_pct``).  imgpipe runs first, so
a stage that runs out of time keeps its rows; ``ratio_to_hf_compiled`` is filled in when
Hugging Face's row lands (in this run or one before it, with ``--append``).
``--profile FILE`` adds, per phase and implementation, a kernel-time summary (matmul /
elementwise / optimizer / attention / other; bench/trainer_kernels.py).  Without a GPU it
says it skipped, unless ``--tiny`` asks for a small CPU run that checks the script itself
(``--compile`` compiles there too; Hugging Face rows are left out, with a line saying so,
where transformers is not installed).

    python bench/bench_trainer.py [--phases 1,2] [--steps 10] [--deadline 420]
    python bench/bench_trainer.py --tiny --out /tmp/trainer-cpu.json      # CPU smoke run
    python bench/bench_trainer.py --tiny --compile --impls imgpipe,imgpipe-fp8  # CPU, compiled
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "images" / "bert" / "trainer"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bert_trainer.config import TINY, BertConfig  # noqa: E402
from bert_trainer.data import Batch  # noqa: E402
from bert_trainer.synthetic import length_model  # noqa: E402
from trainer_kernels import profile_steps  # noqa: E402
from trainer_rows import HEADER, Results, add_ratios, backfill, print_row, row_of  # noqa: E402
from trainer_workload import (  # noqa: E402
    POOL,
    SHAPES,
    TINY_SHAPES,
    allocated,
    batches_of,
    compiled_graphs,
    hf_step,
    imgpipe_step,
    make_arrays,
    real_work,
    sync,
    timed,
    whole_passes,
)

# What --impls takes, in the order a run measures them: imgpipe first (a stage's timeout
# then costs Hugging Face's rows, not ours), Hugging Face compiled (every ratio's
# denominator) next.
IMPLS = ("imgpipe", "hf-compiled", "hf-grouped", "imgpipe-fp8", "imgpipe-before", "hf-eager")
VARIANTS = {"imgpipe": "unpadded,o2,fused-lamb", "imgpipe-fp8": "unpadded,o2,fused-lamb,fp8",
            "imgpipe-before": "padded,autocast,foreach-lamb",
            "hf-grouped": "grouped,sdpa,autocast,fused-adamw",
            "hf-compiled": "padded,sdpa,autocast,fused-adamw",
            "hf-eager": "padded,sdpa,autocast,fused-adamw"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--phases", default="1,2")
    parser.add_argument("--lengths", default="generated,real")
    parser.add_argument("--impls", default="imgpipe,hf-eager,hf-compiled,hf-grouped",
                        help="of imgpipe, imgpipe-before (padded, autocast, unfused LAMB: "
                        "what imgpipe replaced), imgpipe-fp8 (imgpipe with --fp8: torchao's "
                        "float8 matmuls in the encoder), hf-eager, hf-compiled (both padded "
                        "to the full length), hf-grouped (compiled, length-grouped batches "
                        "padded to their longest)")
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
                        help="seconds: start no new implementation, warm-up, timing or "
                        "profile after this")
    parser.add_argument("--tiny", "--cpu", dest="tiny", action="store_true",
                        help="a tiny BERT (on the CPU unless --device says otherwise): checks "
                        "the script, measures nothing real")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: the GPU, or the CPU with --tiny")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile every implementation but hf-eager (default: on a "
                        "GPU, off on the CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="rows as they come (default bench/results/trainer-gpu.json on "
                        "a GPU, nothing with --tiny)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="kernel-share summaries, per phase and implementation")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = args.device if args.device != "auto" else ("cpu" if args.tiny else "cuda")
    if wanted == "cuda" and not torch.cuda.is_available():
        print("bench_trainer: no GPU here: skipped (--tiny runs a CPU smoke test)")
        return 0
    gpu = wanted == "cuda"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if args.compile is None:
        args.compile = gpu
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    config = (BertConfig(**{**TINY.__dict__, "max_position_embeddings": 128}) if args.tiny
              else BertConfig())
    shapes = TINY_SHAPES if args.tiny else SHAPES
    impls = args.impls.split(",")
    unknown = set(impls) - set(IMPLS)
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
          f"transformers {hf_version}; compile {'on' if args.compile else 'off'}")
    print("* padded to the full length; hf-grouped: length-grouped batches, each padded to "
          "its longest; ±step: step-to-step sd; warm: warm-up seconds, compiling included")
    print(HEADER, flush=True)
    started = time.perf_counter()
    doing = Doing()

    def stop(number: int, _frame: object) -> None:
        """SIGTERM (a stage's timeout): the rows so far are on disk; a row says what the stop
        cut short, and the process ends here.  Not an exception: raised inside a compile it
        can land in a callback that swallows it (a weakref's), and the compile goes on."""
        seconds = round(time.perf_counter() - started, 1)
        name = signal.Signals(number).name
        print(f"bench_trainer: {name} after {seconds} s, during {doing.what or 'setup'}",
              flush=True)
        if doing.row is not None:
            results.add("rows", {**doing.row, "error": f"stopped by {name} after {seconds} s "
                                 f"of this run, during {doing.what}"})
        sys.stdout.flush()
        os._exit(124)

    signal.signal(signal.SIGTERM, stop)
    for phase in (int(p) for p in args.phases.split(",")):
        shape = dict(shapes[phase])
        if args.micro_batch:
            shape["micro_batch"] = args.micro_batch
        run_phase(args, phase, shape, impls, config, device, results, profiles, started, doing)
    if out is not None:
        print(f"rows: {out}")
    return 0


class Doing:
    """What the run is doing now: said (and kept as a row) when SIGTERM stops it."""

    def __init__(self) -> None:
        self.what: str | None = None
        self.row: dict[str, Any] | None = None

    def now(self, what: str, row: dict[str, Any] | None = None, say: bool = False) -> None:
        self.what, self.row = what, row
        if say:
            print(f"      {what}", flush=True)


def past(args: argparse.Namespace, started: float, what: str) -> bool:
    """True (and a line saying what is left out) once ``--deadline`` has passed."""
    if args.deadline and time.perf_counter() - started > args.deadline:
        print(f"deadline reached: {what} not measured", flush=True)
        return True
    return False


def run_phase(args: argparse.Namespace, phase: int, shape: dict, impls: list[str],
              config: BertConfig, device: torch.device, results: Results, profiles: Results,
              started: float, doing: Doing) -> None:
    """Every implementation's accumulation-1 rows (and profile), then, with the compiled
    steps kept, every implementation's rows at the larger accumulations: a stage that runs
    out of time loses those first, and none of them compiles anything again."""
    accumulations = [shape["accumulation"] if a == "shipped" else int(a)
                     for a in args.accumulation.split(",")]
    first, later = [a for a in accumulations if a == 1], [a for a in accumulations if a != 1]
    made = {kind: make_arrays(config, shape, phase, kind) for kind in args.lengths.split(",")}
    data = {kind: {"padded": batches_of(arrays, shape["micro_batch"], device)}
            for kind, arrays in made.items()}
    spread: dict[str, float | None] = {}
    for kind, arrays in made.items():
        if "hf-grouped" in impls:
            data[kind]["grouped"] = batches_of(arrays, shape["micro_batch"], device, True)
        spread[kind] = describe_lengths(phase, kind, shape, data[kind], config)
    context = Context(args, phase, shape, data, spread, config, device, results, profiles,
                      started, doing)
    kept: list[Measured] = []
    for name in sorted(impls, key=IMPLS.index):
        if past(args, started, f"phase {phase} {name}"):
            break
        with failure_row(context, name):
            kept.append(warm_and_time(context, name, first))
    for measured in kept:
        with failure_row(context, measured.name):
            time_rows(context, measured, later)
    del kept  # the models, before the next phase builds its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(Exception):
        torch._dynamo.reset()  # the next phase compiles afresh; bounded cache growth


@contextlib.contextmanager
def failure_row(context: Context, name: str) -> Iterator[None]:
    """An exception in ``name``'s measurement becomes its ``error`` row; the run goes on
    (one lease, many rows: a failure costs only its own)."""
    try:
        yield
    except Exception as exc:
        traceback.print_exc()
        context.results.add("rows", {
            "phase": context.phase, "name": name,
            "impl": "imgpipe" if name.startswith("imgpipe") else name,
            "before": name.endswith("-before"),
            "error": f"{type(exc).__name__}: {exc}"[:2000]})


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


class Context(NamedTuple):
    """What every measurement of a phase shares."""

    args: argparse.Namespace
    phase: int
    shape: dict
    data: dict[str, dict[str, list[Batch]]]
    spread: dict[str, float | None]
    config: BertConfig
    device: torch.device
    results: Results
    profiles: Results
    started: float
    doing: Doing


class Measured:
    """One implementation, built and warmed up: its step, kept for the later rows.  (Not a
    dataclass: the tests load this file by path, as no module dataclasses can find.)"""

    def __init__(self, name: str, impl: str, variant: str,
                 step: Callable[[list[Batch]], None]) -> None:
        self.name, self.impl, self.variant, self.step = name, impl, variant, step
        self.warm: dict[str, dict[str, Any]] = {}  # per kind of lengths
        self.resident = 0  # bytes it keeps on the GPU between steps (weights, optimizer state)


def warm_and_time(context: Context, name: str, accumulations: list[int]) -> Measured:
    """Build ``name``'s step, warm it up on each kind of lengths (compiling every shape) and
    time its rows at ``accumulations``; the profile after the first kind's rows."""
    args, phase, device, doing = context.args, context.phase, context.device, context.doing
    impl = "imgpipe" if name.startswith("imgpipe") else name
    compiled = args.compile and impl != "hf-eager"
    variant = VARIANTS[name] + ("-emulated" if name == "imgpipe-fp8" and device.type == "cpu"
                                else "")
    base = {"phase": phase, "name": name, "impl": impl, "variant": variant}
    doing.now(f"phase {phase} {name}: building", base)
    before = allocated(device)
    step = (imgpipe_step(context.config, device, name, compiled) if impl == "imgpipe"
            else hf_step(context.config, device, compiled))
    measured = Measured(name, impl, variant, step)
    for kind, both in context.data.items():
        batches = both["grouped" if impl == "hf-grouped" else "padded"]
        if past(args, context.started, f"phase {phase} {name} {kind} lengths"):
            break
        doing.now(f"phase {phase} {name} {kind} lengths: warm-up"
                  + (" (compiling)" if compiled else ""),
                  {**base, "lengths": kind}, say=True)
        graphs, warm_start = compiled_graphs(), time.perf_counter()
        for i in range(max(args.warmup, len(batches))):  # compiles every shape; allocator
            step([batches[i % len(batches)]])
        sync(device)
        measured.warm[kind] = {"warmup_s": round(time.perf_counter() - warm_start, 1),
                               "graphs_compiled": compiled_graphs() - graphs}
        measured.resident = allocated(device) - before
        time_rows(context, measured, accumulations, [kind], warmed_now=True)
        if args.profile is not None and kind == next(iter(context.data)):
            if past(args, context.started, f"phase {phase} {name} profile"):
                break
            doing.now(f"phase {phase} {name}: profile")
            try:  # a profiler failure costs the profile, not the rows or what follows
                profile(step, batches[0], phase, impl, variant, kind, context.shape, device,
                        context.profiles)
            except Exception:
                traceback.print_exc()
                print(f"      profile {name}: failed (above); the rows stand", flush=True)
    return measured


def time_rows(context: Context, measured: Measured, accumulations: list[int],
              kinds: list[str] | None = None, warmed_now: bool = False) -> None:
    """``measured``'s rows at ``accumulations`` for each warmed-up kind of lengths (or
    ``kinds``), each written as it is measured.  Peak memory counts this implementation's
    own: what the others kept resident is taken off.  ``warmed_now``: the warm-up (the
    compile) has just run, so the first row is timed even past the deadline (seconds of
    steps; the compile it follows took minutes)."""
    args, phase, device, results = context.args, context.phase, context.device, context.results
    name, impl, variant = measured.name, measured.impl, measured.variant
    for kind in kinds or list(measured.warm):
        if not accumulations:
            return
        batches = context.data[kind]["grouped" if impl == "hf-grouped" else "padded"]
        for accumulation in accumulations:
            exempt = warmed_now and accumulation == accumulations[0]
            if not exempt and past(args, context.started,
                                   f"phase {phase} {name} {kind} accumulation {accumulation}"):
                return
            context.doing.now(f"phase {phase} {name} {kind} lengths, accumulation "
                              f"{accumulation}: timing",
                              {"phase": phase, "name": name, "impl": impl, "variant": variant,
                               "lengths": kind, "accumulation": accumulation})
            steps = whole_passes(args.steps if accumulation == 1 else args.shipped_steps,
                                 accumulation, len(batches))
            graphs = compiled_graphs()
            others = allocated(device) - measured.resident
            seconds, peak = timed(measured.step, batches, accumulation, steps, device)
            if peak is not None:
                peak -= others / 2**30
            row = row_of(context.config, phase, impl, variant, kind, context.shape,
                         accumulation, seconds, peak, batches, device)
            row.update(name=name, **measured.warm[kind],
                       recompiles_timed=compiled_graphs() - graphs)
            sample = context.spread[kind]
            row["sample_spread_pct"] = round(sample, 2) if sample is not None else None
            add_ratios(results, row)
            results.add("rows", row)
            if name == "hf-compiled":
                backfill(results, row)
            print_row(row)


def profile(step: Callable[[list[Batch]], None], batch: Batch, phase: int, impl: str,
            variant: str, kind: str, shape: dict, device: torch.device,
            profiles: Results) -> None:
    summary = profile_steps(functools.partial(step, [batch]), 2, device.type == "cuda")
    profiles.add("profiles", {"phase": phase, "impl": impl, "variant": variant,
                              "lengths": kind, "micro_batch": shape["micro_batch"], **summary})
    shares = ", ".join(f"{k} {v['share']:.0%}" for k, v in summary["shares"].items())
    print(f"      profile {impl} ({variant}, {kind} lengths): {summary['ms_per_step']} ms/step: "
          f"{shares}", flush=True)



if __name__ == "__main__":
    sys.exit(main())
