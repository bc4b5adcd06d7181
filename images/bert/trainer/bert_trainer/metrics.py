"""Throughput accounting and the JSON-lines log (rank 0 only)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

# Dense (no sparsity) tensor-core peaks in TFLOP/s for 16-bit inputs, by device-name
# fragment, most specific first; MFU divides achieved FLOP/s by this.
PEAK_TFLOPS_16BIT = (
    ("H200", 989.0), ("GH200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
    ("H100", 989.0), ("A100", 312.0), ("A10", 125.0), ("L40S", 362.0), ("L4", 121.0),
    ("V100", 125.0),
)


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Per-device peak for this precision (None when unknown: MFU is then not reported)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in PEAK_TFLOPS_16BIT:
        if fragment in name:
            # fp32 matmuls run as TF32 on Ampere and later: half the 16-bit rate.
            return tflops if precision != "fp32" else tflops / 2
    return None


class JsonLog:
    """One JSON object per line to stdout and, when given, a file in the results folder."""

    def __init__(self, path: Path | None, enabled: bool) -> None:
        self.enabled = enabled
        self.handle = None
        if enabled and path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record, sort_keys=False)
        print(line, file=sys.stdout, flush=True)
        if self.handle:
            self.handle.write(line + "\n")
            self.handle.flush()

    def close(self) -> None:
        if self.handle:
            self.handle.close()


class Throughput:
    """Sequences, tokens and FLOPs per second over the interval since the last report."""

    def __init__(self, global_batch: int, seq_len: int, flops_per_sequence: float,
                 world_size: int, peak: float | None) -> None:
        self.global_batch, self.seq_len = global_batch, seq_len
        self.flops_per_sequence, self.world_size, self.peak = flops_per_sequence, world_size, peak
        self.started = time.perf_counter()
        self.steps = 0
        self.total_steps = 0
        self.total_seconds = 0.0
        self.first: tuple[int, float] | None = None  # warm-up (and compilation): left out

    def step(self) -> None:
        self.steps += 1

    def report(self) -> dict:
        now = time.perf_counter()
        seconds = max(now - self.started, 1e-9)
        out = self._rates(self.steps, seconds)
        if self.first is None:
            self.first = (self.steps, seconds)
        else:
            self.total_steps += self.steps
            self.total_seconds += seconds
        self.started, self.steps = now, 0
        return out

    def summary(self) -> dict:
        """Rates over every reported interval but the first, unless that is all there is."""
        if self.total_steps == 0 and self.first is not None:
            return self._rates(*self.first)
        return self._rates(self.total_steps, max(self.total_seconds, 1e-9))

    def _rates(self, steps: int, seconds: float) -> dict:
        sequences = steps * self.global_batch / seconds
        tflops = sequences * self.flops_per_sequence / 1e12
        return {"sequences_per_s": round(sequences, 2),
                "tokens_per_s": round(sequences * self.seq_len, 1),
                "tflops_per_s": round(tflops, 3),
                "mfu": round(tflops / (self.peak * self.world_size), 4) if self.peak else None}
