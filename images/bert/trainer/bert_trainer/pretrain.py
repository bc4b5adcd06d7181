"""BERT pre-training (phase 1 or 2), one process per GPU, under Slurm, torchrun or alone.

Examples::

    # one node, 8 GPUs, phase 1 at sequence length 128
    torchrun --nproc-per-node 8 -m bert_trainer.pretrain --input_dir=/data/phase1 \\
        --output_dir=/checkpoints --train_batch_size=8192 --gradient_accumulation_steps=32 \\
        --learning_rate=6e-3 --warmup_proportion=0.2843 --max_steps=7038 --bf16

    # the same from Slurm (rank and rendezvous from SLURM_*): what run.sub does
    srun python3 -m bert_trainer.pretrain ... --resume_from_checkpoint

    # phase 2 from phase 1's last checkpoint, with a fresh schedule
    ... --phase2 --init_checkpoint=/checkpoints --max_seq_length=512 \\
        --max_predictions_per_seq=80 --learning_rate=4e-3 --warmup_proportion=0.128

    # float8 matmuls in the encoder on H100/H200 (torchao installed): bf16 elsewhere
    ... --bf16 --o2 --fp8

    # continued pre-training of public weights (a Hugging Face folder, safetensors or
    # pytorch_model.bin; an NVIDIA checkpoint): phase 1 from them, their config's shape
    ... --init_checkpoint=bert-base-uncased --config_file=bert-base-uncased/config.json

``--train_batch_size`` is per GPU *after* accumulation (global batch =
train_batch_size x GPUs); each micro-step runs train_batch_size /
gradient_accumulation_steps sequences.  SIGTERM or SIGUSR1 (Slurm's warning
before a time limit, and preemption) makes every rank stop after the current
step, write a checkpoint and exit with status 3, so the job script can requeue
itself; ``--resume_from_checkpoint`` continues exactly where it stopped.  With
``--stop_record FILE`` the ranks exit 0 instead and rank 0 writes FILE once the
checkpoint is complete and every rank has agreed to stop: a job script reads the
file, and ``srun --kill-on-bad-exit`` never kills a rank still finishing.

Exit status: 0 done (or stopped, with --stop_record), 1 bad data/config/checkpoint,
2 bad flags, 3 stopped by a signal after checkpointing.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

EXIT_STOPPED = 3


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; an option's default shown when it has a real one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        prog="python -m bert_trainer.pretrain", description=doc.split("\n\n")[0],
        epilog="\n\n".join(doc.split("\n\n")[1:]),
        formatter_class=_HelpFormatter)
    data = parser.add_argument_group("data and files")
    data.add_argument("--input_dir", required=True, type=Path,
                      help="folder of HDF5 shards for this phase (e.g. DATA/phase1)")
    data.add_argument("--output_dir", required=True, type=Path,
                      help="checkpoints go to OUTPUT_DIR/phase<N>/ckpt_<step>.pt")
    data.add_argument("--results_dir", type=Path, default=None,
                      help="also append the JSON log lines to RESULTS_DIR/bert_phase<N>.jsonl")
    data.add_argument("--config_file", type=Path, default=None,
                      help="bert_config.json (default: BERT-Large)")
    data.add_argument("--max_seq_length", type=int, default=128,
                      help="tokens per sequence: 128 in phase 1, 512 in phase 2")
    data.add_argument("--max_predictions_per_seq", type=int, default=20,
                      help="masked slots per sequence: 20 in phase 1, 80 in phase 2")
    batch = parser.add_argument_group("batch and schedule")
    batch.add_argument("--train_batch_size", type=int, default=32,
                       help="sequences per GPU per optimizer step, after accumulation")
    batch.add_argument("--gradient_accumulation_steps", type=int, default=1,
                       help="micro-steps per optimizer step (one all-reduce per step)")
    batch.add_argument("--learning_rate", type=float, default=6e-3, help="LAMB peak rate")
    batch.add_argument("--warmup_proportion", type=float, default=0.2843,
                       help="share of --max_steps spent warming up linearly")
    batch.add_argument("--max_steps", type=int, default=7038,
                       help="optimizer steps of this phase (the schedule's length)")
    batch.add_argument("--weight_decay", type=float, default=0.01,
                       help="for weights; biases and LayerNorm get none")
    batch.add_argument("--max_grad_norm", type=float, default=1.0,
                       help="clip all gradients together to this L2 norm")
    batch.add_argument("--seed", type=int, default=12345,
                       help="initial weights, dropout and the data order")
    phase = parser.add_argument_group("phases and checkpoints")
    phase.add_argument("--phase2", action="store_true",
                       help="phase 2: start from --init_checkpoint with a fresh schedule")
    phase.add_argument("--init_checkpoint", type=Path, default=None,
                       help="start from these weights (any phase): a checkpoint file, a "
                       "folder holding phase1/ckpt_*.pt, a Hugging Face folder or file, an "
                       "NVIDIA DeepLearningExamples checkpoint")
    phase.add_argument("--trust_checkpoint", action="store_true",
                       help="let --init_checkpoint hold pickled Python objects (NVIDIA's "
                       "checkpoints of 2020-2022 hold a data loader): unpickling runs code "
                       "the file names, so only for files you trust")
    phase.add_argument("--resume_from_checkpoint", action="store_true",
                       help="continue from this phase's latest checkpoint if there is one")
    phase.add_argument("--num_steps_per_checkpoint", type=int, default=200,
                       help="also on SIGTERM/SIGUSR1 and at the end")
    phase.add_argument("--keep_checkpoints", type=int, default=3,
                       help="the newest K are kept")
    phase.add_argument("--stop_record", type=Path, default=None,
                       help="on a stop signal: write this file after the checkpoint and exit "
                       "0 (job scripts requeue when it exists) instead of exiting 3")
    speed = parser.add_argument_group("precision and speed")
    precision = speed.add_mutually_exclusive_group()
    meaning = {"bf16": "bf16 autocast (default on GPUs that have it)",
               "fp16": "fp16 autocast with dynamic loss scaling (default on older GPUs)",
               "fp32": "fp32, TF32 matmuls on GPUs (default on CPUs)"}
    for name, text in meaning.items():
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               help=text)
    speed.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.compile the model (default: on with a GPU, off on CPU)")
    speed.add_argument("--fused_lamb", action=argparse.BooleanOptionalAction, default=None,
                       help="LAMB as one torch.compiled step (default: as --compile)")
    speed.add_argument("--padded", action="store_true",
                       help="run the encoder on padded [batch, seq] tensors (default: on the "
                       "real tokens alone, which gives the same numbers faster)")
    speed.add_argument("--o2", action="store_true",
                       help="bf16 weights and activations with fp32 master weights in LAMB "
                       "(with --bf16; halves the bytes of every elementwise pass)")
    speed.add_argument("--fp8", action="store_true",
                       help="float8 matmuls in the encoder's linear layers (torchao's float8 "
                       "training; bf16 everywhere else): with --bf16, on an H100/H200 (compute "
                       "capability 8.9 or later), with torchao installed")
    speed.add_argument("--fp8_emulate", action="store_true",
                       help="--fp8 with torchao's emulated float8 matmuls (any device, slow: "
                       "for tests)")
    speed.add_argument("--prefetch", type=int, default=4, help="micro-batches read ahead")
    speed.add_argument("--log_freq", type=int, default=1, help="optimizer steps per log line")
    speed.add_argument("--peak_tflops", type=float, default=None,
                       help="per-GPU peak for MFU (default: from the GPU's name)")
    speed.add_argument("--loss_scale_growth_interval", type=int, default=2000,
                       help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("train_batch_size", "gradient_accumulation_steps", "max_steps",
                 "max_seq_length", "max_predictions_per_seq", "num_steps_per_checkpoint",
                 "log_freq", "prefetch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.train_batch_size % args.gradient_accumulation_steps:
        parser.error(f"--train_batch_size {args.train_batch_size} is not a multiple of "
                     f"--gradient_accumulation_steps {args.gradient_accumulation_steps}")
    if not 0 <= args.warmup_proportion <= 1:
        parser.error("--warmup_proportion must be between 0 and 1")
    if args.max_predictions_per_seq > args.max_seq_length:
        parser.error("--max_predictions_per_seq cannot exceed --max_seq_length")
    if args.o2 and args.precision not in (None, "bf16"):
        parser.error(f"--o2 needs bf16, not --{args.precision}")
    args.fp8 = args.fp8 or args.fp8_emulate
    if args.fp8 and args.precision not in (None, "bf16"):
        parser.error(f"--fp8 runs beside bf16, not --{args.precision}")
    return args


class StopRequest:
    """Remembers SIGTERM/SIGUSR1; the loop acts on it between optimizer steps."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for number in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(number, self._note)

    def _note(self, number: int, _frame: object) -> None:
        self.signal = number


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `kill -USR2 <pid>` prints every thread's stack to stderr: for finding a hung rank.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    import torch.distributed as dist

    from bert_trainer.checkpoint import CheckpointError
    from bert_trainer.config import ConfigError
    from bert_trainer.data import DataError
    from bert_trainer.distributed import placement

    try:
        where = placement()
    except ValueError as exc:
        print(f"error: rank variables (RANK/WORLD_SIZE or SLURM_*) are not numbers: {exc}",
              file=sys.stderr, flush=True)
        return 1
    try:
        return _train(args, where)
    except (DataError, ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except OSError as exc:  # unwritable --output_dir/--results_dir, full disk: name the path
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
              file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(args: argparse.Namespace, where) -> int:  # noqa: ANN001 - Placement
    import torch
    import torch.distributed as dist

    from bert_trainer import checkpoint
    from bert_trainer.config import BertConfig, ConfigError
    from bert_trainer.data import Position, Prefetcher, ShardStream, shard_files
    from bert_trainer.fp8 import check_support
    from bert_trainer.lineage import finished, phase_record, resumed
    from bert_trainer.metrics import JsonLog, Throughput, peak_tflops
    from bert_trainer.model import BertForPreTraining, count_parameters
    from bert_trainer.start import config_name, starting_point
    from bert_trainer.trainer import Trainer, default_precision

    stop = StopRequest()
    distributed = where.world_size > 1
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", where.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if distributed:
        os.environ.update(MASTER_ADDR=where.master_addr, MASTER_PORT=str(where.master_port))
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=where.rank,
                                world_size=where.world_size, init_method="env://")
    rank, world = where.rank, where.world_size
    phase = 2 if args.phase2 else 1
    log = JsonLog(args.results_dir / f"bert_phase{phase}.jsonl" if args.results_dir else None,
                  enabled=rank == 0)
    config = BertConfig.load(args.config_file)
    precision = args.precision or default_precision(device)
    compile_model = use_cuda if args.compile is None else args.compile
    micro_batch = args.train_batch_size // args.gradient_accumulation_steps
    files = shard_files(args.input_dir)  # before building the model: fail fast

    if args.max_seq_length > config.max_position_embeddings:
        raise ConfigError(f"--max_seq_length {args.max_seq_length} is longer than the model's "
                          f"{config.max_position_embeddings} positions "
                          f"(max_position_embeddings of {config_name(args.config_file)})")

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.o2 and precision != "bf16":
        raise ConfigError(f"--o2 needs bf16, and this run is {precision} (pass --bf16 on a "
                          "device that has it)")
    if args.fp8:  # no torchao or no float8 matmuls: one line now, before the model is built
        check_support(device, precision, args.fp8_emulate)
    model = BertForPreTraining(config, unpadded=not args.padded)
    fused_lamb = compile_model if args.fused_lamb is None else args.fused_lamb
    ckpt_dir = checkpoint.phase_dir(args.output_dir, phase)
    resume = checkpoint.latest(ckpt_dir) if args.resume_from_checkpoint else None
    saved = checkpoint.load(resume) if resume is not None else None
    # a checkpoint this run cannot start from stops it here: nothing trained, nothing written
    begun = starting_point(args.init_checkpoint, args.trust_checkpoint, config,
                           config_name(args.config_file), phase, model, saved, resume)
    initialized_from = begun.init_checkpoint
    if rank == 0:  # an unwritable --output_dir fails now, not at the first checkpoint
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    # what the job ran in: run.sub exports the image it pinned (imgpipe's recipes)
    image = os.environ.get("IMGPIPE_IMAGE") or None
    image_digest = os.environ.get("IMGPIPE_IMAGE_DIGEST") or None
    for event, message in begun.lines:
        log.write({"event": event, "message": message})
    this_phase = phase_record(phase, args.input_dir, len(files), args.max_seq_length,
                              args.max_predictions_per_seq, args.train_batch_size * world,
                              args.learning_rate, args.max_steps, initialized_from, image,
                              image_digest)
    if saved is not None:  # the steps already run keep the batch they ran at
        this_phase = resumed(this_phase, (saved.get("lineage") or [None])[-1],
                             int(saved["step"]))
    trainer = Trainer(model, device, precision, args.learning_rate, args.warmup_proportion,
                      args.max_steps, args.gradient_accumulation_steps, distributed,
                      compile_model, args.weight_decay, args.max_grad_norm,
                      args.loss_scale_growth_interval, fused_lamb, args.o2, args.fp8,
                      args.fp8_emulate)
    torch.manual_seed(args.seed + rank)  # dropout differs across ranks
    start = Position()
    if saved is not None:
        trainer.load_state_dict(saved)
        if saved["world_size"] == world:
            start = Position(**saved["data"][rank])
            checkpoint.restore_rng(saved["rng"][rank], device)
        else:  # another world size: positions do not map, so start the next epoch
            start = Position(epoch=max(p["epoch"] for p in saved["data"]) + 1)
            log.write({"event": "warning", "message": f"checkpoint from {saved['world_size']} "
                       f"ranks resumed on {world}: data restarts at epoch {start.epoch}"})
    stream = ShardStream(files, rank, world, args.seed, micro_batch, args.max_seq_length,
                         args.max_predictions_per_seq, config.vocab_size, start,
                         config.type_vocab_size)
    batches = Prefetcher(stream, depth=args.prefetch, pin_memory=use_cuda)
    global_batch = args.train_batch_size * world
    throughput = Throughput(global_batch, args.max_seq_length,
                            config.training_flops_per_sequence(args.max_seq_length,
                                                               args.max_predictions_per_seq),
                            world, peak_tflops(device, precision, args.peak_tflops))
    log.write({"event": "start", "phase": phase, "step": trainer.step_count,
               "resumed_from": str(resume) if resume else None,
               "init_checkpoint": initialized_from, "world_size": world,
               "image": image, "image_digest": image_digest,
               "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
               "precision": precision, "compile": compile_model, "o2": args.o2,
               "fp8": ("emulated" if args.fp8_emulate else bool(args.fp8)),
               "unpadded": not args.padded, "fused_lamb": fused_lamb,
               "parameters": count_parameters(model), "global_batch": global_batch,
               "micro_batch": micro_batch,
               "gradient_accumulation_steps": args.gradient_accumulation_steps,
               "max_steps": args.max_steps, "shards": len(files),
               "data_position": start.to_dict()})

    def save_checkpoint() -> Path | None:
        mine = (last_position.to_dict(), checkpoint.rng_state(device))
        gathered: list = [mine]
        if distributed:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
        positions, rngs = [g[0] for g in gathered], [g[1] for g in gathered]
        written = None
        if rank == 0:
            payload = {"format": checkpoint.FORMAT, "phase": phase, "step": trainer.step_count,
                       "world_size": world, "data": positions, "rng": rngs,
                       "config": asdict(config), "loss": last_loss, "image": image,
                       "image_digest": image_digest, "init_checkpoint": initialized_from,
                       "lineage": [*begun.history,
                                   finished(this_phase, trainer.step_count, last_loss)],
                       **trainer.state_dict()}
            written = checkpoint.save(ckpt_dir, trainer.step_count, payload,
                                      args.keep_checkpoints)
        if distributed:  # no rank leaves (or exits) before the file is complete
            dist.barrier()
        return written

    last_position = start
    last_loss: float | None = None  # the last logged loss, kept in each checkpoint
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, correct, predicted, steps
    saved_at: Path | None = None
    started = time.perf_counter()
    exit_code = 0
    stopped = False
    try:
        while trainer.step_count < args.max_steps:
            micro = [next(batches).to(device) for _ in range(args.gradient_accumulation_steps)]
            learning_rate = trainer.learning_rate  # the rate this step uses
            stats = trainer.step(micro)
            last_position = micro[-1].position
            step = trainer.step_count
            if not stats.skipped:  # an fp16 overflow step is retried with the next batch
                throughput.step()
                sums += torch.stack([stats.loss.double(), stats.correct.double(),
                                     stats.predicted.double(),
                                     torch.ones((), device=device, dtype=torch.float64)])
            if not stats.skipped and (step % args.log_freq == 0 or step == args.max_steps):
                if distributed:
                    dist.all_reduce(sums)
                loss, correct, predicted, counted = sums.tolist()
                sums.zero_()
                last_loss = round(loss / counted, 6)
                record = {"event": "step", "step": step, "loss": last_loss,
                          "mlm_accuracy": round(correct / max(predicted, 1), 4),
                          "learning_rate": learning_rate,
                          "grad_norm": round(float(trainer.optimizer.last_grad_norm), 6),
                          **throughput.report()}
                if precision == "fp16":
                    record["loss_scale"] = trainer.scaler.get_scale()
                log.write(record)
            if (not stats.skipped and step % args.num_steps_per_checkpoint == 0
                    and step < args.max_steps):
                saved_at = save_checkpoint() or saved_at
            requested = stop.signal is not None
            if distributed:  # every rank stops at the same step, whichever got the signal
                flag = torch.tensor([float(requested)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                requested = bool(flag.item())
            if requested and step < args.max_steps:
                saved_at = save_checkpoint()
                log.write({"event": "stopped", "step": step, "signal": stop.signal,
                           "checkpoint": str(saved_at) if saved_at else None})
                if args.stop_record is not None:
                    if rank == 0:
                        _write_stop_record(args.stop_record, step, saved_at)
                    if distributed:  # no rank exits before the record exists
                        dist.barrier()
                    exit_code = 0
                else:
                    exit_code = EXIT_STOPPED
                stopped = True
                break
        else:
            saved_at = save_checkpoint()
    finally:
        batches.close()
    if not stopped:
        log.write({"event": "summary", "phase": phase, "steps": trainer.step_count,
                   "seconds": round(time.perf_counter() - started, 2),
                   "checkpoint": str(saved_at) if saved_at else None, **throughput.summary()})
    log.close()
    return exit_code


def _write_stop_record(path: Path, step: int, checkpoint_path: Path | None) -> None:
    """The stop record, written whole (temporary name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(f"step={step}\ncheckpoint={checkpoint_path or ''}\n")
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
