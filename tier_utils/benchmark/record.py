"""The AMP benchmark's records: per precision x mode the `Plan` a run measures, what it `Measured`, and the
`PrecisionRecord` they become (one entry of the JSON's "precisions", one row of `.table`) with its `Speed`; per run
the `BenchRun` (the JSON's "config") with its `BatchFit`, and its `OutcomeLog` of `Outcome`s (the result's
`outcomes`); and the frozen records a run's steps hand on (`Sized`, `Loaded`, `Ready`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from ..core.budget import Budget
from ..core.measure import Stats, probe_summary
from ..core.memory_settings import DecidedMemory, memory_setting
from ..core.precision import Precision
from ..core.results import run_metadata
from ..data.datasets import DataDescription
from ..engine.compiling import CompileInfo
from .config import BenchConfig, Mode, Thresholds
from .verdicts import Speedup, parity, reduction, speedup

MIB = 2**20


@dataclass(frozen=True)
class Speed:
    """One precision x mode's timed repeats and, once compared, its ratios."""

    step_ms: Stats  # over the repeats' mean timed steps
    tokens_per_s: Stats
    samples_ms: list[float]  # each repeat's mean timed step, in the order they ran
    timed_steps: int  # per repeat
    speedup: Speedup | None = None  # against the baseline; None for the baseline itself
    speedup_vs_eager: Speedup | None = None  # against the same precision eager: compiled rows only

    def to_dict(self) -> dict:
        return {**asdict(self), "step_ms": self.step_ms.to_dict(), "tokens_per_s": self.tokens_per_s.to_dict()}


@dataclass(frozen=True)
class BatchFit:
    """How the fit planner (predicted) sized the benchmark's batch to this device."""

    batch_size_asked: int
    largest_batch_predicted: dict[str, int]  # precision -> the largest batch a training step fits here
    room_bytes: float  # what a training step may use here
    budget: Budget
    reason: str | None  # why the run's batch is smaller than the one asked; None: it is the one asked

    def to_dict(self) -> dict:
        return {**asdict(self), "budget": self.budget.to_dict()}


@dataclass(frozen=True)
class BenchRun:
    """What a benchmark ran: the model, its data, the settings as run (the batch every compared precision fits,
    the length capped at the model's) and one step's tokens."""

    model: str
    task: str
    parameters: int
    described: DataDescription
    settings: BenchConfig
    tokens_per_step: float  # real tokens, the mean over the timed batches
    fit: BatchFit
    lora: dict | None = None  # engine.lora.describe_lora of the model every row trained (None: no LoRA)
    # The share of the speed batches' positions that was padding (data.collate.PaddingTally.to_dict; None: not
    # counted), the same for every row: each times the same batches.
    padding: dict | None = None

    def to_dict(self) -> dict:
        """The JSON's "config": the data's and the settings' fields flat beside the model's."""
        return {"model": self.model, "task": self.task, "parameters": self.parameters, **self.described.to_dict(),
                **self.settings.to_dict(), "tokens_per_step": self.tokens_per_step, "fit": self.fit.to_dict(),
                "lora_detail": self.lora, "padding": self.padding}


# The steps of a benchmark run (amp.py's BenchmarkRun, a method each) that can skip or stop a plan, in order.
Step = Literal["plan", "fit", "compile", "flops", "memory", "time", "accuracy"]


@dataclass(frozen=True)
class Outcome:
    """One entry of a benchmark run's log: at `step`, precision x mode was skipped (it runs no further step; the
    last skip's reason is its SKIP rows' detail) or stopped (a non-finite loss: no verdict but that), and why."""

    precision: str
    mode: Mode
    step: Step
    status: Literal["skipped", "stopped"]
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


class OutcomeLog:
    """A benchmark run's outcomes, append-only: `skip` and `stop` add one, nothing edits one. A plan runs until
    it is skipped; its skip reason is its last skip's, its stop reason its last stop's."""

    def __init__(self):
        self._outcomes: list[Outcome] = []

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return tuple(self._outcomes)

    def skip(self, p: Plan, step: Step, why: str) -> None:
        self._add(Outcome(p.name, p.mode, step, "skipped", why))

    def stop(self, p: Plan, step: Step, why: str) -> None:
        self._add(Outcome(p.name, p.mode, step, "stopped", why))

    def _add(self, outcome: Outcome) -> None:
        self._outcomes.append(outcome)  # the one place the log grows

    def last(self, p: Plan, status: str) -> Outcome | None:
        return next((o for o in reversed(self._outcomes)
                     if o.status == status and o.precision == p.name and o.mode == p.mode), None)

    def runs(self, p: Plan) -> bool:
        return self.last(p, "skipped") is None

    def skip_reason(self, p: Plan) -> str | None:
        last = self.last(p, "skipped")
        return last and last.why

    def stopped(self, p: Plan) -> str | None:
        last = self.last(p, "stopped")
        return last and last.why


