"""LAMB (You et al., 2019) on PyTorch's multi-tensor ``_foreach`` kernels.

Semantics follow the LAMB used for BERT pre-training at scale (NVIDIA's
FusedLAMB defaults): the gradients of all groups are first clipped together to
a global L2 norm of ``max_grad_norm``; Adam moments with bias correction; the
decoupled weight decay is added to the update; the layer-wise trust ratio
``||w|| / ||update||`` (1 when either is zero) scales the update of parameters
that have weight decay (all parameters with ``use_nvlamb=True``).

Every stage is one ``_foreach`` call over all tensors of a group, so a step is a
few dozen kernel launches however many tensors the model has, instead of a few
per tensor.  The step count lives in each param group, so it is saved and
restored with ``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                 use_nvlamb: bool = False) -> None:
        if lr < 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid LAMB settings: lr={lr} eps={eps} betas={betas}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "step": 0}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.use_nvlamb = use_nvlamb
        self.last_grad_norm: torch.Tensor | None = None  # before clipping, for the log

    def _params_with_grads(self) -> list[list[torch.Tensor]]:
        return [[p for p in group["params"] if p.grad is not None]
                for group in self.param_groups]

    @staticmethod
    def _global_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
        grads = [p.grad for params in groups for p in params]
        if not grads:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = closure() if closure is not None else None
        groups = self._params_with_grads()
        norm = self._global_norm(groups)
        self.last_grad_norm = norm
        # Scale by max_norm / norm only when the norm exceeds it (a tensor: no host sync).
        clip = self.max_grad_norm / torch.clamp(norm, min=self.max_grad_norm)
        for group, params in zip(self.param_groups, groups, strict=True):
            if not params:
                continue
            group["step"] += 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
            exp_avg = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
            grads = torch._foreach_mul([p.grad for p in params], clip.to(params[0].device))
            torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
            denominator = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denominator, math.sqrt(1 - beta2 ** step))
            torch._foreach_add_(denominator, group["eps"])
            update = torch._foreach_div(exp_avg, denominator)
            torch._foreach_div_(update, 1 - beta1 ** step)
            decay = group["weight_decay"]
            if decay:
                torch._foreach_add_(update, params, alpha=decay)
            if decay or self.use_nvlamb:
                weight_norms = torch.stack(torch._foreach_norm(params))
                update_norms = torch.stack(torch._foreach_norm(update))
                ratios = torch.where((weight_norms > 0) & (update_norms > 0),
                                     weight_norms / update_norms, torch.ones_like(weight_norms))
                # 0-d factors: a per-tensor loop inside torch, all on the device.
                torch._foreach_mul_(update, list(ratios.unbind(0)))
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return loss


def parameter_groups(model: torch.nn.Module, weight_decay: float,
                     no_decay: set[str]) -> list[dict]:
    """Two groups: decayed weights, and biases + LayerNorm parameters without decay."""
    decayed, plain = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (plain if name in no_decay else decayed).append(parameter)
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]
