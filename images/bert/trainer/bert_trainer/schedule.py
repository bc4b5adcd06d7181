"""The polynomial warm-up/decay learning-rate schedule of BERT pre-training.

The rate rises linearly to the base rate over ``warmup_proportion`` of the
steps, then decays as ``((progress - 1) / (warmup - 1)) ** degree`` to zero at
the last step (degree 0.5, as in the published recipes).  Optimizer step ``n``
(counting from 1) uses the rate at progress ``n / total_steps``.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR


def poly_warmup_factor(step: int, total_steps: int, warmup_proportion: float,
                       degree: float = 0.5) -> float:
    """The multiple of the base rate for optimizer step ``step`` (1-based)."""
    progress = step / max(1, total_steps)
    if progress < warmup_proportion:
        return progress / warmup_proportion
    if warmup_proportion >= 1.0:
        return 1.0
    return max((progress - 1.0) / (warmup_proportion - 1.0), 0.0) ** degree


def poly_warmup(optimizer: torch.optim.Optimizer, total_steps: int,
                warmup_proportion: float) -> LambdaLR:
    """A LambdaLR whose ``last_epoch`` counts completed optimizer steps."""
    return LambdaLR(optimizer, lambda done: poly_warmup_factor(done + 1, total_steps,
                                                               warmup_proportion))
