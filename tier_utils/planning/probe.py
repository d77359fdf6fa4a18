"""How big the fit planner's measuring forwards are, so that `fit` keeps to the budget it states.

Each mode's activations are measured by small training forwards (budget.measure_activations: B <= 2, T <= 64)
with the model in the mode's weight dtype. Such a probe holds, beside the weights, a converted copy of them (a
true mode's 2-byte weights; the originals are held and put back exactly) or autocast's compute-dtype copies (a
mixed mode), and its own activations and output. On a big model that is GiBs. Where the whole model's probe
would hold more than a measuring forward may here (Budget.probe_limit: on a CPU at most budget.CPU_PROBE_BYTES,
as smoke's), every mode is measured on the first 2 and then 3 of the model's repeated blocks
(engine.activation_checkpointing.fewer_blocks: nothing copied) and the bytes are extrapolated block by block to the
whole depth: predicted, and the rows say so. The decision uses what the smallest probe (fp32, 2 and 3 blocks)
measured, extrapolated.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.nn as nn

from ..core.budget import ActivationFit, Budget, gib, measure_activations
from ..core.dtype_contexts import kept_dtypes
from ..core.precision import BASELINE, Precision, resolve_precision
from ..engine.activation_checkpointing import checkpointed, fewer_blocks, repeated_blocks

PROBE_DEPTHS = (2, 3)  # two depths, so what one block adds is measured; two, not one, still read as repeated blocks


def copy_bytes(model: nn.Module, precision: Precision) -> int:
    """What a probe in `precision` holds beside `model`'s weights: each floating-point weight and buffer not
    already in its weight dtype, converted (the original held too), and under autocast a compute-dtype copy of
    each weight matrix (an upper bound: autocast casts a linear layer's weight, not an embedding's)."""
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    converted = sum(t.numel() * precision.param_dtype.itemsize for t in floats if t.dtype != precision.param_dtype)
    if precision.compute_dtype == precision.param_dtype:
        return converted
    return converted + sum(p.numel() * precision.compute_dtype.itemsize for p in model.parameters() if p.dim() >= 2)


def measured_fit(adapter, precision: Precision, length: int, checkpointing: bool, depth: int | None = None,
                 target: int | None = None):
    """`precision`'s activation fit (with checkpointing if asked), the model converted to its weight dtype and,
    with `depth`, cut to its first `depth` blocks; the model given back as it was, bit for bit. `target`: an
    encoder-decoder's target length (None: the source's)."""
    model = adapter.model
    context = (lambda meter: checkpointed(model, meter)) if checkpointing else contextlib.nullcontext
    with fewer_blocks(model, depth) if depth else contextlib.nullcontext(), kept_dtypes(model, exact=True):
        precision.convert_module(model)
        return measure_activations(adapter, precision, length, context, target)


@dataclass
class Probe:
    """The size of fit's probes: the whole model (depths None) or two shallow depths, and why."""

    budget: Budget
    blocks: int
    depths: tuple[int, int] | None = None
    whole_bytes: int | None = None  # what the whole model's probe would hold (predicted)
    probe_bytes: int | None = None  # what the shallow probe holds (predicted)
    known: dict = field(default_factory=dict)  # (precision, checkpointing) -> a fit the sizing already measured
    target: int | None = None  # an encoder-decoder's target length the probes are sized for (None: the source's)

    def fit(self, adapter, precision: Precision, length: int, checkpointing: bool) -> ActivationFit:
        key = (precision.name, checkpointing)
        if key not in self.known:
            if self.depths is None:
                self.known[key] = measured_fit(adapter, precision, length, checkpointing, target=self.target)
            else:
                shallow, deeper = (measured_fit(adapter, precision, length, checkpointing, d, self.target)
                                   for d in self.depths)
                self.known[key] = shallow.extrapolated(deeper, self.depths, self.blocks)
        return self.known[key]

    def note(self) -> str:
        """The rows' words for a probe sized down ("" for the whole model)."""
        if self.depths is None:
            return ""
        over = "" if self.probe_bytes <= self.budget.limit else (
            f"; even that probe, {gib(self.probe_bytes)}, is over the stated {gib(self.budget.limit)}")
        return (f"; probed with {self.depths[0]} and {self.depths[1]} of {self.blocks} blocks: the whole model's "
                f"probe would hold {gib(self.whole_bytes)}, over the {gib(self.budget.probe_limit)} a measuring "
                f"forward may hold here ({self.budget.describe()}){over}")


def size_probe(adapter, precisions: list[Precision], length: int, budget: Budget, target: int | None = None) -> Probe:
    """The whole model where its probe, in the hungriest of `precisions`, fits Budget.probe_limit; else the
    shallow depths. The smallest probe (fp32 at both depths) is measured first to predict the whole one's.
    `target`: an encoder-decoder's target length (None: the source's)."""
    model = adapter.model
    blocks = len(repeated_blocks(model))
    if blocks <= PROBE_DEPTHS[-1] or not _shortens(model):
        return Probe(budget, blocks, target=target)
    fp32 = resolve_precision(BASELINE, adapter.device, warn=False)
    shallow, deeper = (measured_fit(adapter, fp32, length, False, d, target) for d in PROBE_DEPTHS)
    whole = shallow.extrapolated(deeper, PROBE_DEPTHS, blocks)
    copies = max(copy_bytes(model, p) for p in precisions)
    if copies + whole.probe_bytes() <= budget.probe_limit:
        return Probe(budget, blocks, target=target)
    with fewer_blocks(model, PROBE_DEPTHS[-1]):
        held = max(copy_bytes(model, p) for p in precisions) + deeper.probe_bytes()
    return Probe(budget, blocks, PROBE_DEPTHS, copies + whole.probe_bytes(), held, {(BASELINE, False): whole}, target)


def _shortens(model: nn.Module) -> bool:
    """Whether the cut model still reads as its first blocks (not, say, a longer list inside each block)."""
    for depth in PROBE_DEPTHS:
        with fewer_blocks(model, depth) as kept:
            if repeated_blocks(model) != kept:
                return False
    return True
