"""The one AMP-correct optimizer step, shared by `train()`, `amp_benchmark()` and the fit planner, with
the optimizer and LR schedule they all use.

`TrainStep`: autocast around forward + loss only; fp16 goes scale -> backward -> unscale_ -> clip ->
step -> update through a GradScaler that is a no-op for fp32/bf16. It knows models (through their
adapter) and precisions, nothing of the loops around it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..adapter.adapter import ModelAdapter
from ..core.precision import Precision


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not biases, norms or 1-d params), as in nanoGPT.

    Fused on CUDA (one kernel launch for all parameters, the fastest there), foreach elsewhere.
    `optimizer_impl` names the choice.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    impl = {"fused": True} if params and all(p.is_cuda for p in params) else {"foreach": True}
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, **impl)


def optimizer_impl(optimizer: torch.optim.Optimizer) -> str:
    """How the optimizer's step runs: fused, foreach or for-loop."""
    d = optimizer.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def make_scheduler(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the base LR, then cosine decay to 10% of it at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# Below this the GradScaler has halved its way out of range (17 overflowing steps from its initial
# 65536, with nothing in between to grow it back): the gradients overflow even unscaled, so no
# scale can rescue the run and every further step would be skipped.
MIN_LOSS_SCALE = 1.0


@dataclass
class StepOutput:
    loss: torch.Tensor  # mean loss over the micro-batches, detached, still on the device
    grad_norm: torch.Tensor  # total norm before clipping; non-finite when the gradients overflowed
    skipped: bool | None  # fp16 with track_scale only (deciding it needs a host sync); else None
    scale_before: float | None
    scale_after: float | None

    @property
    def scale_collapsed(self) -> bool:
        """fp16: this step was skipped and the loss scale fell below MIN_LOSS_SCALE; the run has diverged."""
        return bool(self.skipped) and self.scale_after < MIN_LOSS_SCALE


class TrainStep:
    """One optimizer step over one or more micro-batches (gradient accumulation).

    `no_sync` is a callable taking "is this not the last micro-batch" and returning a context;
    DDP passes one that skips the all-reduce on accumulation micro-steps. `track_scale=False`
    leaves out fp16's two reads of the loss scale (host syncs), so `skipped` and the scales come
    back None; it needs scheduler=None, since only a known skip can hold the LR schedule back.
    """

    def __init__(self, adapter: ModelAdapter, precision: Precision, optimizer: torch.optim.Optimizer,
                 scheduler=None, grad_clip: float | None = 1.0, no_sync=None, track_scale: bool = True):
        if scheduler is not None and not track_scale:
            raise ValueError("track_scale=False cannot hold a scheduler back on skipped fp16 steps; "
                             "pass scheduler=None or keep track_scale=True")
        self.adapter, self.precision = adapter, precision
        self.optimizer, self.scheduler = optimizer, scheduler
        self.grad_clip, self.track_scale = grad_clip, track_scale
        self.scaler = precision.grad_scaler()
        self.params = [p for p in adapter.model.parameters() if p.requires_grad]
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
        if hasattr(grad_norm, "full_tensor"):  # FSDP's sharded gradients: their global norm, replicated
            grad_norm = grad_norm.full_tensor()
        # fp16's two reads of the scale are host syncs, paid only to know a skip: a skipped step must not
        # advance the LR schedule.
        tracking = self.scaler.is_enabled() and self.track_scale
        scale_before = self.scaler.get_scale() if tracking else None
        # A disabled GradScaler (fp32/bf16) just calls optimizer.step(), and update() does nothing.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        scale_after = self.scaler.get_scale() if tracking else None
        skipped = scale_after < scale_before if tracking else None
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        return StepOutput(total / n, grad_norm.detach(), skipped, scale_before, scale_after)