@dataclass(frozen=True, eq=False)  # a plan is itself: two are never equal by value
class Plan:
    """One precision x mode: how it runs. Whether it still runs, and why not, is in the run's log of `Outcome`s;
    what it measured is its `Measured`."""

    name: str
    mode: Mode
    precision: Precision
    adapter: object  # what the steps call: the compiled model where compiling worked
    forced: bool = False
    compile: CompileInfo | None = None  # once compiled (or the reason it could not be)
    batches: tuple | None = None  # its own speed batches (the floor step's); None: the shared ones
    checkpointing: bool = False  # its steps run with activation checkpointing (engine/activation_checkpointing.py)
    memory_row: str | None = None  # a memory row's name (BenchConfig.memory_rows, benchmark/memory_rows.py)
    memory: DecidedMemory | None = None  # that row's memory settings decided, held while it runs (None: the run's)
    start: dict | None = None  # its own model's start (a LoRA row's adapters); None: the run's model and start


@dataclass(frozen=True)
class Measured:
    """What one plan measured, raw: the memory step's split and probe size, the time step's repeats (each
    repeat's mean timed step, the peak probe's matmuls) and speed, the accuracy step's run. Each step returns
    a new one with its own fields; None/empty: not measured (skipped or stopped before that step)."""

    plan: Plan
    memory: dict | None = None
    probe_size: int | None = None
    step_samples: tuple[float, ...] = ()  # mean timed step (ms) of each repeat
    probe_ms: tuple[float, ...] = ()
    speed: Speed | None = None
    accuracy: dict | None = None


@dataclass(frozen=True)
class Sized:
    """Step "fit"'s answer: the plans, the baseline first, and the settings as run (the batch every compared
    precision fits here, the length capped at the model's)."""

    plans: tuple[Plan, ...]
    cfg: BenchConfig
    fit: BatchFit


@dataclass(frozen=True)
class Loaded:
    """Step "load"'s answer: the splits, the same speed batches for every plan (and their tokens), the fp32 start
    every run loads, and the floor plan (its own short batches)."""

    splits: object
    speed_batches: tuple
    tokens_per_step: float  # real tokens, the mean over the timed batches
    start: dict
    floor: Plan
    padding: dict | None = None  # the speed batches' padding share (data.collate.PaddingTally.to_dict)


@dataclass(frozen=True)
class Ready:
    """What the measuring steps share: step "compile"'s plans (the baseline first) and the ones it left running,
    the settings as run, the batch's sizing and the data."""

    plans: tuple[Plan, ...]
    measured: tuple[Plan, ...]
    cfg: BenchConfig
    fit: BatchFit
    data: Loaded

    @property
    def base(self) -> Plan:
        """The baseline every ratio is taken against: fp32, or the best-fitting mode when fp32 does not fit."""
        return self.plans[0]


@dataclass
class PrecisionRecord:
    """What one precision x mode measured, with its comparisons against the baseline."""

    precision: str
    mode: Mode
    dtype: str
    native: bool
    ran: bool
    forced: bool
    reason: str  # the precision policy's reason (Precision.reason)
    compile: CompileInfo | None
    metadata: dict
    speed: Speed | None = None
    mfu: dict | None = None
    memory: dict | None = None
    accuracy: dict | None = None
    stopped: str | None = None
    weights: str | None = None  # the precision's statement: stored dtype -> what this row holds the weights in
    checkpointing: bool = False
    # Checkpointing rows: against the same precision without it (step time ratio, activation bytes).
    vs_without: dict | None = None
    memory_row: str | None = None  # a memory row's name; None: a precision row, under the run's memory
    memory_settings: dict | None = None  # a memory row's settings (decided where it ran), with "describe"

    def to_dict(self) -> dict:
        return {**asdict(self), "speed": None if self.speed is None else self.speed.to_dict()}

    def table_row(self) -> dict:
        speed, mfu, mem, acc = self.speed, self.mfu or {}, self.memory or {}, self.accuracy or {}
        step, tps = (speed.step_ms.to_dict(), speed.tokens_per_s.to_dict()) if speed else ({}, {})
        sp, vs_eager = (speed.speedup, speed.speedup_vs_eager) if speed else (None, None)
        red, par = mem.get("reduction", {}), acc.get("parity") or {}
        def mib(key):
            return mem[key] / MIB if mem.get(key) is not None else None

        return {
            "precision": self.precision, "mode": self.mode, "dtype": self.dtype, "ran": self.ran,
            "n_repeats": step.get("n"), "step_ms_median": step.get("median"), "step_ms_iqr": step.get("iqr"),
            "tokens_per_s_median": tps.get("median"), "tokens_per_s_iqr": tps.get("iqr"),
            "speedup": sp.median if sp else 1.0 if self.ran else None,  # ran with no speedup: the baseline
            "speedup_low": sp and sp.low, "speedup_high": sp and sp.high,
            "speedup_vs_eager": vs_eager and vs_eager.median,
            "checkpointing": "on" if self.checkpointing else "off",
            "compile_s": self.compile.compile_s if self.compile else None,
            "achieved_tflops": mfu.get("achieved_tflops"),
            "peak_tflops": mfu.get("peak_tflops"), "mfu": mfu.get("mfu"), "weights_mib": mib("weights_bytes"),
            "grads_mib": mib("grads_bytes"), "optimizer_state_mib": mib("optimizer_state_bytes"),
            "activations_mib": mib("activation_bytes"), "total_mib": mib("total_bytes"),
            "peak_allocated_mib": mib("peak_allocated_bytes"), "peak_reserved_mib": mib("peak_reserved_bytes"),
            "static_reduction": red.get("static"), "activation_reduction": red.get("activations"),
            "total_reduction": red.get("total"),
            "peak_allocated_reduction": red.get("peak_allocated"),
            "val_loss": acc.get("val_loss"), "val_accuracy": acc.get("val_accuracy"),
            "val_accuracy_diff": acc.get("val_accuracy_diff"), "parity_max_rel_dev": par.get("max_rel_dev"),
            "parity_first_step_out": par.get("first_step_out"), "skipped_steps": acc.get("skipped_steps"),
            "rounded_away_share": acc.get("rounded_away_share"),
            "weights_dtype": mem.get("weights_dtype"), "weights": self.weights, "reason": self.reason,
            "memory_settings": self.memory_settings and self.memory_settings["describe"],
        }


