"""Tier 3 training engine.

`TrainStep` is the one AMP-correct optimizer step, shared by `train()` and `amp_benchmark()`:
autocast around forward + loss only; fp16 goes scale -> backward -> unscale_ -> clip -> step
-> update through a GradScaler that is a no-op for fp32/bf16.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .adapter import ModelAdapter
from .errors import TierError
from .precision import Precision


class TrainingDiverged(TierError):
    """The loss became NaN/inf in a precision without a scaler to absorb it."""

    def __init__(self, step: int, precision: str, value: float, result=None):
        super().__init__(f"loss became {value} at step {step} in {precision}; lower the learning rate, "
                         "add grad clipping, or use fp32/bf16")
        self.step, self.precision, self.value, self.result = step, precision, value, result


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not biases, norms or 1-d params), as in nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def make_scheduler(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the base LR, then cosine decay to 10% of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class StepOutput:
    loss: torch.Tensor  # mean loss over the micro-batches, detached, still on the device
    grad_norm: torch.Tensor  # total norm before clipping; non-finite when the gradients overflowed
    skipped: bool | None  # fp16 only (deciding it needs a host sync); None for fp32/bf16
    scale_before: float | None
    scale_after: float | None


class TrainStep:
    """One optimizer step over one or more micro-batches (gradient accumulation).

    `no_sync` is a callable taking "is this not the last micro-batch" and returning a context;
    DDP passes one that skips the all-reduce on accumulation micro-steps.
    """

    def __init__(self, adapter: ModelAdapter, precision: Precision, optimizer: torch.optim.Optimizer,
                 scheduler=None, grad_clip: float | None = 1.0, model: torch.nn.Module | None = None, no_sync=None):
        self.adapter, self.precision = adapter, precision
        self.optimizer, self.scheduler = optimizer, scheduler
        self.grad_clip = grad_clip
        self.scaler = precision.grad_scaler()
        self.model = model if model is not None else adapter.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.no_sync = no_sync or (lambda accumulating: contextlib.nullcontext())

    def __call__(self, micro_batches: list[dict]) -> StepOutput:
        self.optimizer.zero_grad(set_to_none=True)
        n = len(micro_batches)
        total = torch.zeros((), device=self.adapter.device)
        for i, batch in enumerate(micro_batches):
            with self.no_sync(i < n - 1):
                with self.precision.autocast():
                    loss, _ = self.adapter.forward_loss(batch)
                self.scaler.scale(loss / n).backward()
            total += loss.detach().float()
        self.scaler.unscale_(self.optimizer)
        # clip with max_norm=inf still returns the norm: one code path whether or not clipping is on.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or math.inf)
        skipped = scale_before = scale_after = None
        if self.scaler.is_enabled():
            # The only per-step host sync, fp16 only: a skipped step must not advance the LR schedule.
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scale_after = self.scaler.get_scale()
            skipped = scale_after < scale_before
        else:
            self.optimizer.step()
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        return StepOutput(total / n, grad_norm.detach(), skipped, scale_before, scale_after)
