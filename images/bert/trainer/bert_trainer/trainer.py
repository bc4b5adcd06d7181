"""One optimizer step of BERT pre-training: accumulation, precision, DDP, LAMB, schedule.

The gradient all-reduce happens once per optimizer step: every micro-batch but
the last runs under DDP's ``no_sync``, and DDP keeps gradients as views into its
communication buckets (``gradient_as_bucket_view``), so nothing is copied
between them.  Each micro-batch's loss is divided by the accumulation count, so
N micro-batches of B/N give the gradient of one batch of B.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from bert_trainer import fp8 as float8
from bert_trainer.data import Batch
from bert_trainer.lamb import Lamb, parameter_groups
from bert_trainer.master import MasterWeights
from bert_trainer.model import BertForPreTraining, pretraining_loss
from bert_trainer.schedule import poly_warmup

Precision = Literal["bf16", "fp16", "fp32"]


def default_precision(device: torch.device) -> Precision:
    """bf16 where the GPU has it, fp16 on older GPUs, fp32 on CPUs."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


@dataclass
class StepStats:
    loss: torch.Tensor  # mean over micro-batches, on the device (no sync until read)
    correct: torch.Tensor
    predicted: torch.Tensor
    skipped: bool  # fp16 only: the step was dropped for inf/NaN gradients


class Trainer:
    def __init__(self, model: BertForPreTraining, device: torch.device, precision: Precision,
                 learning_rate: float, warmup_proportion: float, total_steps: int,
                 accumulation: int, distributed: bool = False, compile_model: bool = False,
                 weight_decay: float = 0.01, max_grad_norm: float = 1.0,
                 loss_scale_growth_interval: int = 2000, fused_lamb: bool = False,
                 o2: bool = False, fp8: bool = False, fp8_emulate: bool = False) -> None:
        if o2 and precision != "bf16":
            raise ValueError(f"O2 (bf16 weights, fp32 masters) needs bf16, not {precision}")
        self.model = model.to(device)
        # float8 matmuls in the encoder (fp8.py): swapped before anything holds the modules
        self.fp8_layers: list[str] = []
        if fp8:  # torchao is imported here, not before: a run without --fp8 needs none
            float8.check_support(device, precision, fp8_emulate)
            self.fp8_layers = float8.convert_encoder(self.model, fp8_emulate)
        self.device, self.precision, self.accumulation = device, precision, accumulation
        self.distributed = distributed
        # O2: the model in bf16, LAMB on fp32 masters (master.py)
        self.master = MasterWeights(model, torch.bfloat16) if o2 else None
        if self.master is not None and distributed:
            self.master.broadcast()
        masters = self.master.by_name() if self.master is not None else None
        self.optimizer = Lamb(parameter_groups(model, weight_decay, model.no_decay_names(),
                                               masters),
                              lr=learning_rate, weight_decay=weight_decay,
                              max_grad_norm=max_grad_norm, fused=fused_lamb)
        self.scheduler = poly_warmup(self.optimizer, total_steps, warmup_proportion)
        # Dynamic loss scaling for fp16: halve on inf/NaN (the step is skipped), double
        # after `growth_interval` clean steps.  A no-op for bf16 and fp32.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16",
                                           growth_interval=loss_scale_growth_interval)
        self.ddp: DistributedDataParallel | None = None
        module: torch.nn.Module = self.model
        if distributed and self.master is None:
            self.ddp = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)
            module = self.ddp
        # Compiling the DDP module lets dynamo split graphs at bucket boundaries, so the
        # all-reduce still overlaps the backward pass.
        self.forward_module = torch.compile(module) if compile_model else module
        self.compiled = compile_model
        self.autocast_dtype = None if o2 else {"bf16": torch.bfloat16,
                                               "fp16": torch.float16}.get(precision)

    @property
    def step_count(self) -> int:
        return self.scheduler.last_epoch

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, micro_batches: list[Batch]) -> StepStats:
        """Forward/backward every micro-batch, then one LAMB step (unless fp16 overflowed)."""
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        predicted = torch.zeros((), dtype=torch.long, device=self.device)
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            sync = (self.ddp.no_sync() if self.ddp is not None and not last
                    else contextlib.nullcontext())
            if self.compiled and self.model.unpadded:
                # The unpadded encoder's token count differs from batch to batch: traced as
                # a size from the first compile, not a constant that the second count
                # would recompile for (BERT-Large: minutes of compiling).
                torch._dynamo.maybe_mark_dynamic(batch.token_index, 0)
            with sync:
                with self._autocast():
                    mlm_logits, nsp_logits = self.forward_module(
                        batch.input_ids, batch.segment_ids, batch.input_mask,
                        batch.masked_lm_positions, batch.token_index, batch.cu_seqlens)
                loss, hits, count = pretraining_loss(mlm_logits, batch.masked_lm_labels,
                                                     nsp_logits, batch.next_sentence_labels)
                self.scaler.scale(loss / len(micro_batches)).backward()
            if self.master is not None:
                self.master.accumulate()
            loss_sum += loss.detach()
            correct += hits
            predicted += count
        if self.master is not None and self.distributed:
            self.master.all_reduce()
        # a named range: profiles (bench/bench_trainer.py --profile) count what is in it
        with torch.profiler.record_function("optimizer"):
            skipped = self._optimizer_step()
        return StepStats(loss_sum / len(micro_batches), correct, predicted, skipped)

    def _optimizer_step(self) -> bool:
        """LAMB (unless fp16 overflowed: then True, the step skipped), schedule, zeroing."""
        skipped = False
        if self.scaler.is_enabled():
            scale_before = self.scaler.get_scale()
            self.scaler.unscale_(self.optimizer)  # LAMB clips the true gradient norm
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        else:
            self.optimizer.step()
        if not skipped:
            self.scheduler.step()
        if self.master is not None:
            self.master.copy_to_model()
            self.master.zero_grad()  # the gradients are views of its buffers: keep them
        else:  # with bucket views, DDP's gradients must stay allocated: zero them instead
            self.optimizer.zero_grad(set_to_none=self.ddp is None)
        return skipped

    @property
    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        model = self.master.state_dict() if self.master is not None else self.model.state_dict()
        return {"model": model, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.master is not None:
            self.master.load_state_dict(state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # The checkpoint says how far the schedule is; this run's --learning_rate,
        # --warmup_proportion and --max_steps say what it is.  The rate the optimizer stored
        # is the old schedule's next one (0.0 after its last step, issue 62), so the rates
        # are set afresh from this run's schedule before the first step.
        base_rates = list(self.scheduler.base_lrs)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = base_rates
        done = self.scheduler.last_epoch
        for group, base, factor in zip(self.optimizer.param_groups, base_rates,
                                       self.scheduler.lr_lambdas, strict=True):
            group["initial_lr"], group["lr"] = base, base * factor(done)
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
