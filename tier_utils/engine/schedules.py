"""The learning-rate schedule as a decided object: a linear warm-up to the base LR, then one of the shapes HF Trainer
and Lightning users bring (constant, linear, cosine, warm-up-stable-decay), ending at a fraction of the LR.

`Schedule.decide` resolves the settings once (a final fraction or decay share the shape doesn't use is refused in one
line); `Schedule.scheduler` gives torch's LambdaLR over the run's steps, used alike by train(), the benchmark and
bench/peers.py, so every runner steps through the same rates.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

# The shape after warm-up: progress p in [0, 1] -> the share of the way from the final LR back up to the base LR.
_SHAPES = {
    "constant": lambda p, decay: 1.0,
    "linear": lambda p, decay: 1.0 - p,
    "cosine": lambda p, decay: 0.5 * (1.0 + math.cos(math.pi * p)),
    # warm-up-stable-decay: the base LR until the last `decay` share of the steps, then linearly down to the final
    "wsd": lambda p, decay: min(1.0, (1.0 - p) / decay),
}
SCHEDULES = tuple(_SHAPES)
DEFAULT_FINAL_FRACTION = 0.1  # the LR at the last step, as a share of the base LR (linear, cosine, wsd)
DEFAULT_DECAY_FRACTION = 0.2  # wsd: the share of the post-warm-up steps the decay takes


@dataclass(frozen=True)
class Schedule:
    """The LR factor at each optimizer step: (step + 1) / (warmup + 1) while warming up, then `kind`'s shape from 1
    down to `final_fraction` over the remaining steps (constant stays at 1)."""

    kind: str = "cosine"
    warmup_steps: int = 10
    final_fraction: float = DEFAULT_FINAL_FRACTION
    decay_fraction: float | None = None  # wsd only

    @classmethod
    def decide(cls, kind: str, warmup_steps: int, final_fraction: float | None = None,
               decay_fraction: float | None = None) -> Schedule:
        """The schedule from its settings (None: the shape's default); a setting the shape has no use for is one
        line naming the shapes that take it."""
        if kind not in _SHAPES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
        if kind == "constant" and final_fraction is not None:
            raise ValueError("a constant schedule stays at lr after warm-up: drop final_lr_fraction, or pick "
                             "schedule linear, cosine or wsd")
        if kind != "wsd" and decay_fraction is not None:
            raise ValueError("decay_fraction is the decay share of a warm-up-stable-decay schedule: drop it, or "
                             "use schedule=wsd")
        final = 1.0 if kind == "constant" else DEFAULT_FINAL_FRACTION if final_fraction is None else final_fraction
        decay = (DEFAULT_DECAY_FRACTION if decay_fraction is None else decay_fraction) if kind == "wsd" else None
        return cls(kind, warmup_steps, final, decay)

    def factor(self, step: int, total_steps: int) -> float:
        """The LR at optimizer step `step` (0-based) of `total_steps`, as a share of the base LR."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.final_fraction + (1.0 - self.final_fraction) * _SHAPES[self.kind](progress, self.decay_fraction)

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.factor(step, total_steps))

    def describe(self) -> str:
        """E.g. "10 warm-up steps, then cosine to 10% of lr"."""
        warmup = f"{self.warmup_steps} warm-up steps, then " if self.warmup_steps else ""
        if self.kind == "constant":
            return f"{warmup}constant lr"
        decay = f" over the last {self.decay_fraction:.0%} of the steps" if self.kind == "wsd" else ""
        shape = "stable, then linear decay" if self.kind == "wsd" else self.kind
        return f"{warmup}{shape} to {self.final_fraction:.0%} of lr{decay}"

    def to_dict(self) -> dict:
        return {**asdict(self), "described": self.describe()}
