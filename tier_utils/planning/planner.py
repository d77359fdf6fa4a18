"""The fit planner: the largest training batch at a sequence length, per precision, with and without
activation checkpointing, on this device and predicted for common GPUs.

A training step holds static bytes (fp32 weights, their gradients, AdamW's two states: measured from the
model's parameters and from AdamW itself, stepped once on meta tensors, so nothing is allocated) plus
the activations autograd saves (budget.measure_activations: measured at three small sizes under the
precision's autocast, fitted, extrapolated) plus, during backward, the output's gradient. With activation
checkpointing the repeated blocks (the longest nn.ModuleList of one module type) keep only their inputs,
and one block's activations come back while it is recomputed. Nothing here is measured at the size it
predicts: every figure but this device's free memory is predicted, and says so. On a GPU, `validate=True`
finds the largest batch that really runs a training step by bisection, side by side with the prediction.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn as nn

from ..adapter.adapter import resolve_model
from ..core.budget import ActivationFit, Budget, gib, measure_activations, read_budget, without_oom
from ..core.files import jsonable
from ..core.measure import static_memory
from ..core.precision import PRECISIONS, kept_dtypes, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import Result, run_metadata
from ..core.settings import check_fields, check_switch, device_field, merge, precision_list, progress_field, setting
from ..engine.memory import checkpointed, memory_context, repeated_blocks
from ..engine.step import TrainStep, make_optimizer
from ..models.builtins import DEFAULT_MODEL

# Memory as the driver reports each card (MiB). torch's CUDA context takes CUDA_CONTEXT of it before the
# allocator gets any, and the allocator loses ALLOCATOR_MARGIN of the rest to fragmentation, cuBLAS/cuDNN
# workspaces and rounding: the margin stated with every prediction.
GPUS = {"T4 16 GB": 15360, "L4 24 GB": 23034, "A100 40 GB": 40960, "A100 80 GB": 81920, "H100 80 GB": 81559}
CUDA_CONTEXT = 512 << 20
ALLOCATOR_MARGIN = 0.10
VALIDATE_LIMIT = 1 << 16  # the largest batch validation tries: past it a step of a small model takes long
MARGIN_NOTE = (f"GPU predictions: the card's memory less {CUDA_CONTEXT >> 20} MiB for the CUDA context, then "
               f"{ALLOCATOR_MARGIN:.0%} for the allocator's fragmentation and kernel workspaces")


@dataclass
class FitConfig:
    """What `fit` plans: the sequence length, the precisions (fp32; bf16/fp16 autocast with fp32 master
    weights; bf16-true/fp16-true: everything in the 2-byte type), each also with activation checkpointing, and
    whether to validate by running real steps."""

    seq_len: int | None = setting(None, "tokens per sequence (none: the model's max length)", low=1)
    precisions: tuple = setting(PRECISIONS, "precisions to plan for, e.g. fp32,bf16,fp16,bf16-true")
    checkpointing: bool = setting(True, "also plan each precision with activation checkpointing")
    device: str | torch.device | None = device_field()
    validate: bool | None = setting(None, "find the largest batch that really runs a step, by bisection (default: "
                                          "on a GPU only)")
    progress: bool = progress_field()

    def __post_init__(self):
        self.precisions = precision_list(self.precisions)
        check_switch(self, "checkpointing")
        if self.validate is not None:
            check_switch(self, "validate")
        check_fields(self)


def static_bytes(model: nn.Module, precision=None) -> dict:
    """Weights, gradients and AdamW state (tier_utils' optimizer) of a training step, without allocating:
    AdamW is stepped once on meta copies of the parameters, in `precision`'s weight dtype (None: as they are),
    and its state is counted."""
    dtype = None if precision is None else precision.param_dtype
    holder = nn.Module()
    holder.params = nn.ParameterList([nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype),
                                                   requires_grad=p.requires_grad) for p in model.parameters()])
    optimizer = make_optimizer(holder, 1e-3, 0.1)
    for p in holder.params:
        if p.requires_grad:
            p.grad = torch.empty_like(p)
    optimizer.step()
    return static_memory(holder, optimizer)


@dataclass
class Config:
    """One precision x checkpointing: what a training step holds at batch B, and the largest B that fits."""

    precision: str
    checkpointing: bool
    static: int
    fit: ActivationFit
    recompute_per_token: float  # checkpointing: one block's activations, back during its recompute
    note: str = ""
    recompute_fixed: float = 0.0  # checkpointing: what one block's recompute holds whatever the batch (autocast's
    # low-precision copies of its weights)

    def per_sequence(self, length: int) -> float:
        """Bytes each sequence of the batch adds: saved activations, output gradient, recompute."""
        return self.fit.per_sequence(length) + (self.fit.output_per_token + self.recompute_per_token) * length

    def fixed(self) -> float:
        """Bytes that do not grow with the batch: weights, gradients, optimizer state, the fit's constant."""
        return self.static + self.fit.k + self.recompute_fixed

    def step_bytes(self, batch: int, length: int) -> int:
        return int(self.fixed() + batch * self.per_sequence(length))

    def largest_batch(self, length: int, room: float) -> int:
        per = self.per_sequence(length)
        return max(0, int((room - self.fixed()) // per)) if per > 0 else 0


def gpu_room(total_mib: int) -> float:
    return (total_mib * 2**20 - CUDA_CONTEXT) * (1 - ALLOCATOR_MARGIN)


def device_room(budget: Budget) -> float:
    """What a training step may use here: on a GPU its free memory less the allocator margin, on a CPU the
    safe share of available RAM."""
    return budget.free_bytes * (1 - ALLOCATOR_MARGIN) if budget.device == "cuda" else budget.limit


@dataclass(repr=False)
class FitResult(Result):
    configs: list[Config]
    seq_len: int
    model: dict
    budget: Budget
    metadata: dict
    validated: dict = field(default_factory=dict)  # (precision, checkpointing) -> largest batch that ran a step
    blocks: int = 0  # how many repeated blocks checkpointing wraps

    def largest(self, c: Config, room: float) -> int:
        return c.largest_batch(self.seq_len, room)

    @property
    def table(self) -> pd.DataFrame:
        here = device_room(self.budget)
        rows = []
        for c in self.configs:
            b = self.largest(c, here)
            row = {"precision": c.precision, "checkpointing": "on" if c.checkpointing else "off",
                   "static_gib": c.static / 2**30,
                   "per_sample_gib": c.per_sequence(self.seq_len) / 2**30, "this_device": b}
            row.update({f"{name} (predicted)": self.largest(c, gpu_room(mib)) for name, mib in GPUS.items()})
            row["validated"] = self.validated.get((c.precision, c.checkpointing))
            row["status"] = "PASS" if b >= 1 else "WARN"
            row["detail"] = (f"batch {b} predicted to fit at T={self.seq_len} in {gib(here)} "
                             f"({self.budget.describe()}); activations {c.fit.where()}" + c.note
                             if b >= 1 else f"not even batch 1 fits at T={self.seq_len}: it needs "
                             f"{gib(c.step_bytes(1, self.seq_len))}, {gib(here)} usable here")
            rows.append(row)
        return pd.DataFrame(rows)

    def headline(self) -> str:
        return (f"fit {self.model['model']} ({self.model['parameters']:,} parameters) at T={self.seq_len} on "
                f"{self.metadata['device_name']}: largest training batch per precision; GPU columns predicted "
                f"({MARGIN_NOTE})")

    def overview(self) -> pd.DataFrame:
        return self.table.drop(columns=["detail"])

    def summary_line(self) -> str:
        """One line for `all`'s summary: the largest batch here per precision, and on a T4 (predicted)."""
        t = self.table
        off = t[t.checkpointing == "off"]
        here = ", ".join(f"{p} {b}" for p, b in zip(off.precision, off.this_device))
        t4 = next(iter(GPUS))
        on_t4 = ", ".join(f"{p} {b}" for p, b in zip(off.precision, off[f"{t4} (predicted)"]))
        return (f"fit: largest training batch at T={self.seq_len} here {here} (predicted, {self.budget.describe()}); "
                f"{t4} predicted {on_t4}; with activation checkpointing: fit.csv")

    def to_json(self) -> dict:
        return jsonable({"status": self.status, "seq_len": self.seq_len, "model": self.model,
                         "budget": self.budget.to_dict(), "margin": MARGIN_NOTE, "gpus_mib": GPUS,
                         "checkpointed_blocks": self.blocks, "table": self.table,
                         "configs": [{"precision": c.precision, "checkpointing": c.checkpointing, "static_bytes":
                                      c.static, "activation_fit": c.fit, "recompute_per_token": c.recompute_per_token,
                                      "recompute_fixed": c.recompute_fixed}
                                     for c in self.configs],
                         "validated": [{"precision": p, "checkpointing": ck, "largest_batch": b}
                                       for (p, ck), b in self.validated.items()], "run_metadata": self.metadata})

    def plot(self):
        from matplotlib.figure import Figure

        t = self.table
        fig = Figure(figsize=(11, 4), layout="constrained")
        ax = fig.add_subplot()
        columns = ["this_device", *(f"{name} (predicted)" for name in GPUS)]
        width = 0.8 / len(t)
        for i, r in enumerate(t.itertuples(index=False)):
            values = [t.iloc[i][c] for c in columns]
            ax.bar([x + i * width for x in range(len(columns))], [max(v, 0.5) for v in values], width,
                   label=f"{r.precision}, checkpointing {r.checkpointing}")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(columns))],
                      [f"this device\n({self.metadata['device_name'][:20]})",
                       *(name + "\n(predicted)" for name in GPUS)], fontsize=8)
        ax.set(yscale="log", ylabel=f"largest training batch at T={self.seq_len}")
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(self.headline()[:160], fontsize=8)
        return fig


