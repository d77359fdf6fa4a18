"""What every tier-2 analysis shares: the run context, an analysis' outcome, figures."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..adapter.adapter import ModelAdapter
from ..core.budget import Budget
from ..core.precision import BASELINE, Precision
from ..core.results import Check
from ..models.stored_dtype import fp32_copy, fp32_reference

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure


@dataclass
class Context:
    """Everything an analysis may use. The model is already in eval mode and on the device."""

    adapter: ModelAdapter
    batches: list[dict]  # real batches (dicts of the task's input, labels, attention_mask) on the device
    precision: Precision  # the autocast every plain forward runs under
    budget: Budget | None = None  # the device's free memory, read once: what a probe may hold
    classes: list[str] | None = None  # the data's class names (a folder's subfolders, the bundled shapes)

    def mask(self, batch: dict) -> torch.Tensor | None:
        """(B, T) bool: which positions hold real tokens; None for an input without token positions (an image's
        tokens are its patches, made by the model and all real)."""
        if not self.adapter.task.reads_tokens:
            return None
        mask = batch.get("attention_mask")
        return torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()

    def class_name(self, i: int) -> str:
        """Class id `i` by name: the data's, else the model's own `id2label`, else the id."""
        if self.classes and 0 <= i < len(self.classes):
            return self.classes[i]
        id2label = getattr(getattr(self.adapter.model, "config", None), "id2label", None) or {}
        return str(id2label.get(i, i))


@dataclass
class Outcome:
    """One analysis' findings (rows of the report's table), its DataFrames, and what its figures need."""

    checks: list[Check]
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        return bool(self.frames)


def on_fp32_weights(ctx: Context, run) -> Outcome:
    """`run(ctx)` with the model's weights in fp32: the precision comparisons' reference is fp32, and weights
    stored (and run) in bf16/fp16 are compared as an fp32 copy, which each row then names."""
    reference = fp32_reference(ctx.adapter.model, ctx.adapter.stored_dtype)
    with fp32_copy(ctx.adapter.model):
        outcome = run(ctx)
    if reference != BASELINE:
        for check in outcome.checks:
            check.detail += f" (on {reference})"
    return outcome


def head(batch: dict, rows: int, tokens: int | None = None) -> dict:
    """The first `rows` sequences of a batch, cut to their first `tokens` positions (None: all)."""
    return {k: v[:rows, :tokens] if v.dim() > 1 else v[:rows] for k, v in batch.items()}


def head_rows(batches: list[dict], rows: int) -> list[dict]:
    """The first `rows` sequences of a list of batches, in order: whole batches, then part of the next."""
    kept = []
    for batch in batches:
        if rows <= 0:
            break
        kept.append(head(batch, rows))
        rows -= len(kept[-1]["labels"])
    return kept


def message_figure(title: str, text: str) -> Figure:
    """A small figure that says why there is nothing to draw (a skipped or failed analysis)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 1.6))
    ax = fig.add_subplot()
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=9)
    return fig


def first_tensor(output) -> torch.Tensor | None:
    """The first floating tensor in a module output (tensor, tuple/list, or ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, dict) or hasattr(output, "values"):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            found = first_tensor(item)
            if found is not None:
                return found
    return None
