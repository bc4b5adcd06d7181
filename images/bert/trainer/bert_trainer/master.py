"""O2 mixed precision: the model's weights and activations in bf16, fp32 master weights in LAMB.

Under autocast the weights stay fp32 and every matmul casts them; a bias added to a
bf16 matmul output promotes it to fp32, so the residual stream, dropout, LayerNorm and
GeLU read and write 4 bytes per element.  With the whole model in bf16 they move 2, and
no weight is cast per micro-batch.

What LAMB steps stays fp32: one master copy of each parameter.  Gradients reach it
through two flat buffers: the bf16 model's gradients are views into one (autograd adds
into them in place), and after each micro-batch it is added into the fp32 one, which the
masters' ``.grad`` are views of, and zeroed.  Accumulating 32 micro-batches therefore
loses nothing to bf16's 8-bit mantissa.  Across ranks the fp32 buffer is all-reduced once
per step (DDP is not used: it would reduce only the last micro-batch's bf16 gradient).
After the step the masters are copied into the model, rounding to bf16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class MasterWeights:
    """fp32 masters of ``model``'s parameters; the model itself is cast to ``dtype``."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        total = sum(p.numel() for _, p in named)
        device = named[0][1].device
        self.grad = torch.zeros(total, dtype=torch.float32, device=device)
        self.model_grad = torch.zeros(total, dtype=dtype, device=device)
        self.masters: list[torch.Tensor] = []  # nn.Parameters, typed as what _foreach takes
        model.to(dtype)
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        offset = 0
        for (_, original), param in zip(named, self.params, strict=True):
            count = param.numel()
            master = nn.Parameter(original.detach().float().clone())
            master.grad = self.grad[offset:offset + count].view_as(param)
            param.grad = self.model_grad[offset:offset + count].view_as(param)
            self.masters.append(master)
            offset += count

    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.masters, strict=True))

    @torch.no_grad()
    def accumulate(self) -> None:
        """After a micro-batch's backward: its gradient into the fp32 sum, then zeroed."""
        self.grad.add_(self.model_grad)
        self.model_grad.zero_()

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Average the summed gradient over the ranks (one fp32 all-reduce)."""
        dist.all_reduce(self.grad)
        self.grad.div_(dist.get_world_size())

    @torch.no_grad()
    def broadcast(self) -> None:
        """Rank 0's masters on every rank (what DDP does at its start), then into the model."""
        for master in self.masters:
            dist.broadcast(master.data, 0)
        self.copy_to_model()

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def zero_grad(self) -> None:
        self.grad.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as fp32 (what checkpoints and exports hold)."""
        return {name: master.detach() for name, master in zip(self.names, self.masters,
                                                              strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, master in zip(self.names, self.masters, strict=True):
            master.copy_(state[name])
        self.copy_to_model()
