"""fit's validation: the largest batch that really runs a training step, found by bisection, beside the prediction.

Work sized to the question, not to the card: by default only the recommended mode and the fp32 baseline are
validated (`validate="all"`: every mode), under a time cap (FitConfig.validate_seconds) after which the rows left
stay predicted and say so, with the memory each probe held released before the next and at the end. Rows with
memory settings are not validated (a step of LoRA's needs the adapters applied, of 8-bit optimizer state
bitsandbytes' optimizer built: other modules and optimizers than this model's; their bytes are predicted).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ..core.budget import without_oom
from ..core.dtype_contexts import kept_dtypes
from ..core.precision import resolve_precision
from ..core.progress import progress_bar
from ..engine.activation_checkpointing import memory_context
from ..engine.step import TrainStep, make_optimizer

VALIDATE_LIMIT = 1 << 16  # the largest batch validation tries: past it a step of a small model takes long
VALIDATE_CHOICES = ("on", "off", "all")  # on: the recommended mode and fp32; all: every mode but LoRA's


@dataclass(frozen=True)
class Validation:
    """What validation found: mode name -> the largest batch that ran a step, and for each mode left predicted,
    why (not chosen, LoRA, the time cap); the seconds it took."""

    found: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def describe(self, mode: str) -> str:
        """The row's words: which figure was validated, or why it is predicted."""
        if mode in self.found:
            return f"largest batch validated: {self.found[mode]} ran a step"
        return f"predicted ({self.predicted.get(mode, 'validation off')})"


def validate(adapter, configs: list, chosen: set[str], length: int, start_of, cap_s: float,
             progress: bool = False) -> Validation:
    """Bisect the largest batch of each config named in `chosen` (by `.name`), from `start_of(config)`, until
    `cap_s` seconds have passed; every other config gets the reason it stays predicted."""
    found, predicted, begun = {}, {}, time.monotonic()
    deadline = begun + cap_s
    todo = [c for c in configs if c.name in chosen and c.memory is None]
    for c in configs:
        if c not in todo:
            predicted[c.name] = ("LoRA rows are not validated" if c.lora is not None else
                                        "8-bit optimizer rows are not validated" if c.memory is not None else
                                        "not validated: validate='all' runs every mode that runs here")
    for c in progress_bar(todo, desc="fit: validating", unit="mode", enabled=progress):
        if time.monotonic() > deadline:
            predicted[c.name] = f"validation's {cap_s:g} s cap was reached before it"
            continue
        try:
            found[c.name] = bisect_batch(lambda b, c=c: _in_time(deadline) and step_runs(adapter, c, b, length),
                                         start_of(c), VALIDATE_LIMIT)
        except TimeoutError:  # the cap passed during its bisection (_in_time): the mode stays predicted
            predicted[c.name] = f"validation's {cap_s:g} s cap was reached during its bisection"
    _release(adapter.device)
    return Validation(found, predicted, time.monotonic() - begun)


def _in_time(deadline: float) -> bool:
    if time.monotonic() > deadline:
        raise TimeoutError
    return True


def _release(device) -> None:
    """What a probe left cached goes back: collected, and on a GPU the allocator's cache emptied."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def step_runs(adapter, config, batch: int, length: int) -> bool:
    """Whether one real training step (forward, backward, AdamW step) at (batch, length) of `config` (a planner
    row) runs without running out of memory; whatever it allocated is released before the next probe."""
    prec = config.mode or resolve_precision(config.precision, adapter.device, warn=False)
    state = {k: v.detach().clone() for k, v in adapter.model.state_dict().items()}

    def one_step():
        with kept_dtypes(adapter.model):
            prec.convert_module(adapter.model)
            optimizer = make_optimizer(adapter.model, 1e-3, 0.1, prec.adamw_eps)
            with memory_context(adapter.model, config.checkpointing):
                batches = [adapter.example_batch(batch, length, target_len=config.target_len)]
                TrainStep(adapter, prec, optimizer)(batches)
        return True

    ran, _ = without_oom(one_step)
    adapter.model.load_state_dict(state)
    adapter.model.zero_grad(set_to_none=True)
    del state
    _release(adapter.device)
    return bool(ran)


def bisect_batch(runs, start: int, limit: int = VALIDATE_LIMIT) -> int:
    """The largest batch b with runs(b) True (0: not even 1), assuming runs is monotone: up from `start` by
    doubling until one fails, then bisection."""
    lo, hi = 0, None
    b = max(1, start)
    while hi is None:
        if runs(b):
            lo = b
            if b >= limit:
                return b
            b = min(2 * b, limit)
        else:
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if runs(mid) else (lo, mid)
    return lo
