"""Where a training step's time goes: torch.profiler's kernels in five shares.

matmul (cuBLAS/CUTLASS GEMMs), attention (flash/cuDNN/memory-efficient kernels, the math
path's ops on CPUs), optimizer (everything inside the ``optimizer`` range the bench marks
around the optimizer step), elementwise (Triton and ATen pointwise/reduction kernels:
dropout, residual, LayerNorm, GeLU, loss) and other (copies, memsets, NCCL).  On a GPU the
shares are of kernel time; on a CPU (the smoke mode) of the operators' self time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent

SHARES = ("matmul", "elementwise", "optimizer", "attention", "other")
_MATMUL = re.compile(r"gemm|cutlass|cublas|xmma|nvjet|wgmma|aten::(mm|addmm|bmm|matmul|linear)"
                     r"\b|sm\d+_.*(h|b)mma", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|attn|cudnn.*(sdpa|mha)|_efficient_", re.I)
_OTHER = re.compile(r"memcpy|memset|nccl|Memcpy|Memset|cudaMemcpy", re.I)
OPTIMIZER_RANGE = "optimizer"


def classify(name: str, in_optimizer: bool) -> str:
    if in_optimizer:
        return "optimizer"
    if _ATTENTION.search(name):
        return "attention"
    if _MATMUL.search(name):
        return "matmul"
    if _OTHER.search(name):
        return "other"
    return "elementwise"


def _work(prof: torch.profiler.profile, gpu: bool) -> tuple[list[FunctionEvent],
                                                             list[tuple[float, float]]]:
    """The timed work items (kernels, or leaf CPU operators) and the optimizer's ranges."""
    events = prof.events()
    if gpu:
        kind = torch.autograd.DeviceType.CUDA
        items = [e for e in events if e.device_type == kind and e.name != OPTIMIZER_RANGE
                 and not e.is_user_annotation]
        ranges = [(e.time_range.start, e.time_range.end) for e in events
                  if e.name == OPTIMIZER_RANGE and e.device_type == kind]
    else:
        # every operator by its self time: nothing counted twice
        items = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                 and not e.is_user_annotation and e.name != OPTIMIZER_RANGE]
        ranges = [(e.time_range.start, e.time_range.end) for e in events
                  if e.name == OPTIMIZER_RANGE and e.device_type != torch.autograd.DeviceType.CUDA]
    return items, ranges


def summarize(prof: torch.profiler.profile, steps: int, gpu: bool) -> dict[str, Any]:
    """Milliseconds per step and share of each class, and the costliest kernels."""
    items, ranges = _work(prof, gpu)
    totals = dict.fromkeys(SHARES, 0.0)
    by_name: dict[str, float] = {}
    for item in items:
        micros = item.time_range.elapsed_us() if gpu else item.self_cpu_time_total
        inside = any(start <= item.time_range.start <= end for start, end in ranges)
        totals[classify(item.name, inside)] += micros
        by_name[item.name] = by_name.get(item.name, 0.0) + micros
    whole = sum(totals.values()) or 1.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"basis": "kernel time" if gpu else "CPU operator self time",
            "optimizer_range": ("found" if ranges else
                                "not found: optimizer kernels counted as elementwise"),
            "ms_per_step": round(whole / 1000 / steps, 2),
            "shares": {k: {"ms_per_step": round(v / 1000 / steps, 2),
                           "share": round(v / whole, 3)} for k, v in totals.items()},
            "top": [{"name": n[:120], "ms_per_step": round(v / 1000 / steps, 3)}
                    for n, v in top]}


def profile_steps(step: Callable[[], None], steps: int, gpu: bool) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the profiler and summarize."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize()
    return summarize(prof, steps, gpu)
