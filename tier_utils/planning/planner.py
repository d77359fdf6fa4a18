"""The fit planner: every mode of training (fp32; bf16/fp16 mixed; bf16-true/fp16-true; each with and
without activation checkpointing; LoRA) at the user's batch and length: what its step holds, the largest batch
on this device and predicted for common GPUs, and the cheapest mode that fits on each (`cost_rank`).

A training step holds static bytes (per trainable parameter the precision's static_bytes_per_param(): weights,
gradients, AdamW's two states; LoRA: the frozen base and the adapters) plus the activations autograd saves
(budget.measure_activations: measured at three small sizes under the mode's forward context, fitted,
extrapolated; on the first blocks only where the whole model's probe is over the budget: probe.py) plus,
during backward, the output's gradient. With activation checkpointing the repeated blocks keep only their
inputs, and one block's activations come back while it is recomputed. Nothing here is measured at the size it
predicts: every figure but this device's free memory is predicted, and says so. On a GPU, `validate=True`
finds the largest batch that really runs a training step by bisection, side by side with the prediction.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import pandas as pd
import torch
import torch.nn as nn

from ..adapter.adapter import resolve_model
from ..core.budget import CUDA_CONTEXT, ActivationFit, Budget, gib, read_budget
from ..core.device import GPU_PROFILES, DeviceFacts, predicted_facts
from ..core.files import jsonable
from ..core.measure import static_memory
from ..core.memory_settings import DecidedMemory, LoraSettings, lora_setting
from ..core.optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, AdamW8bit, Optimizer, canonical_optimizer
from ..core.precision import BASELINE, PRECISIONS, Precision, dtype_name, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import Result, run_metadata
from ..core.settings import check_fields, check_switch, device_field, merge, precision_list, progress_field, setting
from ..core.threads import chooses_threads
from ..data.chat_formats import ChatOptions
from ..data.collate import LongestBatch
from ..engine.activation_checkpointing import repeated_blocks
from ..engine.step import make_optimizer
from ..models.builtins import DEFAULT_MODEL
from .memory_rows import memory_rows, mode_static_bytes, quantized_bytes
from .probe import size_probe
from .validation import VALIDATE_CHOICES, VALIDATE_LIMIT, Validation, validate

# The GPU columns: core.device's cards (memory as the driver reports it, capability), by the name they are sold
# by. torch's CUDA context takes CUDA_CONTEXT of a card before the allocator gets any, and the allocator loses
# ALLOCATOR_MARGIN of the rest to fragmentation, cuBLAS/cuDNN workspaces and rounding: the margin stated with
# every prediction.
GPU_COLUMNS = {f"{card.label} (predicted)": card for card in GPU_PROFILES.values()}
ALLOCATOR_MARGIN = 0.10
MARGIN_NOTE = (f"GPU predictions: the card's memory less {CUDA_CONTEXT >> 20} MiB for the CUDA context, then "
               f"{ALLOCATOR_MARGIN:.0%} for the allocator's fragmentation and kernel workspaces")


@dataclass
class FitConfig:
    """What `fit` plans: the batch and length, the precisions (fp32; bf16/fp16 autocast with fp32 master
    weights; bf16-true/fp16-true: everything in the 2-byte type), each also with activation checkpointing, LoRA
    over fp32 and the mixed ones, and whether to validate by running real steps."""

    batch_size: int = setting(8, "sequences per training step the plan is for", low=1)
    seq_len: int | None = setting(None, "tokens per sequence (none: the model's max length)", low=1)
    target_len: int | None = setting(None, "an encoder-decoder's target tokens per pair, counted apart from its "
                                           "source's length (none: as many as the source)", low=1)
    precisions: tuple = setting(PRECISIONS, "precisions to plan for, e.g. fp32,bf16,fp16,bf16-true")
    checkpointing: bool = setting(True, "also plan each precision with activation checkpointing")
    lora: LoraSettings | None = setting(LoraSettings(), "LoRA to plan over a frozen base: fp32 (under fp32), fp16 "
                                                        "and bf16 (under their mixed precision) and 4-bit NF4 (QLoRA): "
                                                        "r=N,alpha=X[,targets=...] (0: none)")
    optimizers: tuple = setting((DEFAULT_OPTIMIZER.name, AdamW8bit.name),
                                f"optimizers to plan, each over the fp32 weights' modes and LoRA: "
                                f"{', '.join(OPTIMIZERS)} (8-bit: bitsandbytes' moments)")
    device: str | torch.device | None = device_field()
    validate: str | bool | None = setting(None, "find the largest batch that really runs a step, by bisection: on "
                                                "(the recommended mode and fp32), all (every mode), off (none: on "
                                                "on a GPU, off elsewhere)", choices=VALIDATE_CHOICES)
    validate_seconds: float = setting(60.0, "validation's time cap: the rows left after it stay predicted", above=0)
    progress: bool = progress_field()
    chat: ChatOptions = setting(factory=ChatOptions)  # how the data's chat rows are read

    def __post_init__(self):
        self.precisions = precision_list(self.precisions)
        self.lora = lora_setting(self.lora)
        self.optimizers = tuple(o.strip() for o in (self.optimizers.split(",") if isinstance(self.optimizers, str)
                                                    else self.optimizers) if o.strip())
        if not self.optimizers:
            raise ValueError(f"optimizers: none given; plan one or more of {', '.join(OPTIMIZERS)}")
        self.optimizers = tuple(dict.fromkeys(canonical_optimizer(o) for o in self.optimizers))
        check_switch(self, "checkpointing")
        if isinstance(self.validate, bool):  # the API's True/False: on/off
            self.validate = "on" if self.validate else "off"
        if self.validate is not None and self.validate not in VALIDATE_CHOICES:
            raise ValueError(f"validate must be one of {', '.join(VALIDATE_CHOICES)} (or True/False), "
                             f"got {self.validate!r}")
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
class ModeRow:
    """One precision x checkpointing: what a training step holds at batch B, and the largest B that fits."""

    precision: str
    checkpointing: bool
    static: int
    fit: ActivationFit
    recompute_per_token: float  # checkpointing: one block's activations, back during its recompute
    note: str = ""
    recompute_fixed: float = 0.0  # checkpointing: what one block's recompute holds whatever the batch (autocast's
    # low-precision copies of its weights)
    memory: DecidedMemory | None = None  # LoRA's adapters and their base, the optimizer (None: full, AdamW)
    mode: Precision | None = None  # the precision decided here: its dtypes, its hardware rule
    parameters: int = 0  # the model's: static bytes per parameter divide by it
    target_len: int | None = None  # an encoder-decoder's target length planned (None: the source's, as train runs)

    @property
    def lora(self) -> LoraSettings | None:
        return self.memory.lora if self.memory is not None else None

    @property
    def optimizer(self) -> type[Optimizer]:
        return self.memory.optimizer if self.memory is not None else DEFAULT_OPTIMIZER

    @property
    def name(self) -> str:
        """The mode in words, the table's index: e.g. "bf16-true + checkpointing", "LoRA r=8 · fp16 base · fp16 ·
        AdamW8bit"."""
        name = self.precision
        if self.lora is not None:
            base = "nf4" if self.memory.quantized else dtype_name(self.memory.base_dtype)
            name = f"{'QLoRA' if self.memory.quantized else 'LoRA'} r={self.lora.r} · {base} base · {name}"
        if self.optimizer is not DEFAULT_OPTIMIZER:
            name += f" · {self.optimizer.label}"
        return name + (" + checkpointing" if self.checkpointing else "")

    @property
    def bytes_per_param(self) -> float:
        """Static bytes (weights, gradients, optimizer state) per parameter of the model."""
        return self.static / self.parameters if self.parameters else float("nan")

    def per_sequence(self, length: int) -> float:
        """Bytes each sequence of the batch adds: saved activations, output gradient (over the target positions of
        an encoder-decoder), recompute."""
        return (self.fit.per_sequence(length, self.target_len) + self.fit.transient(1, length, self.target_len)
                + self.recompute_per_token * length)

    def fixed(self) -> float:
        """Bytes that do not grow with the batch: weights, gradients, optimizer state, the fit's constant."""
        return self.static + self.fit.k + self.recompute_fixed

    def step_bytes(self, batch: int, length: int) -> int:
        return int(self.fixed() + batch * self.per_sequence(length))

    def largest_batch(self, length: int, room: float) -> int:
        per = self.per_sequence(length)
        return max(0, int((room - self.fixed()) // per)) if per > 0 else 0


def gpus_mib() -> dict[str, int]:
    """Each GPU column's card memory (MiB), for a result's JSON."""
    return {card.label: card.memory_mib for card in GPU_PROFILES.values()}


def gpu_room(total_mib: int) -> float:
    return (total_mib * 2**20 - CUDA_CONTEXT) * (1 - ALLOCATOR_MARGIN)


def device_room(budget: Budget) -> float:
    """What a training step may use here: on a GPU its free memory less the allocator margin, on a CPU the
    safe share of available RAM."""
    return budget.free_bytes * (1 - ALLOCATOR_MARGIN) if budget.device == "cuda" else budget.limit


def cost_rank(c: ModeRow, facts: DeviceFacts | None = None) -> tuple:
    """Where mode `c` stands among the modes that fit on `facts`' hardware (None: where it was decided), cheapest
    first (docs/precision.md, "How fit chooses a mode"): what it costs the training first (the recompute of
    checkpointing, 1; the precision's `accuracy_cost`; the memory settings', LoRA's and the optimizer's), then the
    precision's speed there, no loss scaler before one, the wider range first (Precision.cost_rank)."""
    accuracy, *rest = c.mode.cost_rank(facts)
    memory = c.memory.accuracy_cost if c.memory is not None else 0
    return (accuracy + c.checkpointing + memory, *rest)


@dataclass(repr=False, frozen=True)
class FitResult(Result):
    configs: list[ModeRow]
    seq_len: int
    model: dict
    budget: Budget
    metadata: dict
    validation: Validation = field(default_factory=Validation)  # what ran a real step, and what stayed predicted
    blocks: int = 0  # how many repeated blocks checkpointing wraps
    batch_size: int = 1  # the batch the plan is for
    # precision -> its step's Speedup over fp32 measured on this device in the same run (the AMP benchmark's, in
    # `all`; fp32: None, the baseline); None: this device's fastest is predicted, as every GPU's is.
    measured_speedups: dict | None = None
    speed_source: str = ""  # where measured_speedups were measured, in words
    target_len: int | None = None  # an encoder-decoder's target length, counted apart (None: one length)
    length_words: str = ""  # the length axis where it is not tokens (an image model's resolution and its tokens)
    # fit(data=...): the longest batch the data makes, which the plan is at (None: the length asked, no data read)
    from_data: LongestBatch | None = None

    def lengths(self) -> str:
        """The planned length in words: T (an image model's resolution and its tokens), and an encoder-decoder's
        target length where it was given apart."""
        return (f"T={self.seq_len}" + (f" ({self.length_words})" if self.length_words else "")
                + (f", target {self.target_len}" if self.target_len else ""))

    def data_words(self) -> str:
        """"; planned at T=120, the longest batch the data makes (...)" where the plan was sized to data, else ""."""
        return f"; planned at {self.from_data.describe()}" if self.from_data else ""

    def largest(self, c: ModeRow, room: float) -> int:
        return c.largest_batch(self.seq_len, room)

    def devices(self) -> dict[str, tuple[float, DeviceFacts | None]]:
        """Device column -> (the room a training step may use, the hardware: None here, where each mode was
        decided; a GPU's predicted facts)."""
        gpus = {column: (gpu_room(card.memory_mib), predicted_facts(card)) for column, card in GPU_COLUMNS.items()}
        return {"this_device": (device_room(self.budget), None), **gpus}

    def _fitting(self, room: float, facts: DeviceFacts | None) -> list[ModeRow]:
        """The modes that run on a device (natively, or emulated where the mode allows) and fit the batch asked."""
        return [c for c in self.configs
                if c.mode.runs_here(facts) and c.step_bytes(self.batch_size, self.seq_len) <= room]

    def cheapest(self) -> dict[str, ModeRow | None]:
        """Device column -> the cheapest mode that fits the batch asked there (None: none does)."""
        return {column: min(self._fitting(room, facts), key=lambda c, f=facts: cost_rank(c, f), default=None)
                for column, (room, facts) in self.devices().items()}

    def fastest(self) -> dict[str, ModeRow | None]:
        """Device column -> the fastest mode that fits the batch asked there (None: none does, or none measured
        faster). Here, where the run measured speedups: the fastest of the precision modes (no checkpointing, no
        LoRA) measurably faster than fp32 (the benchmark's rule, `Speedup.measurably_faster`). Elsewhere predicted:
        no recompute before checkpointing's, then the precision's speed (Precision.speed_rank), then a full
        fine-tune before LoRA and QLoRA (cost_rank's order), so wherever a mode fits, a fastest does."""
        picked = {}
        for column, (room, facts) in self.devices().items():
            measured = self.measured_speedups if column == "this_device" else None
            fitting = self._fitting(room, facts)
            if measured:
                faster = [c for c in fitting if c.lora is None and not c.checkpointing
                          and measured.get(c.precision) is not None and measured[c.precision].measurably_faster]
                picked[column] = min(faster, key=lambda c, m=measured: -m[c.precision].median, default=None)
            else:
                picked[column] = min(fitting, default=None, key=lambda c, f=facts: (
                    c.checkpointing, c.mode.speed_rank(f), cost_rank(c, f)))
        return picked

    def with_measured_speedups(self, speedups: dict, source: str) -> FitResult:
        """This plan with this device's fastest mode read from `speedups` (precision -> its step's Speedup over
        fp32, fp32 None), measured as `source` says; an empty `speedups` leaves it predicted."""
        return replace(self, measured_speedups=dict(speedups) or None, speed_source=source if speedups else "")

    def full_table(self) -> pd.DataFrame:
        """Every column (fit.csv): the table's, and static and activation bytes, validation and the detail."""
        B, T, here = self.batch_size, self.seq_len, device_room(self.budget)
        cheapest = self.cheapest()
        rows = []
        for c in self.configs:
            row = {"mode": c.name, "precision": c.precision, "checkpointing": "on" if c.checkpointing else "off",
                   "lora": f"r={c.lora.r}" if c.lora else "off", "step_gib": c.step_bytes(B, T) / 2**30}
            for column, (room, facts) in self.devices().items():
                row[column] = self.largest(c, room) if c.mode.runs_here(facts) else None
            row["cheapest_on"] = ", ".join(col.replace(" (predicted)", "") for col, p in cheapest.items()
                                           if p is c) or None
            fits = c.step_bytes(B, T) <= here
            runs_here = c.mode.runs_here()  # a true mode is refused where only emulated
            row["status"] = "SKIP" if not runs_here else "PASS" if fits else "WARN"
            row.update({"bytes_per_param": c.bytes_per_param, "static_gib": c.static / 2**30,
                        "activation_gib": (c.step_bytes(B, T) - c.static) / 2**30,
                        "per_sample_gib": c.per_sequence(T) / 2**30,
                        "validated": self.validation.found.get(c.name),
                        "validation": self.validation.describe(c.name)})
            b = row["this_device"] or 0
            row["detail"] = ("" if runs_here else f"does not run here ({c.mode.reason}); ") + (
                             f"B={B}, {self.lengths()} predicted {gib(c.step_bytes(B, T))} (static {gib(c.static)}, "
                             f"{c.bytes_per_param:.2f} bytes per parameter); "
                             + (f"fits in {gib(here)} ({self.budget.describe()}); largest batch {b}" if fits else
                                f"over the {gib(here)} usable here; largest batch {b}" if b >= 1 else
                                f"not even batch 1 fits at {self.lengths()}: it needs {gib(c.step_bytes(1, T))}")
                             + f"; activations {c.fit.where()}" + c.note)
            rows.append(row)
        table = pd.DataFrame(rows)
        # Whole numbers, with SKIP rows' "none" as <NA>: a None among ints would make the column floats (1.193e+04).
        batches = [*self.devices(), "validated"]
        return table.astype(dict.fromkeys(batches, "Int64"))

    @property
    def table(self) -> pd.DataFrame:
        """Modes as rows (indexed by the mode), at most 12 columns; the rest in full_table() (fit.csv). The lora
        column is left out: the mode's name says it ("LoRA r=8 · bf16"), and six GPU columns need its place."""
        return self.full_table().set_index("mode").drop(columns=["lora"]).iloc[:, :12]

    def headline(self) -> str:
        return (f"fit {self.model['model']} ({self.model['parameters']:,} parameters) at B={self.batch_size}, "
                f"{self.lengths()} on {self.metadata['device_name']}: every mode's step (predicted) and largest "
                f"batch; GPU columns predicted ({MARGIN_NOTE}); measured with probes sized to "
                f"{self.budget.describe()}{self.data_words()}")

    # The overview's columns about this device; the rest are the GPUs' (predicted), each headed by the card.
    HERE_COLUMNS = ("status", "step GiB", "here", "validated")

    def overview(self) -> pd.DataFrame:
        """What a notebook shows and the CLI prints: indexed by mode (its name says its precision, checkpointing and
        LoRA), HERE_COLUMNS (its verdict, its step in GiB predicted, the largest batch here, what validation found),
        then the largest batch on each GPU, headed by the card alone (the headline says they are predicted).
        Every column, the cheapest per device and the details: full_table() (fit.csv, --json)."""
        t = self.full_table().set_index("mode")
        gpus = [c for c in self.devices() if c != "this_device"]
        shown = t[["status", "step_gib", "this_device", "validated", *gpus]]
        return shown.set_axis([*self.HERE_COLUMNS, *(c.replace(" (predicted)", "").replace(" GB", "") for c in gpus)],
                              axis=1)

    def summary_line(self) -> str:
        """One line: the cheapest and the fastest mode that fit here (the fastest measured where the run measured
        it), and on each GPU (predicted)."""
        cheapest, fastest = self.cheapest(), self.fastest()
        gpus = "; ".join(f"{col.replace(' (predicted)', '')} {_named(cheapest[col])} / {_named(fastest[col])}"
                         for col in cheapest if col != "this_device")
        return (f"fit at B={self.batch_size}, {self.lengths()}: cheapest mode that fits here "
                f"{_named(cheapest['this_device'])} (predicted, {self.budget.describe()}); "
                f"{self._fastest_here(fastest['this_device'], cheapest['this_device'])}; cheapest / fastest "
                f"predicted on {gpus}{self.data_words()}")

    def _fastest_here(self, here: ModeRow | None, cheapest: ModeRow | None) -> str:
        """"fastest here bf16: 1.45× fp32, IQR range 1.30–1.60×, measured ...", or that no mode was measurably
        faster (the closest one's speedup and its range), or predicted."""
        measured, source = self.measured_speedups, self.speed_source
        if not measured:
            return f"fastest here {_named(here)} (predicted)"
        if here is not None:
            return f"fastest here {here.name}: {measured[here.precision].describe(BASELINE)}, measured {source}"
        if cheapest is None:
            return "fastest here none fits"
        ran = {p: sp for p, sp in measured.items() if sp is not None}
        best = max(ran, key=lambda p: ran[p].median, default=None)
        closest = f"closest: {best} {ran[best].describe(BASELINE)}" if best else "no other mode ran"
        return f"no mode was measurably faster here ({closest}, measured {source})"

    @property
    def verdict(self) -> str:
        """fit's verdict: PASS when the batch asked fits here in some mode, WARN when none does."""
        return "PASS" if self.cheapest()["this_device"] else "WARN"

    def to_json(self) -> dict:
        return jsonable({"status": self.status, "batch_size": self.batch_size, "seq_len": self.seq_len,
                         "target_len": self.target_len, "length": self.length_words,
                         "from_data": self.from_data and self.from_data.to_dict(),
                         "model": self.model, "budget": self.budget.to_dict(), "margin": MARGIN_NOTE,
                         "gpus_mib": gpus_mib(), "checkpointed_blocks": self.blocks,
                         "cheapest": {k: c.name if c else None for k, c in self.cheapest().items()},
                         "fastest": {k: c.name if c else None for k, c in self.fastest().items()},
                         "measured_speedups": self.measured_speedups and {
                             p: sp and asdict(sp) for p, sp in self.measured_speedups.items()},
                         "speed_source": self.speed_source,
                         "table": self.full_table(),
                         "configs": [{"mode": c.name, "precision": c.precision, "checkpointing": c.checkpointing,
                                      "lora": c.lora.to_dict() if c.lora else None, "static_bytes": c.static,
                                      "memory": c.memory.to_dict() if c.memory else None,
                                      "bytes_per_param": c.bytes_per_param,
                                      "activation_fit": c.fit, "recompute_per_token": c.recompute_per_token,
                                      "recompute_fixed": c.recompute_fixed} for c in self.configs],
                         "validated": [{"mode": m, "largest_batch": b} for m, b in self.validation.found.items()],
                         "validation_seconds": self.validation.seconds,
                         "run_metadata": self.metadata})

    def plot(self):
        from .fit_plot import plot_fit

        return plot_fit(self)


def _named(c: ModeRow | None) -> str:
    return c.name if c else "none fits"


@chooses_threads  # the run's torch thread count, chosen as it starts
def fit(model=DEFAULT_MODEL, config: FitConfig | dict | None = None, *, data=None, model_kwargs: dict | None = None,
        **overrides) -> FitResult:
    """What fits where, and what it costs: every mode (each precision, each also with activation checkpointing,
    and LoRA) at `batch_size` x `seq_len`: its training step's bytes (predicted), the largest batch here and on
    common GPUs (predicted), and the cheapest mode that fits on each.

    data: None (no data read: the plan is at seq_len) or anything `train` takes: then the plan is at the longest
    batch that data makes at seq_len (each batch is padded to its longest row), and the result says so.

    model: an nn.Module, an adapter or a load_model spec (`model_kwargs` build it).
    config / overrides: a FitConfig (or dict) and/or its field names as keywords; validate (None: on a GPU
    only): find the largest batch that really runs a training step, by bisection, for the recommended mode and
    fp32 ("all": every row but LoRA's), for at most `validate_seconds` (validation.py)."""
    cfg = merge(FitConfig, config, overrides, "fit")
    dev = resolve_device(cfg.device)
    adapter = resolve_model(model, **(model_kwargs or {}))
    adapter.model.to(dev)
    budget = read_budget(dev)  # before any probe of ours
    adapter.require_trainable()
    length, target = adapter.fit_length(cfg.seq_len or adapter.max_len), adapter.target_length(cfg.target_len)
    from_data = adapter.longest_batch(data, length, target, cfg.chat) if data is not None else None
    if from_data is not None:  # the batches are cut to the data: its longest one is what must fit
        length, target = from_data.length, target if from_data.target is None else from_data.target
    configs, blocks = plan(adapter, cfg.precisions, length, cfg.checkpointing, cfg.progress, cfg.lora, budget,
                           cfg.optimizers, target)
    predicted = FitResult(configs, length, adapter.summary(), budget, run_metadata(dev), blocks=blocks,
                          batch_size=cfg.batch_size, target_len=target,
                          length_words=adapter.task.describe_length(adapter, length), from_data=from_data)
    asked = cfg.validate or ("on" if dev.type == "cuda" else "off")
    if asked == "off":
        return predicted
    runs = {c.name for c in configs if c.mode.runs_here()}
    chosen = runs if asked == "all" else _recommended_and_baseline(predicted) & runs
    # The predicted plan picks what to validate and where each bisection starts; the result is that plan with what
    # validation found, a new one, complete.
    room = device_room(budget)
    return replace(predicted, validation=validate(
        adapter, configs, chosen, length, lambda c: min(VALIDATE_LIMIT, max(1, predicted.largest(c, room))),
        cfg.validate_seconds, cfg.progress))


def _recommended_and_baseline(result: FitResult) -> set[str]:
    """The modes validation checks by default: the one recommended here (the cheapest that fits) and fp32's."""
    recommended = result.cheapest()["this_device"]
    baseline = next((c for c in result.configs if c.precision == BASELINE and not c.checkpointing and c.lora is None),
                    None)
    return {c.name for c in (recommended, baseline) if c is not None}


def plan(adapter, precisions, length: int, checkpointing: bool = False, progress: bool = False,
         lora: LoraSettings | None = None, budget: Budget | None = None,
         optimizers: tuple = (DEFAULT_OPTIMIZER.name,), target_len: int | None = None) -> tuple[list[ModeRow], int]:
    """A ModeRow per precision (canonical names) and, with `checkpointing` and repeated blocks to wrap, per
    precision with checkpointing; with `lora`, LoRA over each base (`memory_rows`); with adamw8bit among
    `optimizers`, the fp32-weight modes and LoRA again with 8-bit optimizer state; and how many blocks
    checkpointing wraps; `target_len`: an encoder-decoder's target length, counted apart (None: the source's).
    Measures on the adapter's device, each (measured precision, checkpointing) once, with
    probes sized to `budget` (None: the device's free memory now; see probe.py). The model is given back bit
    for bit."""
    dev = adapter.device
    blocks = len(repeated_blocks(adapter.model))
    switches = (False, True) if checkpointing and blocks else (False,)
    decided = [resolve_precision(p, dev, warn=False) for p in precisions]
    combos = [(prec, ck, memory) for prec, memory in memory_rows(adapter.model, decided, lora, optimizers)
              for ck in switches]
    # A mode the device only emulates is measured as its stand-in (the same bytes per value, the same ops).
    stand_ins = {p.name: resolve_precision(p.measured_as if p.measured_as and not p.native else p.name, dev,
                                           warn=False) for p in decided}
    probe = size_probe(adapter, list(stand_ins.values()), length, budget or read_budget(dev), target_len)
    # bitsandbytes (seconds to import) measures NF4's bytes only where a QLoRA row needs them.
    quantized = quantized_bytes() if any(m is not None and m.quantized for _, _, m in combos) else None
    parameters = sum(p.numel() for p in adapter.model.parameters())
    configs = []
    for prec, ck, memory in progress_bar(combos, desc="fit", unit="config", enabled=progress):
        p, stand_in = prec.name, stand_ins[prec.name]
        note = "" if stand_in.name == p else (f"; {p} uses {stand_in.name}'s measurement (the same ops in "
                                              f"another 2-byte type; {p} is emulated here)")
        if memory is not None and memory.lora is not None:
            note += ("; activations: the full model's (an upper bound: a frozen layer keeps no input for a weight "
                     "gradient, the adapters' own are small)")
        note += probe.note()
        recompute, fixed = 0.0, 0.0
        measured = probe.fit(adapter, stand_in, length, ck)
        if ck:  # one block's saved activations come back while it is recomputed
            full, kept = probe.fit(adapter, stand_in, length, False), measured
            # Per sequence from the fits' per-sequence parts only: the constants (autocast's weight copies) are
            # held once per recomputed block, not once per sequence. Taking them per sequence made bf16 with
            # checkpointing look bigger than without (issue 32: 13.5k vs 15.8k at T=64 on the default model).
            recompute = max(0.0, (full.per_sequence(length, target_len) - kept.per_sequence(length, target_len))
                            / length / blocks)
            fixed = max(0.0, (full.k - kept.k) / blocks)
        static = mode_static_bytes(adapter.model, prec, memory, quantized, adapter.task)
        configs.append(ModeRow(p, ck, static, measured, recompute, note, fixed, memory, prec, parameters, target_len))
    return configs, blocks


