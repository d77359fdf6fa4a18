"""The one precision-correct optimizer step, shared by `train()`, `amp_benchmark()` and the fit planner, with
the optimizer they all use (the LR schedule: engine/schedules.py).

`TrainStep.__call__` is the whole step, top to bottom: zero the gradients; per micro-batch, forward + loss under
the precision's context (autocast for the mixed modes), weighted by its share of the step's scored targets, and
backward through the GradScaler; unscale; clip; the optimizer step (skipped by fp16's scaler on overflow); the
scaler's update; the schedule. It asks the precision and the strategy objects, never a name, and knows nothing of the
loops around it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapter.adapter import ModelAdapter
from ..core.optimizers import DEFAULT_OPTIMIZER, Optimizer
from ..core.precision import Precision
from .strategies import Single, Strategy


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, eps: float = 1e-8,
                   optimizer: type[Optimizer] = DEFAULT_OPTIMIZER) -> torch.optim.Optimizer:
    """The one place the optimizer is built: `optimizer`'s class (a DecidedMemory's; core/optimizers.py) over the
    trainable parameters, with weight decay on matrices only (not biases, norms or 1-d params), as in nanoGPT.
    `eps`: the precision's `adamw_eps` (1e-8 is 0 in fp16)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return optimizer.build([g for g in groups if g["params"]], lr=lr, eps=eps)


# Below this the GradScaler has halved its way out of range (17 overflowing steps from its initial
# 65536, with nothing in between to grow it back): the gradients overflow even unscaled, so no
# scale can rescue the run and every further step would be skipped.
MIN_LOSS_SCALE = 1.0


@dataclass
class StepOutput:
    # The step's loss, detached, on the device: the mean over its scored targets. Under DDP/FSDP, this rank's share
    # of it times the world size: the mean over the ranks (what the history logs) is the step's loss.
    loss: torch.Tensor
    grad_norm: torch.Tensor  # total norm before clipping; non-finite when the gradients overflowed
    skipped: bool | None  # fp16 with track_scale only (deciding it needs a host sync); else None
    scale_before: float | None
    scale_after: float | None
    # count_rounding: (elements whose AdamW update was non-zero but left the stored value unchanged, elements
    # with a non-zero update), on the device; None otherwise or on a skipped step
    rounding: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def scale_collapsed(self) -> bool:
        """fp16: this step was skipped and the loss scale fell below MIN_LOSS_SCALE; the run has diverged."""
        return bool(self.skipped) and self.scale_after < MIN_LOSS_SCALE