def fit(model=DEFAULT_MODEL, config: FitConfig | dict | None = None, *, model_kwargs: dict | None = None,
        **overrides) -> FitResult:
    """What fits where: for each precision and, with `checkpointing`, each with activation checkpointing, the
    largest training batch at `seq_len` here and predicted on common GPUs. It reads no data.

    model: an nn.Module, an adapter or a load_model spec (`model_kwargs` build it).
    config / overrides: a FitConfig (or dict) and/or its field names as keywords; validate (None: on a GPU
    only): find the largest batch that really runs a training step, by bisection, for each row."""
    cfg = merge(FitConfig, config, overrides, "fit")
    dev = resolve_device(cfg.device)
    adapter = resolve_model(model, **(model_kwargs or {}))
    adapter.model.to(dev)
    budget = read_budget(dev)  # before any probe of ours
    adapter.require_trainable()
    length = adapter.fit_length(cfg.seq_len or adapter.max_len)
    configs, blocks = plan(adapter, cfg.precisions, length, cfg.checkpointing, cfg.progress)
    result = FitResult(configs, length, adapter.summary(), budget, run_metadata(dev), blocks=blocks)
    if cfg.validate or (cfg.validate is None and dev.type == "cuda"):
        for c in configs:
            start = min(VALIDATE_LIMIT, max(1, result.largest(c, device_room(budget))))
            result.validated[(c.precision, c.checkpointing)] = bisect_batch(
                lambda b, c=c: step_runs(adapter, c, b, length), start, VALIDATE_LIMIT)
    return result