def make_record(m: Measured, base: Measured, flops: dict, dev, t: Thresholds, eager: Measured | None = None, *,
                ran: bool = True, stopped: str | None = None) -> PrecisionRecord:
    """`m`'s record: measurements, comparisons with the baseline `base` (fp32 in the first mode) and,
    compiled, with the same precision `eager`; metadata. `ran`, `stopped`: what the run's log says of its plan."""
    p, prec = m.plan, m.plan.precision
    rec = PrecisionRecord(p.name, p.mode, str(prec.dtype).replace("torch.", ""), prec.native, ran, p.forced,
                          prec.reason, p.compile, run_metadata(dev, prec.dtype), stopped=stopped,
                          weights=prec.describe_weights(p.adapter.stored_dtype), checkpointing=p.checkpointing,
                          memory_row=p.memory_row, memory_settings=_memory_settings(p))
    if not ran or stopped:
        return rec
    step_ms = m.speed.step_ms
    vs_eager = p.mode != "eager" and p.memory_row is None and eager is not None and eager.speed is not None
    rec.speed = replace(m.speed, speedup=None if p is base.plan else speedup(base.speed.step_ms, step_ms),
                        speedup_vs_eager=speedup(eager.speed.step_ms, step_ms) if vs_eager else None)
    achieved = flops["per_step"] / (step_ms.median / 1e3) / 1e12
    probe = probe_summary(prec.dtype, m.probe_size, list(m.probe_ms))
    # The best probe matmul: a peak is what the device reached, and other load only slows it.
    peak = probe["tflops"]["max"]
    rec.mfu = {"achieved_tflops": achieved, "peak_tflops": peak, "mfu": achieved / peak, "probe": probe}
    mem = rec.memory = dict(m.memory)
    mem["reduction"] = {"static": reduction(_static(base.memory), _static(mem)),
                        "activations": reduction(base.memory["activation_bytes"], mem["activation_bytes"]),
                        "total": reduction(base.memory["total_bytes"], mem["total_bytes"]),
                        "peak_allocated": reduction(base.memory["peak_allocated_bytes"], mem["peak_allocated_bytes"])}
    if p.checkpointing and vs_eager:
        rec.vs_without = {"step_time_ratio": step_ms.median / eager.speed.step_ms.median,
                          "activation_bytes": mem["activation_bytes"],
                          "activation_bytes_without": eager.memory["activation_bytes"],
                          "activation_reduction": reduction(eager.memory["activation_bytes"], mem["activation_bytes"])}
    if m.accuracy is not None:
        acc = rec.accuracy = dict(m.accuracy)
        acc["val_loss_diff"] = acc["val_loss"] - base.accuracy["val_loss"]
        acc["val_accuracy_diff"] = acc["val_accuracy"] - base.accuracy["val_accuracy"]
        acc["parity"] = parity(base.accuracy["loss_curve"], acc["loss_curve"], t.parity_tolerance)
    return rec


def _memory_settings(p: Plan) -> dict | None:
    """A memory row's settings as decided for its run, or as asked where it was skipped before deciding."""
    if p.memory is not None:
        return p.memory.to_dict()
    if p.memory_row is None:
        return None
    asked = memory_setting(p.memory_row)
    return {**asked.to_dict(), "describe": asked.describe()}


def _static(memory: dict) -> int:
    """Weights + gradients + optimizer state: what a precision's weight dtype decides, whatever the batch."""
    return memory["weights_bytes"] + memory["grads_bytes"] + memory["optimizer_state_bytes"]