class TrainStep:
    """One optimizer step over one or more micro-batches (gradient accumulation).

    `strategy` (default: one process) gives the GradScaler, the context that skips the gradient sync on
    accumulation micro-steps, and the clipping; `adapter` is what it wrapped for the step. The GradScaler is
    enabled for a precision that `needs_scaler` (fp16 mixed) and a pass-through otherwise (torch.amp's
    `enabled=False`: scale, unscale_ and update do nothing, step is the optimizer's). `track_scale=False` leaves out
    fp16's two reads of the loss scale (host syncs), so `skipped` and the scales come back None; it needs
    scheduler=None, since only a known skip can hold the LR schedule back.
    `count_rounding`: also count the parameter updates the stored dtype rounded away, over a fixed sample of
    each parameter (ROUNDING_SAMPLE: its extra memory is bounded, whatever the model's size).
    """

    def __init__(self, adapter: ModelAdapter, precision: Precision, optimizer: torch.optim.Optimizer,
                 scheduler=None, grad_clip: float | None = 1.0, strategy: Strategy | None = None,
                 track_scale: bool = True, count_rounding: bool = False):
        if scheduler is not None and not track_scale:
            raise ValueError("track_scale=False cannot hold a scheduler back on skipped fp16 steps; "
                             "pass scheduler=None or keep track_scale=True")
        self.adapter, self.precision = adapter, precision
        self.optimizer, self.scheduler = optimizer, scheduler
        self.grad_clip, self.count_rounding = grad_clip, count_rounding
        self.strategy = strategy or Single()
        # the run's loss-scale state: checkpoints save and restore it (an empty dict when disabled)
        self.scaler = self.strategy.grad_scaler(adapter.device.type, enabled=precision.needs_scaler)
        self.track = precision.needs_scaler and track_scale
        self.params = [p for p in adapter.model.parameters() if p.requires_grad]

    def __call__(self, micro_batches: list[dict]) -> StepOutput:
        self.optimizer.zero_grad(set_to_none=True)
        n = len(micro_batches)
        weights = self._weights(micro_batches)
        total = torch.zeros((), device=self.adapter.device)
        for i, (batch, weight) in enumerate(zip(micro_batches, weights)):
            # DDP/FSDP sync gradients on the last micro-batch only; a compiled module hands the strategy's calls
            # (no_sync, set_requires_gradient_sync) to the one it wraps
            with self.strategy.no_sync(self.adapter.model, i < n - 1):
                with self.precision.forward_context():  # autocast for the mixed modes; nothing for fp32 and true
                    loss, _ = self.adapter.forward_loss(batch)
                loss = loss * weight
                self.scaler.scale(loss).backward()  # fp16 mixed: scaled so small gradients survive fp16
            total += loss.detach().float()
        self.scaler.unscale_(self.optimizer)  # the gradients' true scale, before clipping measures them
        grad_norm = self.strategy.clip_gradients(self.params, self.grad_clip)
        before = [rounding_sample(p).clone() for p in self.params] if self.count_rounding else None
        scale_before = self.scaler.get_scale() if self.track else None  # a host sync: only when tracked
        self.scaler.step(self.optimizer)  # fp16 mixed: skipped when a gradient overflowed
        self.scaler.update()  # fp16 mixed: halve the scale after an overflow, grow it after a run of good steps
        scale_after = self.scaler.get_scale() if self.track else None
        skipped = scale_after < scale_before if self.track else None
        # A skipped step (fp16 overflow) must not advance the LR schedule.
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        rounding = rounded_away(self.params, before, self.optimizer) if before is not None and not skipped else None
        return StepOutput(total, grad_norm.detach(), skipped, scale_before, scale_after, rounding)

    def _weights(self, micro_batches: list[dict]) -> list[torch.Tensor]:
        """Each micro-batch's share of the step's scored targets over every rank, times the world size (DDP and
        FSDP average the ranks' gradients). A micro-batch's loss is the mean over its own targets; so weighted, the
        step's gradient is that of the mean over all of them, as one batch of every rank's rows would give, however
        unevenly batches cut to the data hold targets (transformers' num_items_in_batch). On the device: no sync."""
        counts = [self.adapter.task.scored(batch["labels"]).sum().float() for batch in micro_batches]
        env = self.strategy.env
        everywhere = env.all_sum(torch.stack(counts).sum()).clamp_min(1)
        return [count * env.world_size / everywhere for count in counts]


# The rounded-away count compares at most this many elements of each parameter, evenly spaced through it (all
# of a smaller one): before each counted step it holds that sample, not a copy of every weight (+1 model).
ROUNDING_SAMPLE = 1 << 16
ROUNDING_SAMPLE_NOTE = f"over up to {ROUNDING_SAMPLE:,} evenly spaced elements of each parameter"


def rounding_sample(t: torch.Tensor) -> torch.Tensor:
    """A view of at most ROUNDING_SAMPLE elements of `t`, evenly spaced (every one of a smaller tensor)."""
    flat = t.detach().reshape(-1)
    return flat[::max(1, -(-flat.numel() // ROUNDING_SAMPLE))]


def rounded_away(params: list[torch.Tensor], before: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements whose AdamW update was non-zero but left the stored value unchanged, elements whose update was
    non-zero) among each parameter's rounding_sample, compared with its sample `before` the step. AdamW moves an
    element when its first moment is non-zero (the gradient's part) or, with weight decay, when the element is
    (the decay's part)."""
    decay = {p: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    rounded = torch.zeros((), dtype=torch.long, device=params[0].device)
    updated = torch.zeros_like(rounded)
    for p, old in zip(params, before):
        state = optimizer.state.get(p, {})
        if "exp_avg" not in state:
            continue
        moved = rounding_sample(state["exp_avg"]) != 0
        if decay[p]:
            moved |= old != 0
        updated += moved.sum()
        rounded += (moved & (rounding_sample(p) == old)).sum()
    return rounded, updated