def plan(adapter, precisions, length: int, checkpointing: bool = False, progress: bool = False
         ) -> tuple[list[Config], int]:
    """A Config per precision (canonical names) and, with `checkpointing` and repeated blocks to wrap, per
    precision with checkpointing; and how many blocks checkpointing wraps. Measures on the adapter's device."""
    dev = adapter.device
    blocks = len(repeated_blocks(adapter.model))
    combos = [(p, ck) for p in precisions for ck in ((False, True) if checkpointing and blocks else (False,))]
    fits, configs = {}, []
    for p, ck in progress_bar(combos, desc="fit", unit="config", enabled=progress):
        prec = resolve_precision(p, dev, warn=False)
        # A mode the device only emulates is measured as its stand-in (the same bytes per value, the same ops).
        measured_as = prec.measured_as if prec.measured_as and not prec.native else p
        note = "" if measured_as == p else (f"; {p} uses {measured_as}'s measurement (the same ops in another "
                                            f"2-byte type; {p} is emulated here)")
        key = (measured_as, ck)
        if key not in fits:
            stand_in = resolve_precision(measured_as, dev, warn=False)
            context = (lambda meter: checkpointed(adapter.model, meter)) if ck else contextlib.nullcontext
            with kept_dtypes(adapter.model):
                stand_in.convert_module(adapter.model)
                fits[key] = measure_activations(adapter, stand_in, length, context)
        recompute, fixed = 0.0, 0.0
        if ck:  # one block's saved activations come back while it is recomputed
            full, kept = fits[(measured_as, False)], fits[key]
            # Per sequence from the fits' per-sequence parts only: the constants (autocast's weight copies) are
            # held once per recomputed block, not once per sequence. Taking them per sequence made bf16 with
            # checkpointing look bigger than without (issue 32: 13.5k vs 15.8k at T=64 on the default model).
            recompute = max(0.0, (full.per_sequence(length) - kept.per_sequence(length)) / length / blocks)
            fixed = max(0.0, (full.k - kept.k) / blocks)
        configs.append(Config(p, ck, sum(static_bytes(adapter.model, prec).values()), fits[key], recompute, note,
                              fixed))
    return configs, blocks


def step_runs(adapter, config: Config, batch: int, length: int) -> bool:
    """Whether one real training step (forward, backward, AdamW step) at (batch, length) runs without running
    out of memory; whatever it allocated is released."""
    prec = resolve_precision(config.precision, adapter.device, warn=False)
    state = {k: v.detach().clone() for k, v in adapter.model.state_dict().items()}

    def one_step():
        with kept_dtypes(adapter.model):
            prec.convert_module(adapter.model)
            optimizer = make_optimizer(adapter.model, 1e-3, 0.1, prec.adamw_eps)
            with memory_context(adapter.model, config.checkpointing):
                TrainStep(adapter, prec, optimizer)([adapter.example_batch(batch, length)])
        return True

    ran, _ = without_oom(one_step)
    adapter.model.load_state_dict(state)
    adapter.model.zero_grad(set_to_none=True)
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
