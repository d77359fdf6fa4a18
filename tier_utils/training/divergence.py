"""A run whose loss is not finite, said in one line with its likeliest cause.

The weights are read once as they load: a weight the run's fp16 would make inf is refused before training (which
weight, and that bf16 or fp32 runs it), and the non-finite ones are kept as a cause. When a loss is not finite
(mid-run, or in the figures a run ended with), the line names the first step it was and the likeliest cause the run
can see, in this order: non-finite weights at load, every step skipped by fp16's GradScaler, the learning rate.
"""
from __future__ import annotations

import math

import torch

from ..core.errors import Fp16RangeError, TrainingDiverged
from ..core.precision import Precision
from .history import History

SHOWN_NAMES = 3  # weights a line names before "and N more"


def checked_weights(model: torch.nn.Module, precision: Precision) -> tuple[str, ...]:
    """The names of `model`'s non-finite weights as loaded (a cause to name if the loss goes non-finite); first,
    where the precision computes in fp16, a weight fp16 would make inf is refused (Fp16RangeError)."""
    if precision.compute_dtype == torch.float16:
        over = precision.out_of_range(_cast_to_fp16(model, precision))
        if over:
            raise Fp16RangeError(f"{precision.name} would overflow: {_named(over)} "
                                 f"{'holds' if len(over) == 1 else 'hold'} values beyond fp16's "
                                 f"±{precision.range_max():g}, which {precision.name} makes inf (every step skipped or "
                                 "NaN); "
                                 "bf16 or fp32 will run it: --precision bf16 or fp32")
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.numel()]
    if not named:
        return ()
    # One sum per weight and one transfer: NaN and inf carry through a sum (fp32: no overflow of its own).
    device = named[0][1].device
    finite = torch.stack([p.detach().sum(dtype=torch.float32).to(device) for _, p in named]).isfinite().tolist()
    return tuple(n for (n, _), ok in zip(named, finite) if not ok)


def _cast_to_fp16(model: torch.nn.Module, precision: Precision):
    """(name, weight) for each weight the run holds or computes in fp16: a true mode's every weight; under fp16
    autocast every weight but an embedding's table (a lookup runs in the weights' dtype; a tied output layer that
    multiplies by it is reached through that layer)."""
    seen = set()
    for prefix, module in model.named_modules():
        if precision.param_dtype != torch.float16 and isinstance(module, torch.nn.Embedding):
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{prefix}.{name}" if prefix else name, p


def _named(names) -> str:
    return ", ".join(names[:SHOWN_NAMES]) + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES
                                              else "")


def likeliest_cause(precision: Precision, at_load: tuple[str, ...], skipped: int, steps: int) -> str | None:
    """The cause the run can see, in the order above; None: the learning rate (TrainingDiverged's own advice).
    `skipped` of the `steps` before the bad one were skipped by the GradScaler."""
    if at_load:
        return (f"non-finite weights at load: {_named(list(at_load))} held NaN or inf before the first step; "
                "load weights that are finite")
    if precision.needs_scaler and steps and skipped >= steps:
        return (f"fp16's GradScaler skipped every step ({skipped} of {steps}): the forward or its gradients overflow "
                "fp16; bf16 or fp32 will run it (--precision bf16 or fp32)")
    return None


def divergence_error(step: int, value: float, quantity: str, precision: Precision, at_load: tuple[str, ...],
             skipped: int) -> TrainingDiverged:
    """A run stopped at `step` (its loss or gradient norm not finite, or the loss scale collapsed), `skipped` of the
    steps before it skipped: the error with its cause."""
    cause = likeliest_cause(precision, at_load, skipped + (quantity == "loss scale"), step)
    return TrainingDiverged(step, precision.name, value, quantity=quantity, cause=cause)


def ended_nonfinite(hist: History, precision: Precision, at_load: tuple[str, ...],
                    steps: int) -> TrainingDiverged | None:
    """A run that ran its `steps` but ended with a non-finite train or validation loss, as the error naming the
    first step a loss was not finite: a training step's, else an evaluation's, else the first whose gradients
    overflowed (a window of skipped steps has no train loss); None when both final losses are finite."""
    evals = [r for r in hist.rows if r["kind"] in ("eval", "epoch")]
    final = {"train_loss": (hist.last("step") or {}).get("train_loss"),
             "val_loss": evals[-1]["val_loss"] if evals else None}
    bad = {k: v for k, v in final.items() if v is not None and not math.isfinite(v)}
    if not bad:
        return None
    first = dict(hist.first_nonfinite)
    bad_eval = next((r for r in evals if not math.isfinite(r["val_loss"])), None)
    if bad_eval is not None:
        first["val_loss"] = (bad_eval["step"], bad_eval["val_loss"])
    quantity = next((q for q in ("loss", "val_loss", "gradient norm") if q in first), None)
    step, value = first[quantity] if quantity else (steps, next(iter(bad.values())))
    return TrainingDiverged(step, precision.name, value, quantity=quantity or next(iter(bad)),
                            cause=likeliest_cause(precision, at_load, hist.skipped_total, steps),
                            final=", ".join(f"{k} {v}" for k, v in bad.items()))
