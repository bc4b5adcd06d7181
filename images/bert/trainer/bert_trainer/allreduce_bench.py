"""All-reduce bandwidth with PyTorch, printed in nccl-tests' format so the same check reads it.

Run one process per GPU under srun or torchrun::

    srun python -m bert_trainer.allreduce_bench -b 8 -e 8G -f 2
    torchrun --nproc-per-node 8 -m bert_trainer.allreduce_bench -b 8 -e 1G

NCCL on GPUs, gloo on CPUs.  PyTorch's all_reduce works in place; the
out-of-place columns time the same collective on a second buffer, so both
columns mean the same thing to a reader of nccl-tests logs.  ``#wrong`` counts
elements that differ from the expected sum after the timed iterations.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    unit = text[-1] if text and text[-1] in "KMG" else ""
    number = text[:-1] if unit else text
    try:
        return int(float(number) * UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8, 64K, 1M or 2G") from None


def sizes(low: int, high: int, factor: int) -> list[int]:
    out, size = [], max(low, 4)
    while size <= high:
        out.append(size)
        size *= factor
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("-f", "--stepfactor", type=int, default=2)
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-w", "--warmup_iters", type=int, default=5)
    parser.add_argument("-c", "--check", type=int, default=1)
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    args = parser.parse_args(argv)
    if args.stepfactor < 2 or args.minbytes > args.maxbytes:
        parser.error("need -f >= 2 and -b <= -e")

    import torch
    import torch.distributed as dist

    from bert_trainer.distributed import placement

    where = placement()
    os.environ.update(MASTER_ADDR=where.master_addr, MASTER_PORT=str(where.master_port))
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", where.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=where.rank, world_size=where.world_size,
                            init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    described = [None] * world
    dist.all_gather_object(described, (rank, os.getpid(), socket.gethostname(),
                                       where.local_rank, label))
    steps = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    if rank == 0:
        print(f"# Collective test starting: all_reduce_perf (PyTorch {torch.__version__}, "
              f"{backend})")
        print(f"# nThread 1 nGpus 1 minBytes {steps[0]} maxBytes {steps[-1]} step: "
              f"{args.stepfactor}(factor) warmup iters: {args.warmup_iters} iters: "
              f"{args.iters} agg iters: 1 validation: {args.check} graph: 0")
        print("#\n# Using devices")
        for r, pid, host, local, name in described:  # type: ignore[misc]
            print(f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {host:>10} device {local:2d} "
                  f"[{name}]")
        print("#\n#{:>12} {:>13} {:>9} {:>7} {:>7} {:>8} {:>7} {:>7} {:>6} {:>8} {:>7} "
              "{:>7} {:>6}".format("size", "count", "type", "redop", "root", "time", "algbw",
                                   "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"))
        print("#{:>12} {:>13} {:>9} {:>7} {:>7} {:>8} {:>7} {:>7} {:>6} {:>8} {:>7} {:>7} "
              "{:>6}".format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                             "(us)", "(GB/s)", "(GB/s)", ""))
    factor = 2 * (world - 1) / world
    busbws, wrong_total = [], 0
    for size in steps:
        count = size // 4
        columns = []
        for _placement in ("out-of-place", "in-place"):
            buffer = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
            for _ in range(args.warmup_iters):
                dist.all_reduce(buffer)
            sync()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(buffer)
            sync()
            elapsed = torch.tensor([(time.perf_counter() - started) / args.iters * 1e6],
                                   dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            wrong = 0
            if args.check:
                buffer.fill_(float(rank + 1))
                dist.all_reduce(buffer)
                expected = world * (world + 1) / 2
                wrong = int((buffer != expected).sum().item())
            time_us = float(elapsed.item())
            algbw = size / time_us / 1e3
            columns.append((time_us, algbw, algbw * factor, wrong))
            wrong_total += wrong
        busbws += [columns[0][2], columns[1][2]]
        if rank == 0:
            cells = " ".join(f"{t:8.2f} {a:7.2f} {b:7.2f} {w if args.check else 'N/A':>6}"
                             for t, a, b, w in columns)
            print(f" {size:12d} {count:13d} {'float':>9} {'sum':>7} {-1:7d} {cells}",
                  flush=True)
    if rank == 0:
        print(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
        print(f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):g}")
        print("#")
    dist.destroy_process_group()
    return 0 if wrong_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
