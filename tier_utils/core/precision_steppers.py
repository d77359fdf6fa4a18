"""The part of a precision that lives for one run: backward, unscaling, the optimizer step and their state.

`Stepper` is the plain one (fp32, bf16, the true modes); `ScalerStepper` puts fp16 mixed's torch.amp GradScaler
behind the same five calls, so `TrainStep` and the training loop never ask which precision they run.
"""
from __future__ import annotations

import torch


class Stepper:
    """Backward and the optimizer step as they are: no loss scale, no state."""

    scale_before: float | None = None  # the loss scale around the last step, when read (ScalerStepper, track)
    scale_after: float | None = None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the gradients in their true scale before clipping: nothing to do here."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Step the optimizer; whether the step was skipped, when known (None: not known, or never skipped)."""
        optimizer.step()
        return None

    @property
    def scale(self) -> float | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (a checkpoint's empty entry)."""


class ScalerStepper(Stepper):
    """fp16 mixed: scale the loss -> backward -> unscale_ -> (clip) -> step (skipped on inf/NaN) -> update.
    `track`: read the scale before and after each step (two host syncs) to know whether it was skipped; a
    timed loop leaves them out. `scaler`: the GradScaler itself, the distributed strategy's choice (FSDP's agrees
    its inf check across ranks); None: torch.amp's for the device."""

    def __init__(self, device: torch.device, track: bool = True, scaler: torch.amp.GradScaler | None = None):
        self.scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type)
        self.track = track

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool | None:
        self.scale_before = self.scaler.get_scale() if self.track else None
        self.scaler.step(optimizer)
        self.scaler.update()
        if not self.track:
            return None
        self.scale_after = self.scaler.get_scale()
        return self.scale_after < self.scale_before

    @property
    def scale(self) -> float:
        return self.scaler.get_scale()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state)
