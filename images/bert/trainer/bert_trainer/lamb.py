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

``fused=True`` runs the whole step (global norm, clipping, moments, trust ratios,
update) as one ``torch.compile``d function: inductor fuses the ``_foreach`` stages
into a few kernels that read each gradient, moment and weight once.  The math is the
same function either way (``lamb_step``); the learning rate and step count reach it
as device tensors updated in place, so a new rate neither recompiles nor waits for
the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                 use_nvlamb: bool = False, fused: bool = False) -> None:
        if lr < 0 or eps <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"invalid LAMB settings: lr={lr} eps={eps} betas={betas}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "step": 0}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.use_nvlamb = use_nvlamb
        self.fused = fused
        self.last_grad_norm = torch.zeros(())  # before clipping, for the log
        # per group: (lr, step) as float64 device tensors, refilled before each step
        self._scalars: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._step_fn: Callable[..., torch.Tensor] = (
            torch.compile(lamb_step, dynamic=False) if fused else lamb_step)

    def _params_with_grads(self) -> list[list[torch.Tensor]]:
        return [[p for p in group["params"] if p.grad is not None]
                for group in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = closure() if closure is not None else None
        groups = self._params_with_grads()
        if not any(groups):
            self.last_grad_norm = torch.zeros(())
            return loss
        device = next(p for params in groups for p in params).device
        if len(self._scalars) != len(self.param_groups) or self._scalars[0][0].device != device:
            self._scalars = [(torch.zeros((), dtype=torch.float64, device=device),
                              torch.zeros((), dtype=torch.float64, device=device))
                             for _ in self.param_groups]
        settings = []
        for group, params, (lr, step) in zip(self.param_groups, groups, self._scalars,
                                             strict=True):
            if params:
                group["step"] += 1
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
            lr.fill_(group["lr"])  # a kernel with the value as its argument: no copy, no sync
            step.fill_(group["step"])
            decay = group["weight_decay"]
            beta1, beta2 = group["betas"]
            settings.append(GroupSettings(beta1, beta2, group["eps"], decay,
                                          bool(decay or self.use_nvlamb)))
        self.last_grad_norm = self._step_fn(
            groups, [[p.grad for p in params] for params in groups],
            [[self.state[p]["exp_avg"] for p in params] for params in groups],
            [[self.state[p]["exp_avg_sq"] for p in params] for params in groups],
            [s[0] for s in self._scalars], [s[1] for s in self._scalars],
            settings, self.max_grad_norm)
        return loss


class GroupSettings(NamedTuple):
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    trust_ratio: bool  # scale the update by ||w|| / ||update||


def lamb_step(params: list[list[torch.Tensor]], grads: list[list[torch.Tensor]],
              exp_avgs: list[list[torch.Tensor]], exp_avg_sqs: list[list[torch.Tensor]],
              lrs: list[torch.Tensor], steps: list[torch.Tensor],
              settings: list[GroupSettings], max_grad_norm: float) -> torch.Tensor:
    """One LAMB step of every group, in place; returns the global gradient norm (before
    clipping).  ``lrs`` and ``steps`` are 0-d float64 tensors, one per group."""
    every = [g for group in grads for g in group]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(every)))
    # Scale by max_norm / norm only when the norm exceeds it (a tensor: no host sync).
    clip = max_grad_norm / torch.clamp(norm, min=max_grad_norm)
    for group in range(len(params)):
        if params[group]:
            _group_step(params[group], grads[group], exp_avgs[group], exp_avg_sqs[group],
                        clip, lrs[group], steps[group], settings[group])
    return norm


def _group_step(params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor],
                clip: torch.Tensor, lr: torch.Tensor, step: torch.Tensor,
                s: GroupSettings) -> None:
    clipped = torch._foreach_mul(grads, clip.to(params[0].dtype))
    torch._foreach_lerp_(exp_avg, clipped, 1 - s.beta1)
    torch._foreach_mul_(exp_avg_sq, s.beta2)
    torch._foreach_addcmul_(exp_avg_sq, clipped, clipped, value=1 - s.beta2)
    denominator = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denominator, torch.sqrt(1 - s.beta2 ** step))
    torch._foreach_add_(denominator, s.eps)
    update = torch._foreach_div(exp_avg, denominator)
    torch._foreach_div_(update, 1 - s.beta1 ** step)
    if s.weight_decay:
        torch._foreach_add_(update, params, alpha=s.weight_decay)
    if s.trust_ratio:
        weight_norms = torch.stack(torch._foreach_norm(params))
        update_norms = torch.stack(torch._foreach_norm(update))
        ratios = torch.where((weight_norms > 0) & (update_norms > 0),
                             weight_norms / update_norms, torch.ones_like(weight_norms))
        # 0-d factors: a per-tensor loop inside torch, all on the device.
        torch._foreach_mul_(update, list(ratios.unbind(0)))
    torch._foreach_mul_(update, lr)
    torch._foreach_sub_(params, update)


def parameter_groups(model: torch.nn.Module, weight_decay: float,
                     no_decay: set[str],
                     named: dict[str, torch.Tensor] | None = None) -> list[dict]:
    """Two groups: decayed weights, and biases + LayerNorm parameters without decay.
    ``named``: other tensors to step in the model's parameters' stead (O2's masters)."""
    decayed: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    for name, parameter in (named or dict(model.named_parameters())).items():
        if parameter.requires_grad:
            (plain if name in no_decay else decayed).append(parameter)
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]
